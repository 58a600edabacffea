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

    /// A flag that SIGINT (Ctrl-C), SIGTERM and SIGUSR1 raise; a second signal ends the
    /// process at once, with the status a shell gives a process that signal killed (128 +
    /// its number: 130 for Ctrl-C). SIGUSR1 is for
    /// mpirun, which forwards it to every rank, where its own SIGINT or SIGTERM ends the
    /// ranks (SIGTERM, then SIGKILL) without waiting for a step to end.
    pub fn on_signals() -> std::io::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
        let stop = Self::new();
        for signal in [SIGINT, SIGTERM, SIGUSR1] {
            // Registered first, so it sees the flag as it was before this signal.
            signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, stop.0.clone())?;
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
