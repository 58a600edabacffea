//! Stopping a run before its last step, on request: Ctrl-C or a scheduler's SIGTERM in a
//! training example, or a service cancelling its job. Every rank finishes the step it is in,
//! the ranks agree on that step (a request seen by any one rank stops them all), a
//! checkpoint of it is written when `--checkpoint-dir` is given (so that `--resume` goes on
//! from there), and `train` returns [`crate::TrainError::Stopped`], having removed what the
//! run made (`--offload-dir`'s files).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use signal_hook::SigId;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::{flag, low_level};

/// A request to stop, shared between whoever asks and the run (`TrainArgs::stop`).
#[derive(Debug, Clone, Default)]
pub struct StopFlag {
    asked: Arc<AtomicBool>,
    /// The signal actions [`StopFlag::on_signals`] registered, until [`StopFlag::release`].
    actions: Arc<Mutex<Option<Vec<SigId>>>>,
}

/// Flags that signals raise, registered and not yet released, in this process.
static LISTENING: AtomicUsize = AtomicUsize::new(0);

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
    /// waiting for a step to end. A handler the program has of its own runs as well, and keeps
    /// the signal after [`StopFlag::release`] when it was installed before the process's first
    /// flag (one installed later through signal-hook runs after the action that ends the
    /// process where no flag listens: install it first).
    pub fn on_signals() -> io::Result<Self> {
        let stop = Self::new();
        stop.listen_to_signals()?;
        Ok(stop)
    }

    /// Makes SIGINT, SIGTERM and SIGUSR1 raise this flag as they raise
    /// [`StopFlag::on_signals`]'s, until [`StopFlag::release`]: for a flag the program raises
    /// itself too. `false`, registering nothing, when it listens already.
    pub fn listen_to_signals(&self) -> io::Result<bool> {
        if self.actions().is_some() {
            return Ok(false);
        }
        for signal in [SIGINT, SIGTERM, SIGUSR1] {
            end_the_process_when_unheard(signal)?;
        }
        LISTENING.fetch_add(1, Ordering::SeqCst);
        *self.actions() = Some(Vec::new());
        // Actions run in the order registered: the shutdown sees the flag as it was before
        // this signal.
        let register = || -> io::Result<()> {
            let shutdown = flag::register_conditional_shutdown(SIGINT, 130, self.asked.clone())?;
            self.actions().get_or_insert_default().push(shutdown);
            for signal in [SIGINT, SIGTERM, SIGUSR1] {
                let action = flag::register(signal, self.asked.clone())?;
                self.actions().get_or_insert_default().push(action);
            }
            Ok(())
        };
        if let Err(e) = register() {
            self.release();
            return Err(e);
        }
        Ok(true)
    }

    /// Asks the run to stop after the step it is in.
    pub fn request(&self) {
        self.asked.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// Removes the actions of [`StopFlag::on_signals`], once the run is over: the signals then
    /// do what they did before it, so what the program does after the run (mingpt_char's
    /// sampling) stops on them as any program does, and a program's own handler keeps them.
    pub fn release(&self) {
        if let Some(actions) = self.actions().take() {
            // First: a signal between the two is the program's again, not lost.
            LISTENING.fetch_sub(1, Ordering::SeqCst);
            for action in actions {
                low_level::unregister(action);
            }
        }
    }

    /// The registered actions: `Some` from [`StopFlag::on_signals`] to [`StopFlag::release`].
    fn actions(&self) -> std::sync::MutexGuard<'_, Option<Vec<SigId>>> {
        self.actions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Where nothing handled `signal` before this process's first flag, its default action (to
/// end the process) whenever no flag listens: signal-hook's handler, once installed, stays, and
/// with no action left would swallow the signal. Registered once a process; a program's own
/// handler (its own, or signal-hook's with its actions) keeps the signal to itself.
fn end_the_process_when_unheard(signal: libc::c_int) -> io::Result<()> {
    static SEEN: Mutex<Vec<libc::c_int>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    if seen.contains(&signal) {
        return Ok(());
    }
    // SAFETY: reads the disposition only (no new action), into a zeroed `sigaction`.
    let handled = unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
            return Err(io::Error::last_os_error());
        }
        old.sa_sigaction != libc::SIG_DFL
    };
    if !handled {
        let unheard = move || {
            if LISTENING.load(Ordering::SeqCst) == 0 {
                let _ = low_level::emulate_default_handler(signal);
            }
        };
        // SAFETY: the action reads an atomic and calls signal-hook's emulation of the default
        // action, which is async-signal-safe.
        unsafe { low_level::register(signal, unheard) }?;
    }
    seen.push(signal);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use signal_hook::consts::{SIGTERM, SIGUSR1};
    use signal_hook::low_level::raise;

    use super::*;

    /// How this test binary ends when it runs test `name` alone in a child process, with the
    /// environment variable `child` set (the test's own branch for the child).
    fn in_child(name: &str, child: &str) -> std::process::ExitStatus {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads", "1"])
            .env(child, "1")
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap()
    }

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
        let status = in_child("stop::tests::released_signals_end_the_process_again", CHILD);
        assert_eq!(status.signal(), Some(SIGTERM), "{status}");
    }

    /// A program with a SIGTERM handler of its own (a service) keeps it once a run's flag is
    /// released: the signal raises its flag and the process goes on. In a child process.
    #[test]
    fn a_programs_own_handler_outlives_the_flag() {
        const CHILD: &str = "BURNSCALE_OWN_HANDLER_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let own = Arc::new(AtomicBool::new(false));
            flag::register(SIGTERM, own.clone()).unwrap();
            for _ in 0..2 {
                StopFlag::on_signals().unwrap().release();
            }
            raise(SIGTERM).unwrap();
            assert!(
                own.load(Ordering::SeqCst),
                "the program's own handler did not run"
            );
            return;
        }
        let status = in_child(
            "stop::tests::a_programs_own_handler_outlives_the_flag",
            CHILD,
        );
        assert!(status.success(), "{status}");
    }
}
