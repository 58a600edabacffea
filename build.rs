//! Under `tch` (Burn's LibTorch backend), the binaries keep libtorch.so as a dependency though
//! they use none of its symbols: loading it loads libtorch_cuda.so, whose initialisers register
//! CUDA with LibTorch (tch's README links the same way). libtorch_cuda.so's own dependencies
//! (cuBLAS, cuDNN, ...) come with the PyTorch the binary runs against, not with the LibTorch it
//! is built against (scripts/libtorch.sh), so they may be missing at link time.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TCH").is_some()
        && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
    {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined");
    }
}
