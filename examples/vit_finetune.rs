//! README's main job: finetune a pretrained ViT-S/14 on real labelled images.
//!
//! Not yet implemented: the ViT model, its weights and the image data arrive with the models
//! issue. Until then this example says so and exits non-zero rather than pretending to train.

fn main() -> std::process::ExitCode {
    burnscale::exit_code(Err(anyhow::anyhow!(
        "vit_finetune is not yet implemented: the ViT model lands with the models issue. \
         Today, train minGPT instead: cargo run --release --example mingpt_char"
    )))
}
