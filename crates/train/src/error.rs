use std::path::PathBuf;

use burnscale_collective::CollectiveError;
use burnscale_precision::Precision;
use burnscale_shard::ShardError;

use crate::checkpoint::CheckpointError;

/// Errors of the training runner.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error("{budget} per rank is less than planned ({hint}):{planned}")]
    OverBudget {
        budget: String,
        planned: String,
        hint: &'static str,
    },
    #[error("invalid data: {0}")]
    InvalidData(String),
    #[error(
        "{quantity}{} became {value} at step {step} under --precision {precision}; training stopped before anything of this step was saved, instead of continuing on NaN/inf ({}{})",
        parameter.as_ref().map(|p| format!(" of {p}")).unwrap_or_default(),
        non_finite_hint(precision),
        if *f16_reduce { "; gradients reduced in f16 (--grad-reduce-dtype f16) without a loss scaler overflow above 65504 and flush below 6e-8: reduce in bf16 or f32, or train 16-mixed" } else { "" }
    )]
    NonFinite {
        /// What was not finite: the step's loss, its gradients' norm (an update that would
        /// write NaN/inf into the weights), or a weight about to be saved.
        quantity: &'static str,
        /// The parameter a weight that was not finite belongs to.
        parameter: Option<String>,
        value: f64,
        step: usize,
        precision: Precision,
        /// Whether gradients were reduced in f16 without 16-mixed's loss scaler.
        f16_reduce: bool,
    },
    #[error(
        "stopped on request after step {step}: {}",
        match checkpoint {
            Some(dir) => format!("its checkpoint is in {} (--resume goes on from it)", dir.display()),
            None => "no checkpoint written (without --checkpoint-dir)".to_string(),
        }
    )]
    Stopped {
        step: usize,
        /// The checkpoint of that step, when the run writes them.
        checkpoint: Option<PathBuf>,
    },
    #[error(transparent)]
    Precision(#[from] burnscale_precision::PrecisionError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(
        "the last step's checkpoint was not written: {error}; the trained model was saved to {} (--save)",
        saved.display()
    )]
    LastCheckpoint {
        error: Box<TrainError>,
        /// Where `--save` wrote the model all the same.
        saved: PathBuf,
    },
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    #[error("--offload-dir {path}: {source}")]
    Offload {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Save(#[from] burnscale_nn::weights::WeightError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the device failed around the memory plan's dry run: {0}")]
    DryRun(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{weights} were trained on this run's data split another way ({differences}, as {config} records): this run's test set would hold examples they trained on; give their split's flags, or weights trained on other data"
    )]
    HeldOut {
        weights: PathBuf,
        config: PathBuf,
        differences: String,
    },
}

impl TrainError {
    /// Whether this rank stopped because another rank failed (not the root cause).
    pub fn is_peer_failure(&self) -> bool {
        let collective = match self {
            TrainError::Collective(e) | TrainError::Shard(ShardError::Collective(e)) => e,
            TrainError::Checkpoint(
                CheckpointError::PeerWrite { .. } | CheckpointError::PeerRead { .. },
            ) => return true,
            _ => return false,
        };
        matches!(
            collective,
            CollectiveError::PeerFailed { .. }
                | CollectiveError::PeerLeft { .. }
                | CollectiveError::Timeout { .. }
        )
    }
}

impl TrainError {
    /// `Err(NonFinite)` naming `parameter` when `values`, its weights about to be saved after
    /// `step`, hold a NaN or inf: an update of finite gradients can make them so (16-true
    /// Adam dividing by its epsilon, which f16 rounds to 0), and a checkpoint or `--save` of
    /// them would keep nothing to resume or load.
    pub(crate) fn check_finite_weights(
        parameter: &str,
        values: impl IntoIterator<Item = f32>,
        step: usize,
        precision: Precision,
    ) -> Result<(), TrainError> {
        match values.into_iter().find(|v| !v.is_finite()) {
            Some(value) => Err(TrainError::NonFinite {
                quantity: "a weight",
                parameter: Some(parameter.to_string()),
                value: value.into(),
                step,
                precision,
                f16_reduce: false,
            }),
            None => Ok(()),
        }
    }
}

fn non_finite_hint(precision: &Precision) -> &'static str {
    if *precision == Precision::F16True {
        "f16 holds only magnitudes up to 65504 and flushes values below 6e-8 to zero: activations or optimizer updates overflowed, or Adam divided by its epsilon, whose default 1e-8 is 0 in f16; use bf16-true, 16-mixed with its loss scaler, or an --adam-epsilon f16 holds (1e-4)"
    } else {
        "lower --lr, enable --grad-clip, or use a wider precision"
    }
}
