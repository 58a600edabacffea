use std::path::PathBuf;

/// Errors of the training runner.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("not yet supported: {0}")]
    NotYetSupported(String),
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error(
        "loss became {loss} at step {step}; training stopped instead of continuing on NaN/inf (lower --lr, enable --grad-clip, or use a wider precision)"
    )]
    NonFiniteLoss { step: usize, loss: f64 },
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}
