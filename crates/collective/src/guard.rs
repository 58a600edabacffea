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
/// match, or a broadcast's root), and none has left the group. A call is four integers (the
/// op's code, the dtype, the length or the root, and the rank plus one when it is leaving,
/// else 0) and their negations, whose element-wise max over
/// the ranks [`Agreement::read`] reads: max(x) and max(-x) = -min(x) in one all-reduce.
#[derive(Default)]
pub(crate) struct Agreement {
    /// The rank that left the group, plus one (0: none has): no later call can complete.
    peer_left: AtomicUsize,
}

impl Agreement {
    /// What this rank contributes to the agreement on `op` (`len`: the length where it must
    /// match, or a broadcast's root); an error once a rank has left.
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
                    match (op, len) {
                        ("broadcast", Some(root)) => format!(" from root {root}"),
                        (_, Some(l)) => format!(" with {l} elements"),
                        (_, None) => String::new(),
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The agreement of `calls` (rank, op, len), as the all-reduce of their proposals gives
    /// it, read by rank 0.
    fn agreed(calls: &[(usize, &'static str, Option<usize>)]) -> Result<(), CollectiveError> {
        let agreement = Agreement::default();
        let max = calls
            .iter()
            .map(|&(rank, op, len)| agreement.propose(rank, op, DType::F32, len).unwrap())
            .reduce(|a, b| std::array::from_fn(|i| a[i].max(b[i])))
            .unwrap();
        let (_, op, len) = calls[0];
        agreement.read(0, &max, op, DType::F32, len)
    }

    #[test]
    fn ranks_agree_on_the_same_call_and_name_what_differs() {
        assert!(agreed(&[(0, "broadcast", Some(0)), (1, "broadcast", Some(0))]).is_ok());
        let roots = agreed(&[(0, "broadcast", Some(0)), (1, "broadcast", Some(1))]);
        let err = roots.unwrap_err().to_string();
        assert!(err.contains("broadcast on F32 from root 0"), "{err}");
        let lengths = agreed(&[(0, "all_reduce", Some(4)), (1, "all_reduce", Some(5))]);
        let err = lengths.unwrap_err().to_string();
        assert!(err.contains("all_reduce on F32 with 4 elements"), "{err}");
    }

    /// A rank that leaves is named to the others (the highest, when several leave at once).
    #[test]
    fn a_rank_that_leaves_is_named() {
        let err = agreed(&[
            (0, "all_reduce", None),
            (2, LEAVE, None),
            (1, "all_reduce", None),
        ])
        .unwrap_err();
        assert_eq!(
            err,
            CollectiveError::PeerLeft {
                me: 0,
                op: "all_reduce",
                left: 2
            }
        );
    }
}
