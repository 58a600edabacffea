//! The crash tests' fault injection: with `BURNSCALE_KILL=<point>:<step>:<rank>` in its
//! environment, that rank's process kills itself (SIGKILL, as `kill -9` or the kernel's
//! out-of-memory killer would) at that point of that step. Nothing else reads it.

use std::sync::OnceLock;

/// Where a rank can be killed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Point {
    /// After the step's micro-steps, before its optimizer step: the other ranks are inside
    /// the step's collectives.
    Step,
    /// With this rank's file of the step's checkpoint half written.
    Save,
}

/// Kills this process if `BURNSCALE_KILL` names this point, step and rank. The environment
/// is read once: this runs at every training step.
pub(crate) fn kill_if_asked(point: Point, step: usize, rank: usize) {
    static ASKED: OnceLock<Option<String>> = OnceLock::new();
    let Some(asked) = ASKED.get_or_init(|| std::env::var("BURNSCALE_KILL").ok()) else {
        return;
    };
    let name = match point {
        Point::Step => "step",
        Point::Save => "save",
    };
    if *asked == format!("{name}:{step}:{rank}") {
        // SAFETY: a signal to this process; SIGKILL cannot be caught, so nothing runs after.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
