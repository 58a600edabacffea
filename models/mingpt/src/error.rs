/// Everything that can go wrong building or loading a minGPT.
#[derive(Debug, thiserror::Error)]
pub enum GptError {
    #[error("invalid minGPT config: {0}")]
    InvalidConfig(String),
    #[error("unknown model preset `{0}`; choose one of: {presets}", presets = crate::GptConfig::PRESETS.join(", "))]
    UnknownPreset(String),
    #[error(transparent)]
    Weights(#[from] burnscale_nn::weights::WeightError),
    #[error("cannot generate from this prompt: {0}")]
    Prompt(String),
    #[error("cannot sample with these settings: {0}")]
    Sampling(String),
    #[error("generating text failed on the device: {0}")]
    Generate(#[from] burn::tensor::ExecutionError),
}
