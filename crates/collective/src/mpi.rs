//! One rank per process under `mpirun`, through the `mpi` crate (rsmpi) over Open MPI.
//! Multi-node runs need nothing more than an mpirun hostfile.
//!
//! f16/bf16 buffers travel as 16-bit values: gathered and broadcast as they are, reduced by
//! an MPI operation that adds (or maxes) two of them in f32 and rounds the result to their
//! dtype, as NCCL reduces 16-bit values (with more than two ranks a sum is rounded once per
//! combine, not once at the end; a mean divides each value by the world size first, as
//! NCCL's average does, so that the sum cannot overflow where the mean fits). Before each
//! collective the ranks agree on the call (a small
//! all-reduce of its op, dtype and length), so mismatched calls are reported instead of
//! corrupting memory. A watchdog thread ends the process when one collective outlasts the
//! timeout, and a panicking rank exits at once; either way mpirun then stops every rank, so
//! none hangs.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;
use half::{bf16, f16};
use mpi::collective::{Operation, SystemOperation, UnsafeUserOperation};
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::environment::Universe;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};

use crate::guard::{self, Agreement, CALL_LEN, WatchGuard, Watchdog};
use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp, shard_range};

unsafe extern "C" {
    /// MPI_IN_PLACE, as the linked MPI library's header defines it (`csrc/in_place.c`).
    fn burnscale_mpi_in_place() -> *mut c_void;
}

/// This process's rank in `MPI_COMM_WORLD`.
pub struct MpiComm {
    // Declared before `universe`, so they are released before MPI finalizes.
    world: SimpleCommunicator,
    half_ops: HalfOps,
    universe: Universe,
    rank: usize,
    size: usize,
    watchdog: Arc<Watchdog>,
    agreement: Agreement,
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
            crate::end_process(101);
        }));
        Ok(Self {
            world,
            half_ops: HalfOps::new(),
            universe,
            rank,
            size,
            watchdog: Watchdog::start(rank, timeout),
            agreement: Agreement::default(),
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

    /// All ranks must be making the same call, and none may have left ([`Agreement`]).
    fn agree(
        &self,
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<(), CollectiveError> {
        let send = self.agreement.propose(self.rank, op, dtype, len)?;
        let mut got = [0i64; CALL_LEN];
        self.world
            .all_reduce_into(&send[..], &mut got[..], SystemOperation::max());
        self.agreement.read(self.rank, &got, op, dtype, len)
    }
}

/// A rank leaves the group before MPI finalizes, which waits for every rank: the others, at
/// their next call, stop with an error instead of waiting for it (and the launcher killing
/// this rank before it reports its own).
impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.agreement.leaves() {
            let _watch = self.watchdog.watch(guard::LEAVE);
            let _ = self.agree(guard::LEAVE, DType::F32, None);
        }
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
        match buf {
            Buffer::F32(values) => {
                self.all_reduce_in_place(values, system_op(op))?;
                if op == ReduceOp::Mean {
                    let n = self.size as f32;
                    values.iter_mut().for_each(|x| *x /= n);
                }
                Ok(())
            }
            Buffer::F16(values) => self.all_reduce_half(values, op),
            Buffer::Bf16(values) => self.all_reduce_half(values, op),
        }
    }

    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("all_gather");
        self.agree("all_gather", input.dtype(), None)?;
        // Exchanged wide, so that every rank sees a total too large for MPI's counts and
        // refuses it alike, before the gather.
        let mut wide = vec![0u64; self.size];
        self.world
            .all_gather_into(&(input.len() as u64), &mut wide[..]);
        let total = wide.iter().sum::<u64>() as usize;
        mpi_count("all_gather", total)?;
        let counts: Vec<i32> = wide.iter().map(|&c| c as i32).collect();
        *output = match input {
            Buffer::F32(send) => Buffer::F32(self.gather_bits(send, &counts, total, 0.0)),
            Buffer::F16(send) => {
                let bits = self.gather_bits(send.reinterpret_cast(), &counts, total, 0);
                Buffer::F16(bits.reinterpret_into())
            }
            Buffer::Bf16(send) => {
                let bits = self.gather_bits(send.reinterpret_cast(), &counts, total, 0);
                Buffer::Bf16(bits.reinterpret_into())
            }
        };
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        *output = match input {
            // Sent as it is: MPI's blocks are whole, and an f32 mean divides after the sum.
            Buffer::F32(values) if values.len().is_multiple_of(self.size) => {
                let (_watch, chunk, mine) = self.reduce_scatter_begins(input)?;
                Buffer::F32(self.reduce_scatter_f32(values, chunk, mine, op))
            }
            // Padded or divided first: on a copy.
            _ => self.reduce_scatter(input.clone(), op)?,
        };
        Ok(())
    }

    /// The input, given up, is padded to MPI's equal blocks (and a 16-bit mean divided) in
    /// place, not copied.
    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CollectiveError> {
        let (_watch, chunk, mine) = self.reduce_scatter_begins(&input)?;
        let len = chunk * self.size;
        Ok(match input {
            Buffer::F32(mut values) => {
                values.resize(len, 0.0);
                Buffer::F32(self.reduce_scatter_f32(&values, chunk, mine, op))
            }
            Buffer::F16(mut values) => {
                values.resize(len, f16::ZERO);
                Buffer::F16(self.reduce_scatter_half(values, chunk, mine, op))
            }
            Buffer::Bf16(mut values) => {
                values.resize(len, bf16::ZERO);
                Buffer::Bf16(self.reduce_scatter_half(values, chunk, mine, op))
            }
        })
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError> {
        crate::check_root(root, self.size)?;
        let _watch = self.watchdog.watch("broadcast");
        self.agree("broadcast", buf.dtype(), Some(root))?;
        let root_process = self.world.process_at_rank(root as i32);
        let mut len = buf.len() as u64;
        root_process.broadcast_into(&mut len);
        let len = len as usize;
        // Every rank has the root's length: all refuse alike.
        mpi_count("broadcast", len)?;
        match buf {
            Buffer::F32(values) => {
                values.resize(len, 0.0);
                root_process.broadcast_into(&mut values[..]);
            }
            Buffer::F16(values) => {
                values.resize(len, f16::ZERO);
                root_process.broadcast_into(values.reinterpret_cast_mut());
            }
            Buffer::Bf16(values) => {
                values.resize(len, bf16::ZERO);
                root_process.broadcast_into(values.reinterpret_cast_mut());
            }
        }
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("barrier");
        // The agreement is the barrier: every rank's call has arrived once it completes.
        self.agree("barrier", DType::F32, None)
    }
}

