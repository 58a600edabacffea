#!/usr/bin/env bash
# A LibTorch for `--features tch` (Burn's LibTorch backend, `--accelerator libtorch`), taken
# from PyPI's torch wheel, which holds LibTorch's libraries and headers:
#
#     eval "$(scripts/libtorch.sh DIR cuda)"   # link against the GPU machine's PyTorch
#     eval "$(scripts/libtorch.sh DIR cpu)"    # run here, on LibTorch's CPU
#     cargo build --release --features tch --example vit_finetune
#
# It prints the environment cargo and the binary need (LIBTORCH, LD_LIBRARY_PATH, ...).
#
# The version is the lent GPU machine's PyTorch (2.11.0+cu130): a binary links against the
# LibTorch it will load there (its LD_LIBRARY_PATH names that PyTorch's torch/lib), and
# LibTorch's C++ symbols change between releases. tch 0.22, which Burn 0.22 uses, expects
# 2.9.0; LIBTORCH_BYPASS_VERSION_CHECK lets it build against 2.11.
#
# cuda: every library of the wheel. libtorch_cuda.so needs CUDA's libraries (cuBLAS, cuDNN,
# ...), which are not downloaded: the link allows them undefined (build.rs), and the GPU
# machine's PyTorch provides them at run time.
# cpu: the CPU libraries only, and a stand-in for libtorch.so (which would load
# libtorch_cuda.so); libtorch_cpu.so still needs CUDA's runtime and CUPTI, taken from their
# wheels (a few MB, and they load without a GPU).
set -euo pipefail
if [ $# -ne 2 ] || { [ "$2" != cuda ] && [ "$2" != cpu ]; }; then
    echo "usage: $0 DIR cuda|cpu" >&2
    exit 2
fi
version=2.11.0
dir=$(mkdir -p "$1" && cd "$1" && pwd)
kind=$2

fetch() { # PACKAGE==VERSION: its wheel, unpacked under $dir/unpacked
    local wheel
    pip download --quiet --no-deps --dest "$dir/wheels" "$1" >&2
    for wheel in "$dir"/wheels/*.whl; do
        [ -e "$dir/unpacked/.$(basename "$wheel")" ] && continue
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
            "$wheel" "$dir/unpacked" >&2
        touch "$dir/unpacked/.$(basename "$wheel")"
    done
}

fetch "torch==$version"
torch=$dir/unpacked/torch
grep -q "__version__ = '$version" "$torch/version.py" \
    || { echo "$torch is not PyTorch $version" >&2; exit 1; }
echo "export LIBTORCH_BYPASS_VERSION_CHECK=1 LIBTORCH_CXX11_ABI=1"
if [ "$kind" = cuda ]; then
    echo "export LIBTORCH=$torch"
    exit 0
fi
fetch "nvidia-cuda-runtime==13.0.*"
fetch "nvidia-cuda-cupti==13.0.*"
cpu=$dir/cpu
mkdir -p "$cpu/lib"
ln -sfn "$torch/include" "$cpu/include"
for lib in libc10.so libtorch_cpu.so libgomp.so.1 libshm.so libtorch_global_deps.so; do
    ln -sf "$torch/lib/$lib" "$cpu/lib/$lib"
done
for lib in libcudart.so.13 libcupti.so.13; do
    ln -sf "$(find "$dir/unpacked/nvidia" -name "$lib" | head -n1)" "$cpu/lib/$lib"
done
echo 'void burnscale_libtorch_cpu_only(void) {}' >"$cpu/stand-in.c"
cc -shared -fPIC -o "$cpu/lib/libtorch.so" "$cpu/stand-in.c"
echo "export LIBTORCH=$cpu"
echo "export LD_LIBRARY_PATH=$cpu/lib:\${LD_LIBRARY_PATH:-}"
