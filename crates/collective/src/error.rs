/// Why a collective did not complete. Every variant names the rank(s) involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {me}: {op} aborted because rank {failed} failed: {reason}")]
    PeerFailed {
        me: usize,
        op: &'static str,
        failed: usize,
        reason: String,
    },
    #[error(
        "rank {me}: {op} aborted because rank {left} left the group (it stopped: its own error says why)"
    )]
    PeerLeft {
        me: usize,
        op: &'static str,
        /// The rank that left (the highest, when several left at one call).
        left: usize,
    },
    #[error(
        "rank {me}: {op} timed out after {secs:.1} s waiting for rank(s) {missing:?} (if they are only slow, raise the timeout: --collective-timeout of the training runs)"
    )]
    Timeout {
        me: usize,
        op: &'static str,
        secs: f64,
        missing: Vec<usize>,
    },
    #[error("rank {me}: mismatched collective calls: {detail}")]
    Mismatch { me: usize, detail: String },
    #[error("invalid collective call: {0}")]
    Invalid(String),
    #[error("rank {me}: NCCL/CUDA error in {op}: {detail}")]
    Device {
        me: usize,
        op: &'static str,
        detail: String,
    },
    #[error("rank {me}: MPI error in {op}: {detail}")]
    Mpi {
        me: usize,
        op: &'static str,
        detail: String,
    },
}