/// `n` elements as an MPI count, or an error naming `op`: MPI's counts are C ints.
fn mpi_count(op: &str, n: usize) -> Result<c_int, CollectiveError> {
    c_int::try_from(n).map_err(|_| {
        CollectiveError::Invalid(format!(
            "{op} of {n} elements: MPI counts stop at {}",
            c_int::MAX
        ))
    })
}

impl MpiComm {
    /// Every rank's values (`counts[r]` from rank r) in rank order, as they are.
    fn gather_bits<T: mpi::datatype::Equivalence + Copy>(
        &self,
        send: &[T],
        counts: &[i32],
        total: usize,
        zero: T,
    ) -> Vec<T> {
        let mut recv = vec![zero; total];
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
            let mut partition = PartitionMut::new(&mut recv[..], counts, &displs[..]);
            self.world.all_gather_varcount_into(send, &mut partition);
        }
        recv
    }

    /// Replaces `values` by their reduction over the ranks in place (MPI_IN_PLACE): no
    /// receive buffer beside them.
    fn all_reduce_in_place<T: Equivalence>(
        &self,
        values: &mut [T],
        op: impl Operation,
    ) -> Result<(), CollectiveError> {
        let count = mpi_count("all_reduce", values.len())?;
        // SAFETY: MPI reads and writes `count` elements of `T`'s datatype in `values`, which
        // is borrowed mutably for the call; every rank passes the same count (`agree`).
        unsafe {
            mpi::ffi::MPI_Allreduce(
                burnscale_mpi_in_place(),
                values.as_mut_ptr().cast(),
                count,
                T::equivalent_datatype().as_raw(),
                op.as_raw(),
                self.world.as_raw(),
            );
        }
        Ok(())
    }

    /// [`Communicator::all_reduce`] of 16-bit values, in place.
    fn all_reduce_half<T: Half>(
        &self,
        values: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.divide_for_mean(values, op);
        self.all_reduce_in_place(T::bits_mut(values), self.half_ops.of::<T>(op))
    }

    /// A reduce-scatter's watch, once every rank agreed on its dtype and length: each rank's
    /// chunk of the padded input, and how many of its values are this rank's.
    fn reduce_scatter_begins(
        &self,
        input: &Buffer,
    ) -> Result<(WatchGuard<'_>, usize, usize), CollectiveError> {
        let watch = self.watchdog.watch("reduce_scatter");
        self.agree("reduce_scatter", input.dtype(), Some(input.len()))?;
        let n = input.len();
        let chunk = n.div_ceil(self.size);
        // Agreed above: every rank refuses alike.
        mpi_count("reduce_scatter", chunk * self.size)?;
        Ok((watch, chunk, shard_range(n, self.size, self.rank).len()))
    }

    /// `send`, whole chunks, reduced and scattered: this rank's `mine` values.
    fn reduce_scatter_f32(
        &self,
        send: &[f32],
        chunk: usize,
        mine: usize,
        op: ReduceOp,
    ) -> Vec<f32> {
        let mut recv = vec![0.0f32; chunk];
        if chunk > 0 {
            self.world
                .reduce_scatter_block_into(send, &mut recv[..], system_op(op));
        }
        if op == ReduceOp::Mean {
            let size = self.size as f32;
            recv.iter_mut().for_each(|x| *x /= size);
        }
        recv.truncate(mine);
        recv
    }

    /// `padded`, whole chunks (divided here for a mean), reduced and scattered in its 16-bit
    /// dtype: this rank's `mine` values.
    fn reduce_scatter_half<T: Half>(
        &self,
        mut padded: Vec<T>,
        chunk: usize,
        mine: usize,
        op: ReduceOp,
    ) -> Vec<T> {
        self.divide_for_mean(&mut padded, op);
        let mut recv = vec![0u16; chunk];
        self.world.reduce_scatter_block_into(
            T::bits(&padded),
            &mut recv[..],
            self.half_ops.of::<T>(op),
        );
        let mut recv = T::from_bits_vec(recv);
        recv.truncate(mine);
        recv
    }

    /// For a mean of 16-bit values, divides each by the world size before MPI sums them (in
    /// f32, then rounded), so that a sum cannot overflow the dtype where the mean fits
    /// (loss-scaled f16 gradients).
    fn divide_for_mean<T: Half>(&self, values: &mut [T], op: ReduceOp) {
        if op == ReduceOp::Mean {
            let n = self.size as f32;
            values
                .iter_mut()
                .for_each(|x| *x = T::from_f32(x.to_f32() / n));
        }
    }
}

