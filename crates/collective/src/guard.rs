//! What the engines without shared memory (MPI, NCCL) use to fail instead of hanging or
//! corrupting memory: an agreement on each call before it runs, and a watchdog.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::{CollectiveError, DType};

/// The call a rank makes as it leaves the group (its communicator dropped, its work done or
/// failed): a rank still working meets it at its next call, which fails saying so, rather
/// than waiting for a rank that is gone.
pub(crate) const LEAVE: &str = "leave";

/// The integers of one agreement: a call's four and their negations.
pub(crate) const CALL_LEN: usize = 8;

/// A rank's side of the agreement that precedes every call of the engines without shared
/// memory (MPI, NCCL): every rank makes the same call (op, dtype, and length where it must
/// match), and none has left the group. A call is four integers (the op's code, the dtype,
/// the length, and the rank plus one when it is leaving, else 0) and their negations, whose element-wise max over
/// the ranks [`Agreement::read`] reads: max(x) and max(-x) = -min(x) in one all-reduce.
#[derive(Default)]
pub(crate) struct Agreement {
    /// The rank that left the group, plus one (0: none has): no later call can complete.
    peer_left: AtomicUsize,
}

impl Agreement {
    /// What this rank contributes to the agreement on `op`; an error once a rank has left.
    pub(crate) fn propose(
        &self,
        me: usize,
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<[i64; CALL_LEN], CollectiveError> {
        if let Some(left) = self.left() {
            return Err(CollectiveError::PeerLeft { me, op, left });
        }
        let code = op
            .bytes()
            .fold(0i64, |h, b| h.wrapping_mul(31).wrapping_add(b as i64));
        let leaving = if op == LEAVE { me as i64 + 1 } else { 0 };
        let mine = [code, dtype as i64, len.map_or(-1, |l| l as i64), leaving];
        Ok([
            mine[0], mine[1], mine[2], mine[3], -mine[0], -mine[1], -mine[2], -mine[3],
        ])
    }

    /// Whether every rank made the same call, from the max over the ranks of their
    /// proposals; a rank that leaves itself takes whatever the others did.
    pub(crate) fn read(
        &self,
        me: usize,
        max: &[i64; CALL_LEN],
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<(), CollectiveError> {
        if op == LEAVE {
            return Ok(());
        }
        if max[3] > 0 {
            let left = (max[3] - 1) as usize;
            self.peer_left.store(left + 1, Ordering::Relaxed);
            return Err(CollectiveError::PeerLeft { me, op, left });
        }
        if max[0] != -max[4] || max[1] != -max[5] || max[2] != -max[6] {
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

    /// Whether this rank, dropping its communicator, is to leave the group through one more
    /// agreement: not once it has met another rank's leave (that rank is gone).
    pub(crate) fn leaves(&self) -> bool {
        self.left().is_none()
    }

    /// The rank whose leave this rank has met.
    fn left(&self) -> Option<usize> {
        self.peer_left.load(Ordering::Relaxed).checked_sub(1)
    }
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
        let timeout_ms = timeout.min(crate::MAX_TIMEOUT).as_millis() as u64;
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
                        "rank {rank}: {op} did not complete within {:.1} s: a peer rank died or hangs (if it is only slow, raise the timeout: --collective-timeout of the training runs); stopping this rank so that the launcher stops the job",
                        timeout_ms as f64 / 1e3
                    );
                    crate::end_process(crate::EX_TEMPFAIL);
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
