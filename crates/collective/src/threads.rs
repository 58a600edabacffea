//! N ranks as threads of one process.
//!
//! Every collective is built on one rendezvous, `ThreadComm::exchange`: each rank posts a
//! shared handle to its contribution and gets everyone's back, without copying. An
//! all-reduce is then a reduce-scatter (each rank reduces its own chunk, in parallel) and an
//! all-gather of the chunks. A rank that panics or drops its handle marks the group failed;
//! every rank waiting in, or later entering, a collective returns an error naming it, and a
//! rank waiting longer than the timeout returns an error naming the ranks that never came.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use crate::buffer::reduce_range_into;
use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp, shard_range};

/// The time a rank waits for the others in one collective in this crate's checks and the
/// examples' (the training runs take `--collective-timeout`, 600 s unless given).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The least time ranks still running after the group failed for good (a rank panicked, or
/// the others timed out waiting for one) have to end before the process does: a short
/// timeout finds an absent rank fast, and a rank only slow (a save, a kernel compilation)
/// still reaches its next collective and fails there on its own.
pub const STUCK_GRACE: Duration = Duration::from_secs(10);

/// What a rank posts to a rendezvous: the call it is making and its data.
struct Post {
    op: &'static str,
    /// A broadcast's root, which every rank must name alike.
    root: Option<usize>,
    dtype: DType,
    len: usize,
    data: Arc<Buffer>,
}

#[derive(Default)]
struct Round {
    /// Completed rendezvous so far.
    generation: u64,
    posts: Vec<Option<Arc<Post>>>,
    /// The posts of the last completed round, until every rank has taken them.
    ready: Vec<Arc<Post>>,
    pickups_left: usize,
    failed: Option<(usize, String)>,
    /// Whether the failure ends the run for every rank: a rank that panicked, or one that kept
    /// the others waiting past the timeout. A rank that left may only have finished its part
    /// (rank 0 saving alone after the others returned).
    fatal: bool,
}

