use std::path::PathBuf;

/// Everything that can go wrong building or loading a minGPT.
#[derive(Debug, thiserror::Error)]
pub enum GptError {
    #[error("invalid minGPT config: {0}")]
    InvalidConfig(String),
    #[error("unknown model preset `{0}`; choose one of: {presets}", presets = crate::GptConfig::PRESETS.join(", "))]
    UnknownPreset(String),
    #[error("cannot read weights file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a valid safetensors file ({reason}); is it truncated? re-download or re-export it"
    )]
    Format { path: PathBuf, reason: String },
    #[error("{path}: tensor `{key}` has shape {found:?}, the config expects {expected:?}{hint}")]
    Shape {
        path: PathBuf,
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
        hint: String,
    },
    #[error("{path}: tensor `{key}` has dtype {dtype}; only F32, F16 and BF16 weights load")]
    Dtype {
        path: PathBuf,
        key: String,
        dtype: String,
    },
    #[error("{path} is missing {} weight(s): {}", keys.len(), keys.join(", "))]
    MissingKeys { path: PathBuf, keys: Vec<String> },
    #[error("{path} has {} weight(s) this model does not use: {} (weights for another architecture?)", keys.len(), keys.join(", "))]
    UnexpectedKeys { path: PathBuf, keys: Vec<String> },
    #[error("cannot write {path}: {reason}")]
    Save { path: PathBuf, reason: String },
}
