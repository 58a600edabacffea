//! One rank per process under `mpirun`, through the `mpi` crate (rsmpi) over Open MPI.
//! Multi-node runs need nothing more than an mpirun hostfile.
//!
//! f16/bf16 buffers travel as f32 (widened once, reduced by MPI, rounded once), as the
//! threads engine reduces them. Before each collective the ranks agree on the call (a small
//! all-reduce of its op, dtype and length), so mismatched calls are reported instead of
//! corrupting memory. A watchdog thread ends the process when one collective outlasts the
//! timeout, and a panicking rank exits at once; either way mpirun then stops every rank, so
//! none hangs.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};

use crate::guard::{self, Watchdog};
use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp, shard_range};

/// This process's rank in `MPI_COMM_WORLD`.
pub struct MpiComm {
    // Declared before `universe`, so the communicator is released before MPI finalizes.
    world: SimpleCommunicator,
    universe: Universe,
    rank: usize,
    size: usize,
    watchdog: Arc<Watchdog>,
    /// The previous all-reduce's input, reused as the next one's output: no fresh
    /// allocation (and page faults) per call.
    scratch: RefCell<Vec<f32>>,
}

// SAFETY: the handle is used by one thread at a time (the trait takes `&self` from the rank's
// own thread); MPI is initialised at `Threading::Serialized`, which allows that.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initialises MPI for this process. Fails if MPI was already initialised.
    pub fn init(timeout: Duration) -> Result<Self, CollectiveError> {
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| CollectiveError::Invalid("MPI is already initialised".into()))?;
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        // A panic would unwind into MPI_Finalize, which waits for the other ranks forever.
        // Leaving without finalizing instead makes mpirun stop every rank at once.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("rank {rank} panicked; ending it so that mpirun stops every rank");
            std::process::exit(101);
        }));
        Ok(Self {
            world,
            universe,
            rank,
            size,
            watchdog: Watchdog::start(rank, timeout),
            scratch: RefCell::new(Vec::new()),
        })
    }

    /// The processor name MPI reports (the node, for multi-node runs).
    pub fn processor_name(&self) -> String {
        mpi::environment::processor_name().unwrap_or_default()
    }

    /// The underlying communicator, for callers that need raw MPI (benchmarks).
    pub fn raw(&self) -> &SimpleCommunicator {
        let _ = &self.universe;
        &self.world
    }

    /// All ranks must be making the same call: op, dtype, and length where it must match.
    fn agree(
        &self,
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<(), CollectiveError> {
        let send = guard::call(op, dtype, len);
        let mut got = [0i64; 6];
        self.world
            .all_reduce_into(&send[..], &mut got[..], SystemOperation::max());
        guard::check(self.rank, &got, op, dtype, len)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("all_reduce");
        self.agree("all_reduce", buf.dtype(), Some(buf.len()))?;
        let mut recv = self.scratch.take();
        recv.resize(buf.len(), 0.0);
        match &*buf {
            // f32 goes straight from the caller's buffer; 16-bit types travel widened.
            Buffer::F32(send) => {
                self.world
                    .all_reduce_into(&send[..], &mut recv[..], system_op(op))
            }
            other => self
                .world
                .all_reduce_into(&other.to_f32()[..], &mut recv[..], system_op(op)),
        }
        if op == ReduceOp::Mean {
            let n = self.size as f32;
            recv.iter_mut().for_each(|x| *x /= n);
        }
        match buf {
            Buffer::F32(values) => *self.scratch.borrow_mut() = std::mem::replace(values, recv),
            other => *other = Buffer::from_f32(other.dtype(), recv),
        }
        Ok(())
    }

    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("all_gather");
        self.agree("all_gather", input.dtype(), None)?;
        let widened;
        let send: &[f32] = match input {
            Buffer::F32(values) => values,
            other => {
                widened = other.to_f32();
                &widened
            }
        };
        let mut counts = vec![0i32; self.size];
        self.world
            .all_gather_into(&(send.len() as i32), &mut counts[..]);
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        output.fill_as_f32(input.dtype(), total, |recv| {
            if counts.iter().all(|&c| c == counts[0]) {
                self.world.all_gather_into(send, &mut recv[..]);
            } else {
                let displs: Vec<i32> = counts
                    .iter()
                    .scan(0, |acc, &c| {
                        let d = *acc;
                        *acc += c;
                        Some(d)
                    })
                    .collect();
                let mut partition = PartitionMut::new(&mut recv[..], &counts[..], &displs[..]);
                self.world.all_gather_varcount_into(send, &mut partition);
            }
        });
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("reduce_scatter");
        self.agree("reduce_scatter", input.dtype(), Some(input.len()))?;
        let n = input.len();
        let chunk = n.div_ceil(self.size);
        // MPI wants equal blocks: pad (a copy) only when the size does not divide, and cut
        // the padding off again below.
        let padded;
        let send: &[f32] = match input {
            Buffer::F32(values) if chunk * self.size == n => values,
            other => {
                let mut values = other.to_f32();
                values.resize(chunk * self.size, 0.0);
                padded = values;
                &padded
            }
        };
        let mine = shard_range(n, self.size, self.rank).len();
        output.fill_as_f32(input.dtype(), chunk, |recv| {
            if chunk > 0 {
                self.world
                    .reduce_scatter_block_into(send, &mut recv[..], system_op(op));
            }
            if op == ReduceOp::Mean {
                let size = self.size as f32;
                recv.iter_mut().for_each(|x| *x /= size);
            }
            recv.truncate(mine);
        });
        Ok(())
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError> {
        crate::check_root(root, self.size)?;
        let _watch = self.watchdog.watch("broadcast");
        self.agree("broadcast", buf.dtype(), None)?;
        let root_process = self.world.process_at_rank(root as i32);
        let mut len = buf.len() as u64;
        root_process.broadcast_into(&mut len);
        let mut values = buf.to_f32();
        values.resize(len as usize, 0.0);
        root_process.broadcast_into(&mut values[..]);
        *buf = Buffer::from_f32(buf.dtype(), values);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("barrier");
        self.world.barrier();
        Ok(())
    }
}

/// MPI's operation for `op` (a mean is a sum, divided afterwards).
fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
    }
}