struct Group {
    world: usize,
    timeout: Duration,
    round: Mutex<Round>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round consistent (every
        // mutation is a single assignment), and its failure is recorded by its drop guard.
        self.round
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One rank's handle on an in-process group.
pub struct ThreadComm {
    rank: usize,
    group: Arc<Group>,
}

impl ThreadComm {
    /// Handles for a group of `world` ranks, rank order.
    pub fn group(world: usize, timeout: Duration) -> Vec<ThreadComm> {
        let group = Arc::new(Group {
            world,
            timeout: timeout.min(crate::MAX_TIMEOUT),
            round: Mutex::new(Round {
                posts: vec![None; world],
                ..Round::default()
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                group: group.clone(),
            })
            .collect()
    }

    /// Runs `f` on `world` threads, one rank each, and returns their results in rank order.
    /// A rank that panics yields `Err` with its panic message; the others see a
    /// [`CollectiveError::PeerFailed`] at their next collective. When a rank panicked or
    /// kept the others waiting past `timeout`, a rank still running `timeout` (at least
    /// [`STUCK_GRACE`]) after that, stuck outside any collective where no other thread can
    /// stop it, ends the process with exit code 75 (EX_TEMPFAIL), naming it, as the MPI and
    /// NCCL watchdogs do: returning would mean joining it. A rank that only left does not
    /// start this watch: the others may go on alone.
    pub fn run<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(ThreadComm) -> T + Sync,
    ) -> Vec<Result<T, String>> {
        let comms = ThreadComm::group(world, timeout);
        let Some(group) = comms.first().map(|comm| comm.group.clone()) else {
            return Vec::new();
        };
        // The group's timeout, bounded as every deadline is.
        let grace = group.timeout.max(STUCK_GRACE);
        let stuck = move || {
            let round = group.lock();
            round
                .failed
                .as_ref()
                .filter(|_| round.fatal)
                .map(|(rank, why)| format!("rank {rank}: {why}"))
        };
        on_threads(comms, Some((grace, &stuck)), f)
    }

    /// Posts `data` for `op` (from `root`, a broadcast's) and returns every rank's post, in
    /// rank order.
    fn exchange(
        &self,
        op: &'static str,
        root: Option<usize>,
        data: Arc<Buffer>,
    ) -> Result<Vec<Arc<Post>>, CollectiveError> {
        let g = &self.group;
        let post = Arc::new(Post {
            op,
            root,
            dtype: data.dtype(),
            len: data.len(),
            data,
        });
        let deadline = Instant::now() + g.timeout;
        let mut round = g.lock();
        // Wait until the previous round has been taken by everyone.
        while round.pickups_left > 0 {
            round = self.wait(round, op, deadline)?;
        }
        self.check_failed(&round, op)?;
        round.posts[self.rank] = Some(post);
        let generation = round.generation;
        if round.posts.iter().all(Option::is_some) {
            round.ready = round.posts.iter_mut().filter_map(Option::take).collect();
            round.pickups_left = g.world;
            round.generation += 1;
            g.changed.notify_all();
        } else {
            while round.generation == generation {
                round = self.wait(round, op, deadline)?;
            }
        }
        let posts = round.ready.clone();
        round.pickups_left -= 1;
        if round.pickups_left == 0 {
            round.ready.clear();
            g.changed.notify_all();
        }
        drop(round);
        self.check_same_call(&posts)?;
        Ok(posts)
    }

    fn wait<'a>(
        &self,
        mut round: MutexGuard<'a, Round>,
        op: &'static str,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, Round>, CollectiveError> {
        self.check_failed(&round, op)?;
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (0..self.group.world)
                .filter(|&r| round.posts[r].is_none() && round.pickups_left == 0)
                .collect();
            // Blame the absent rank for everyone, before this rank's own exit blames it.
            let secs = self.group.timeout.as_secs_f64();
            if let (None, Some(&absent)) = (&round.failed, missing.first()) {
                round.failed = Some((absent, format!("it did not reach {op} within {secs:.1} s")));
                round.fatal = true;
                self.group.changed.notify_all();
            }
            return Err(CollectiveError::Timeout {
                me: self.rank,
                op,
                secs,
                missing,
            });
        }
        // No failure check after waking: the round this rank waits on may have completed
        // just before a peer left, and the caller's loop condition decides.
        let (round, _) = self
            .group
            .changed
            .wait_timeout(round, deadline - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(round)
    }

    fn check_failed(&self, round: &Round, op: &'static str) -> Result<(), CollectiveError> {
        match &round.failed {
            Some((failed, reason)) => Err(CollectiveError::PeerFailed {
                me: self.rank,
                op,
                failed: *failed,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Every rank must have made the same call with the same dtype.
    fn check_same_call(&self, posts: &[Arc<Post>]) -> Result<(), CollectiveError> {
        let first = &posts[0];
        for (rank, post) in posts.iter().enumerate() {
            if post.op != first.op || post.dtype != first.dtype || post.root != first.root {
                let from = |root: Option<usize>| match root {
                    Some(root) => format!(" from root {root}"),
                    None => String::new(),
                };
                return Err(CollectiveError::Mismatch {
                    me: self.rank,
                    detail: format!(
                        "rank 0 called {}{} on {:?}, rank {rank} called {}{} on {:?}",
                        first.op,
                        from(first.root),
                        first.dtype,
                        post.op,
                        from(post.root),
                        post.dtype
                    ),
                });
            }
        }
        Ok(())
    }

    fn check_equal_lengths(&self, posts: &[Arc<Post>]) -> Result<(), CollectiveError> {
        let first = &posts[0];
        match posts.iter().position(|p| p.len != first.len) {
            Some(rank) => Err(CollectiveError::Mismatch {
                me: self.rank,
                detail: format!(
                    "{} needs equal lengths: rank 0 has {} elements, rank {rank} has {}",
                    first.op, first.len, posts[rank].len
                ),
            }),
            None => Ok(()),
        }
    }

    /// Posts `input` for a reduce-scatter and reduces this rank's chunk into `output`.
    fn reduce_scatter_posted(
        &self,
        input: Arc<Buffer>,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let posts = self.exchange("reduce_scatter", None, input)?;
        self.reduce_scatter_posts(&posts, output, op)
    }

    fn reduce_scatter_posts(
        &self,
        posts: &[Arc<Post>],
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.check_equal_lengths(posts)?;
        let inputs: Vec<&Buffer> = posts.iter().map(|p| &*p.data).collect();
        let range = shard_range(posts[0].len, self.group.world, self.rank);
        reduce_range_into(&inputs, range, op, output);
        Ok(())
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CollectiveError> {
        // Reduce-scatter, then all-gather of the chunks. The input moves into the exchange
        // (no copy), and once every rank has moved on to the gather nobody reads it any more,
        // so its allocation takes the result.
        let dtype = buf.dtype();
        let input = Arc::new(std::mem::replace(buf, Buffer::empty(dtype)));
        let posts = self.exchange("all_reduce", None, input.clone())?;
        let mut chunk = Buffer::empty(dtype);
        self.reduce_scatter_posts(&posts, &mut chunk, op)?;
        drop(posts);
        let chunks = self.exchange("all_reduce", None, Arc::new(chunk))?;
        *buf = Arc::try_unwrap(input).unwrap_or_else(|shared| (*shared).clone());
        buf.assign_concat(dtype, chunks.iter().map(|p| &*p.data));
        Ok(())
    }

    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError> {
        let posts = self.exchange("all_gather", None, Arc::new(input.clone()))?;
        output.assign_concat(input.dtype(), posts.iter().map(|p| &*p.data));
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.reduce_scatter_posted(Arc::new(input.clone()), output, op)
    }

    /// The input moves into the exchange: no copy.
    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CollectiveError> {
        let mut output = Buffer::empty(input.dtype());
        self.reduce_scatter_posted(Arc::new(input), &mut output, op)?;
        Ok(output)
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError> {
        crate::check_root(root, self.group.world)?;
        // Only the root's data travels; the others post an empty buffer of the same dtype.
        let mine = if self.rank == root {
            buf.clone()
        } else {
            Buffer::empty(buf.dtype())
        };
        let posts = self.exchange("broadcast", Some(root), Arc::new(mine))?;
        if self.rank != root {
            *buf = (*posts[root].data).clone();
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        self.exchange("barrier", None, Arc::new(Buffer::empty(DType::F32)))
            .map(|_| ())
    }
}

impl Drop for ThreadComm {
    /// A rank leaving the group (by panic, or by finishing early) fails everyone still in it,
    /// rather than leaving them to wait for a rank that will never come.
    fn drop(&mut self) {
        let panicked = std::thread::panicking();
        let mut round = self.group.lock();
        if panicked && !round.fatal {
            round.failed = Some((self.rank, "it panicked".to_string()));
            round.fatal = true;
        } else if round.failed.is_none() {
            let reason = "it left the group (its handle was dropped)";
            round.failed = Some((self.rank, reason.to_string()));
        }
        self.group.changed.notify_all();
    }
}

/// Why ranks that are still running keep the others' results from being returned, if
/// they do; asked while waiting for the ranks.
pub(crate) type Stuck<'a> = &'a (dyn Fn() -> Option<String> + Sync);

/// Runs `f` with each of `comms` (rank order) on a thread of its own, and returns their
/// results in rank order; a rank that panics yields `Err` with its panic message. With
/// `stuck`, ranks still running `grace` after `stuck` first gives a reason end the process
/// (exit code 75, naming them and the reason).
pub(crate) fn on_threads<C: Send, T: Send>(
    comms: Vec<C>,
    stuck: Option<(Duration, Stuck<'_>)>,
    f: impl Fn(C) -> T + Sync,
) -> Vec<Result<T, String>> {
    std::thread::scope(|scope| {
        let (finished, finishing) = mpsc::channel();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (f, finished) = (&f, finished.clone());
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        // Sent when the rank ends, by return or by panic.
                        let _finished = Finished(rank, finished);
                        f(comm)
                    })
                    .map_err(|e| e.to_string())
            })
            .collect();
        drop(finished);
        if let Some((grace, why)) = stuck {
            let running = handles.iter().map(Result::is_ok).collect();
            end_if_stuck(running, &finishing, grace, why);
        }
        handles
            .into_iter()
            .map(|h| h?.join().map_err(|panic| panic_message(&*panic)))
            .collect()
    })
}

/// Tells [`on_threads`] that rank `.0` ended, when dropped.
struct Finished(usize, mpsc::Sender<usize>);

impl Drop for Finished {
    fn drop(&mut self) {
        let _ = self.1.send(self.0);
    }
}

/// Waits for the ranks `running` marks until each has said it `finished`; ends the process if
/// some are still running `grace` after `why` first gave a reason.
fn end_if_stuck(
    mut running: Vec<bool>,
    finished: &mpsc::Receiver<usize>,
    grace: Duration,
    why: Stuck<'_>,
) {
    let mut deadline = None;
    while running.contains(&true) {
        match finished.recv_timeout(Duration::from_millis(200)) {
            Ok(rank) => running[rank] = false,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        let Some(reason) = why() else { continue };
        let deadline = *deadline.get_or_insert_with(|| Instant::now() + grace);
        if Instant::now() < deadline {
            continue;
        }
        // Ranks that ended since the wait above are not stuck.
        while let Ok(rank) = finished.try_recv() {
            running[rank] = false;
        }
        let stuck: Vec<usize> = (0..running.len()).filter(|&r| running[r]).collect();
        if !stuck.is_empty() {
            eprintln!(
                "rank(s) {stuck:?} still running {:.1} s after the group failed ({reason}), outside any collective: ending the process, since no other thread can stop them (if they are only slow, raise the timeout: --collective-timeout of the training runs)",
                grace.as_secs_f64()
            );
            crate::end_process(crate::EX_TEMPFAIL); // as the MPI and NCCL watchdogs
        }
    }
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_string())
}
