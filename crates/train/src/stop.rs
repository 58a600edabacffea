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
pub struct StopFlag {
    asked: Arc<AtomicBool>,
    /// Set once the run is over: signals then act as they would without this flag.
    released: Arc<AtomicBool>,
}

impl StopFlag {
    pub fn new() -> Self {
        Self::default()
    }

    /// A flag that SIGINT (Ctrl-C), SIGTERM and SIGUSR1 raise, until [`StopFlag::release`].
    /// A Ctrl-C after any request ends the process at once (exit status 130, as the default
    /// handler would have); SIGTERM and SIGUSR1 only ask, however many come: a scheduler
    /// may send SIGTERM to every process of a job and mpirun forward it too, and both send
    /// SIGKILL when they will not wait. SIGUSR1 is for mpirun, which forwards it to every
    /// rank, where its own SIGINT or SIGTERM ends the ranks (SIGTERM, then SIGKILL) without
    /// waiting for a step to end.
    pub fn on_signals() -> std::io::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
        use signal_hook::flag;
        let stop = Self::new();
        // Actions run in the order registered: each sees the flags as they were before
        // this signal.
        for signal in [SIGINT, SIGTERM, SIGUSR1] {
            flag::register_conditional_default(signal, stop.released.clone())?;
        }
        flag::register_conditional_shutdown(SIGINT, 130, stop.asked.clone())?;
        for signal in [SIGINT, SIGTERM, SIGUSR1] {
            flag::register(signal, stop.asked.clone())?;
        }
        Ok(stop)
    }

    /// Asks the run to stop after the step it is in.
    pub fn request(&self) {
        self.asked.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// Gives the signals of [`StopFlag::on_signals`] back their default actions (to end the
    /// process), once the run is over: what the program does after it (mingpt_char's
    /// sampling) stops on them as any program does.
    pub fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use signal_hook::consts::{SIGTERM, SIGUSR1};
    use signal_hook::low_level::raise;

    use super::*;

    /// SIGTERM and SIGUSR1 ask, however many come: a second one does not end the process
    /// (which would end this test binary), as a Ctrl-C after a request would. Released,
    /// they end it again (not raised here: the binary's other tests would end with it).
    #[test]
    fn repeated_sigterm_and_sigusr1_only_ask() {
        let stop = StopFlag::on_signals().unwrap();
        assert!(!stop.requested());
        for signal in [SIGTERM, SIGTERM, SIGUSR1, SIGUSR1] {
            raise(signal).unwrap(); // delivered to this thread before it returns
            assert!(stop.requested());
        }
        stop.release();
    }

    /// Released, the signals end the process as they would have without the flag: checked
    /// in a child process (this test binary, running this test alone).
    #[test]
    fn released_signals_end_the_process_again() {
        const CHILD: &str = "BURNSCALE_RELEASED_SIGNAL_CHILD";
        if std::env::var_os(CHILD).is_some() {
            StopFlag::on_signals().unwrap().release();
            raise(SIGTERM).unwrap();
            return; // ends the child with status 0: the test fails
        }
        let name = "stop::tests::released_signals_end_the_process_again";
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads", "1"])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(SIGTERM), "{status}");
    }
}