/// A 16-bit float MPI moves as its bits.
trait Half: Copy + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    fn bits(values: &[Self]) -> &[u16];
    fn bits_mut(values: &mut [Self]) -> &mut [u16];
    fn from_bits_vec(bits: Vec<u16>) -> Vec<Self>;
}

macro_rules! half_type {
    ($t:ty) => {
        impl Half for $t {
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn from_f32(value: f32) -> Self {
                <$t>::from_f32(value)
            }
            fn bits(values: &[Self]) -> &[u16] {
                values.reinterpret_cast()
            }
            fn bits_mut(values: &mut [Self]) -> &mut [u16] {
                values.reinterpret_cast_mut()
            }
            fn from_bits_vec(bits: Vec<u16>) -> Vec<Self> {
                bits.reinterpret_into()
            }
        }
    };
}
half_type!(f16);
half_type!(bf16);

/// `inout[i] = round(in[i] + inout[i])` (or the max) in `T`, computed in f32: MPI's user
/// function for 16-bit reductions.
///
/// # Safety
/// MPI passes `len` elements of `T` in each buffer.
unsafe extern "C" fn combine<T: Half, const MAX: bool>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut mpi::ffi::MPI_Datatype,
) {
    // SAFETY: MPI hands over `*len` elements of the datatype the operation was called with
    // (u16 bits of `T`), in two distinct buffers (which may be null when empty).
    let n = unsafe { *len } as usize;
    if n == 0 {
        return;
    }
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(invec as *const T, n),
            std::slice::from_raw_parts_mut(inoutvec as *mut T, n),
        )
    };
    for (x, y) in a.iter().zip(b) {
        let (x, z) = (x.to_f32(), y.to_f32());
        // A NaN stays NaN under max too (f32::max would drop it).
        *y = T::from_f32(if MAX && !x.is_nan() && !z.is_nan() {
            x.max(z)
        } else if MAX {
            f32::NAN
        } else {
            x + z
        });
    }
}

/// The MPI operations that reduce 16-bit values (see [`combine`]).
struct HalfOps {
    f16_sum: UnsafeUserOperation,
    f16_max: UnsafeUserOperation,
    bf16_sum: UnsafeUserOperation,
    bf16_max: UnsafeUserOperation,
}

impl HalfOps {
    fn new() -> Self {
        // SAFETY: each function is called only on buffers of its type's bits (`of`).
        unsafe {
            Self {
                f16_sum: UnsafeUserOperation::commutative(combine::<f16, false>),
                f16_max: UnsafeUserOperation::commutative(combine::<f16, true>),
                bf16_sum: UnsafeUserOperation::commutative(combine::<bf16, false>),
                bf16_max: UnsafeUserOperation::commutative(combine::<bf16, true>),
            }
        }
    }

    /// The operation for `op` on `T`'s bits (a mean is a sum, divided afterwards).
    fn of<T: Half>(&self, op: ReduceOp) -> &UnsafeUserOperation {
        let f16 = std::any::TypeId::of::<T>() == std::any::TypeId::of::<f16>();
        match (f16, op) {
            (true, ReduceOp::Max) => &self.f16_max,
            (true, _) => &self.f16_sum,
            (false, ReduceOp::Max) => &self.bf16_max,
            (false, _) => &self.bf16_sum,
        }
    }
}

/// MPI's operation for `op` (a mean is a sum, divided afterwards).
fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit past a C int's elements (a block of a ~400B-parameter model) is an error naming
    /// the collective, not a wrapped count or rsmpi's panic.
    #[test]
    fn counts_past_a_c_int_are_refused_by_name() {
        assert_eq!(mpi_count("all_gather", 7).unwrap(), 7);
        assert_eq!(
            mpi_count("all_gather", c_int::MAX as usize).unwrap(),
            c_int::MAX
        );
        let err = mpi_count("reduce_scatter", 1 << 31)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("reduce_scatter of 2147483648 elements"),
            "{err}"
        );
    }
}
