//! Stopping a run before its last step, on request: Ctrl-C or a scheduler's SIGTERM in a
//! training example, or a service cancelling its job. Every rank finishes the step it is in,
//! the ranks agree on that step (a request seen by any one rank stops them all), a
//! checkpoint of it is written when `--checkpoint-dir` is given (so that `--resume` goes on
//! from there), and `train` returns [`crate::TrainError::Stopped`], having removed what the
//! run made (`--offload-dir`'s files).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A request to stop, shared between whoever asks and the run (`TrainArgs::stop`).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub fn new() -> Self {
        Self::default()
    }

    /// A flag that SIGINT (Ctrl-C), SIGTERM and SIGUSR1 raise. A second Ctrl-C ends the
    /// process at once (exit status 130, as the default handler would have); SIGTERM and
    /// SIGUSR1 only ask, however many come: a scheduler may send SIGTERM to every process
    /// of a job and mpirun forward it too, and both send SIGKILL when they will not wait.
    /// SIGUSR1 is for mpirun, which forwards it to every rank, where its own SIGINT or
    /// SIGTERM ends the ranks (SIGTERM, then SIGKILL) without waiting for a step to end.
    pub fn on_signals() -> std::io::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
        let stop = Self::new();
        // Registered first, so it sees the flag as it was before this signal.
        signal_hook::flag::register_conditional_shutdown(SIGINT, 130, stop.0.clone())?;
        for signal in [SIGINT, SIGTERM, SIGUSR1] {
            signal_hook::flag::register(signal, stop.0.clone())?;
        }
        Ok(stop)
    }

    /// Asks the run to stop after the step it is in.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use signal_hook::consts::{SIGTERM, SIGUSR1};
    use signal_hook::low_level::raise;

    use super::*;

    /// SIGTERM and SIGUSR1 ask, however many come: a second one does not end the process
    /// (which would end this test binary), as a second Ctrl-C would.
    #[test]
    fn repeated_sigterm_and_sigusr1_only_ask() {
        let stop = StopFlag::on_signals().unwrap();
        assert!(!stop.requested());
        for signal in [SIGTERM, SIGTERM, SIGUSR1, SIGUSR1] {
            raise(signal).unwrap(); // delivered to this thread before it returns
            assert!(stop.requested());
        }
    }
}
