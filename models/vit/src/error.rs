use burnscale_nn::weights::WeightError;

/// Everything that can go wrong building a ViT, loading its weights or feeding it images.
#[derive(Debug, thiserror::Error)]
pub enum VitError {
    #[error("invalid ViT config: {0}")]
    InvalidConfig(String),
    #[error("unknown ViT preset `{0}`; choose one of: {presets}", presets = crate::VitConfig::PRESETS.join(", "))]
    UnknownPreset(String),
    #[error(
        "images of shape {found:?} do not fit this ViT, which takes [batch, {channels}, {size}, {size}]"
    )]
    ImageShape {
        found: Vec<usize>,
        channels: usize,
        size: usize,
    },
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("{path}: {reason}")]
    Preprocessor {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("{path}: {reason}")]
    Onnx {
        path: std::path::PathBuf,
        reason: String,
    },
}
