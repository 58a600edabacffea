//! What the engines without shared memory (MPI, NCCL) use to fail instead of hanging or
//! corrupting memory: an agreement on each call before it runs, and a watchdog.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::{CollectiveError, DType};

/// The call a rank makes as it leaves the group (its communicator dropped, its work done or
/// failed): a rank still working meets it at its next call, which fails naming it, rather than
/// waiting for a rank that is gone.
pub(crate) const LEAVE: &str = "leave";

fn op_code(op: &str) -> i64 {
    op.bytes()
        .fold(0i64, |h, b| h.wrapping_mul(31).wrapping_add(b as i64))
}

/// This rank's call (op, dtype, and length where it must match) as six integers whose
/// element-wise max over the ranks [`check`] reads: max(x) and max(-x) = -min(x) in one
/// all-reduce.
pub(crate) fn call(op: &str, dtype: DType, len: Option<usize>) -> [i64; 6] {
    let mine = [op_code(op), dtype as i64, len.map_or(-1, |l| l as i64)];
    [mine[0], mine[1], mine[2], -mine[0], -mine[1], -mine[2]]
}

/// Whether a rank left the group in the call whose max over the ranks is `max` (when calls
/// differ, the leave's code is the largest or the smallest of them).
pub(crate) fn left(max: &[i64; 6]) -> bool {
    let code = op_code(LEAVE);
    max[0] == code || -max[3] == code
}

/// Whether every rank made the same call, from the max over the ranks of their [`call`]s.
pub(crate) fn check(
    me: usize,
    max: &[i64; 6],
    op: &str,
    dtype: DType,
    len: Option<usize>,
) -> Result<(), CollectiveError> {
    if max[0] != -max[3] || max[1] != -max[4] || max[2] != -max[5] {
        return Err(CollectiveError::Mismatch {
            me,
            detail: format!(
                "this rank called {op} on {dtype:?}{}, and not every rank made the same call",
                len.map(|l| format!(" with {l} elements"))
                    .unwrap_or_default()
            ),
        });
    }
    Ok(())
}

/// Ends the process when a collective runs past the timeout.
pub(crate) struct Watchdog {
    started: Instant,
    timeout_ms: u64,
    /// Milliseconds since `started` by which the current collective must end; 0 when idle.
    deadline_ms: AtomicU64,
    op: std::sync::Mutex<&'static str>,
}

impl Watchdog {
    pub(crate) fn start(rank: usize, timeout: Duration) -> Arc<Self> {
        let timeout_ms = timeout.as_millis() as u64;
        let dog = Arc::new(Self {
            started: Instant::now(),
            timeout_ms,
            deadline_ms: AtomicU64::new(0),
            op: std::sync::Mutex::new(""),
        });
        let watched = Arc::downgrade(&dog);
        std::thread::spawn(move || {
            while let Some(dog) = watched.upgrade() {
                let deadline = dog.deadline_ms.load(Ordering::Relaxed);
                if deadline != 0 && dog.started.elapsed().as_millis() as u64 > deadline {
                    let op = *dog.op.lock().unwrap_or_else(|p| p.into_inner());
                    eprintln!(
                        "rank {rank}: {op} did not complete within {:.1} s: a peer rank died or hangs; stopping this rank so that the launcher stops the job",
                        timeout_ms as f64 / 1e3
                    );
                    std::process::exit(75); // EX_TEMPFAIL
                }
                drop(dog);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        dog
    }

    pub(crate) fn watch(&self, op: &'static str) -> WatchGuard<'_> {
        *self.op.lock().unwrap_or_else(|p| p.into_inner()) = op;
        let now = self.started.elapsed().as_millis() as u64;
        self.deadline_ms
            .store(now + self.timeout_ms, Ordering::Relaxed);
        WatchGuard(self)
    }
}

pub(crate) struct WatchGuard<'a>(&'a Watchdog);

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.0.deadline_ms.store(0, Ordering::Relaxed);
    }
}
