//! Process groups: one [`Communicator`] trait with rank, world size and the collectives
//! (all-reduce, all-gather, reduce-scatter, broadcast, barrier), over flat buffers of
//! f32/f16/bf16 and over flat Burn tensors on the rank's device, with engines behind it:
//!
//! - [`threads`]: N ranks as threads of one process, sharing memory (the embedded default);
//! - `mpi` (feature `mpi`): one rank per process under `mpirun`, across nodes by hostfile;
//! - `nccl` (feature `nccl`, on with burnscale's `cuda`): one rank per GPU, as threads of one
//!   process or as MPI processes.
//!
//! Sizes need not divide by the world size: any padding stays inside the engine.
//! [`Counted`] wraps any of them and counts the bytes its collectives move.

mod buffer;
pub mod conformance;
mod counted;
mod error;
#[cfg(any(feature = "mpi", feature = "nccl"))]
mod guard;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod tensor;
pub mod threads;

pub use buffer::{Buffer, DType};
pub use counted::{CollectiveBytes, Counted};
pub use error::CollectiveError;
pub use tensor::{dtype_of, tensor_dtype};

use burn::prelude::Tensor;

use std::ops::Range;
use std::time::Duration;

/// The longest collective timeout, 31 years: a longer one is taken as this. A deadline is an
/// `Instant` plus the timeout, which overflows past ~9.2e18 s (and the watchdogs count
/// milliseconds in a `u64`).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// How values from different ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
}

/// A process group, seen from one rank. Every rank must make the same calls in the same
/// order; engines report mismatches they can detect.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replaces `buf` by the reduction of every rank's `buf` (equal lengths and dtypes).
    /// After an error the contents of `buf` are unspecified.
    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CollectiveError>;
    /// Every rank's `input`, concatenated in rank order into `output` (whose allocation is
    /// reused); lengths may differ between ranks.
    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError>;
    /// This rank's chunk ([`shard_range`]) of the reduction of every rank's `input` (equal
    /// lengths and dtypes), into `output` (whose allocation is reused).
    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError>;
    /// [`Communicator::all_gather_into`] a new buffer.
    fn all_gather(&self, input: &Buffer) -> Result<Buffer, CollectiveError> {
        let mut output = Buffer::empty(input.dtype());
        self.all_gather_into(input, &mut output)?;
        Ok(output)
    }
    /// [`Communicator::reduce_scatter_into`] a new buffer, from an `input` the caller gives
    /// up (an engine that can send it as it is need not copy it).
    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CollectiveError> {
        let mut output = Buffer::empty(input.dtype());
        self.reduce_scatter_into(&input, &mut output, op)?;
        Ok(output)
    }
    /// Replaces `buf` on every rank by `root`'s `buf`.
    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CollectiveError>;

    /// [`Communicator::all_reduce`] of a flat tensor, on its device and in its dtype.
    fn all_reduce_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        tensor::all_reduce_staged(self, tensor, op)
    }
    /// [`Communicator::all_gather`] of flat tensors, on the input's device and in its dtype.
    fn all_gather_tensor(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CollectiveError> {
        tensor::all_gather_staged(self, tensor)
    }
    /// [`Communicator::reduce_scatter`] of a flat tensor: this rank's chunk, on its device.
    fn reduce_scatter_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        tensor::reduce_scatter_staged(self, tensor, op)
    }
    /// [`Communicator::broadcast`] of a flat tensor.
    fn broadcast_tensor(
        &self,
        tensor: Tensor<1>,
        root: usize,
    ) -> Result<Tensor<1>, CollectiveError> {
        tensor::broadcast_staged(self, tensor, root)
    }
}

/// Every rank's `mine` (of any count, none too), in rank order: an all-gather, for small
/// integers the ranks agree on (flags' hashes, counts, outcomes). A buffer that does not read
/// back as counts and values is a [`CollectiveError::Mismatch`], never misread.
pub fn gather_u64s(
    comm: &dyn Communicator,
    mine: &[u64],
) -> Result<Vec<Vec<u64>>, CollectiveError> {
    // Each rank's count, then its values, each as 16-bit pieces, which f32 holds exactly.
    let pieces: Vec<f32> = std::iter::once(mine.len() as u64)
        .chain(mine.iter().copied())
        .flat_map(|v| (0..4).rev().map(move |i| ((v >> (16 * i)) & 0xFFFF) as f32))
        .collect();
    let all = comm.all_gather(&Buffer::F32(pieces))?.to_f32();
    let mut values = all
        .chunks(4)
        .map(|p| p.iter().fold(0u64, |v, &piece| (v << 16) | piece as u64));
    let mut ranks = Vec::with_capacity(comm.world_size());
    while let Some(count) = values.next() {
        let rank: Vec<u64> = values.by_ref().take(count as usize).collect();
        if rank.len() as u64 != count {
            break;
        }
        ranks.push(rank);
    }
    match all.len() % 4 == 0 && ranks.len() == comm.world_size() {
        true => Ok(ranks),
        false => Err(CollectiveError::Mismatch {
            me: comm.rank(),
            detail: format!(
                "gather_u64s read {} values from {} ranks, which do not parse as counts and values",
                all.len() / 4,
                comm.world_size()
            ),
        }),
    }
}

/// Whether this process was started by `mpirun` (Open MPI, MPICH/Hydra or PMIx launchers),
/// whether or not this build has the `mpi` feature that can join its world.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// This process's rank as mpirun's launcher numbers it (0 when not started by mpirun): lets
/// a program print and save once, before or without joining the world.
pub fn launcher_rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// The world mpirun started, when its launcher says (Open MPI, MPICH/Hydra): lets a process
/// plan for it before joining it.
pub fn launcher_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The exit code of a rank's process that a failed group ends (EX_TEMPFAIL).
pub(crate) const EX_TEMPFAIL: i32 = 75;

/// Ends this process with `code` at once, without exit handlers: CUDA's and NCCL's teardown
/// could wait behind the very collective that is stuck (PyTorch's watchdog skips NCCL's
/// cleanup too), and MPI's would wait for the other ranks. What was said on stderr is out.
pub(crate) fn end_process(code: i32) -> ! {
    // SAFETY: `_exit` ends the process; nothing of this one runs after it.
    unsafe { libc::_exit(code) }
}

/// This process's rank among those mpirun started on its node (0 when not started by
/// mpirun): which GPU of the node it takes.
pub fn launcher_local_rank() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "PMIX_LOCAL_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(0)
}

/// The GPU (of `gpus` visible) this process's rank takes under mpirun: the only one it sees
/// (a launcher that gives each process its own, through `CUDA_VISIBLE_DEVICES`), else its
/// node-local rank's.
pub fn mpi_local_gpu(gpus: usize) -> usize {
    if gpus == 1 { 0 } else { launcher_local_rank() }
}

/// Runs `f` for each rank this process hosts: the one MPI rank when started by mpirun (needs
/// the `mpi` feature), else `devices` ranks as threads (one runs on the calling thread).
/// Returns their results in rank order; a rank that panicked (not under mpirun) gives its
/// message.
pub fn run_ranks<T: Send>(
    devices: usize,
    timeout: Duration,
    f: impl Fn(&dyn Communicator) -> T + Sync,
) -> Result<Vec<Result<T, String>>, CollectiveError> {
    check_devices(devices)?;
    if launched_by_mpirun() {
        #[cfg(feature = "mpi")]
        return Ok(vec![Ok(f(&mpi::MpiComm::init(timeout)?))]);
        #[cfg(not(feature = "mpi"))]
        return Err(CollectiveError::Invalid(
            "started by mpirun, but this binary was built without the `mpi` feature, so it cannot join the MPI world: rebuild with --features mpi".into(),
        ));
    }
    if devices == 1 {
        let solo = threads::ThreadComm::group(1, timeout).remove(0);
        // On the caller's thread; a panic comes back as a failed rank, as from threads.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&solo)));
        return Ok(vec![ran.map_err(|panic| threads::panic_message(&*panic))]);
    }
    Ok(threads::ThreadComm::run(devices, timeout, |comm| f(&comm)))
}

/// [`run_ranks`] with one rank per GPU, over NCCL: `devices` threads on GPUs `0..devices`
/// (`ncclCommInitAll`), or under mpirun this process's rank on [`mpi_local_gpu`] (NCCL's
/// unique id sent over MPI, which stays up for the run).
#[cfg(feature = "nccl")]
pub fn run_gpu_ranks<T: Send>(
    devices: usize,
    timeout: Duration,
    f: impl Fn(&dyn Communicator) -> T + Sync,
) -> Result<Vec<Result<T, String>>, CollectiveError> {
    check_devices(devices)?;
    if launched_by_mpirun() {
        #[cfg(feature = "mpi")]
        {
            let world = mpi::MpiComm::init(timeout)?;
            let comm = nccl::NcclComm::over_mpi(&world, mpi_nccl_gpu()?, timeout)?;
            return Ok(vec![Ok(f(&comm))]);
        }
        #[cfg(not(feature = "mpi"))]
        return Err(CollectiveError::Invalid(
            "started by mpirun, but this binary was built without the `mpi` feature, so NCCL cannot be bootstrapped over MPI: rebuild with --features cuda,mpi".into(),
        ));
    }
    let gpus: Vec<usize> = (0..devices).collect();
    nccl::NcclComm::run(&gpus, timeout, f)
}

/// The GPU this process's NCCL rank takes under mpirun: [`mpi_local_gpu`] of those it sees.
#[cfg(feature = "nccl")]
pub fn mpi_nccl_gpu() -> Result<usize, CollectiveError> {
    Ok(mpi_local_gpu(nccl::NcclComm::device_count()?))
}

/// `--devices` in-process ranks: at least one, and only one (this process) under mpirun, where
/// the world comes from MPI.
pub fn check_devices(devices: usize) -> Result<(), CollectiveError> {
    if devices == 0 {
        return Err(CollectiveError::Invalid(
            "--devices must be at least 1".into(),
        ));
    }
    if launched_by_mpirun() && devices > 1 {
        return Err(CollectiveError::Invalid(format!(
            "--devices {devices} starts in-process ranks, but under mpirun the world comes from MPI (one rank per process): drop --devices"
        )));
    }
    Ok(())
}

/// A broadcast's `root` must be a rank of the world.
pub(crate) fn check_root(root: usize, world: usize) -> Result<(), CollectiveError> {
    if root >= world {
        return Err(CollectiveError::Invalid(format!(
            "broadcast root {root} is not a rank of a world of {world}"
        )));
    }
    Ok(())
}

/// The elements of an `n`-element buffer that `rank` of `world` owns after a reduce-scatter:
/// chunks of `ceil(n / world)` in rank order, the last ones shorter or empty (as
/// `torch.chunk`, and as FSDP pads).
pub fn shard_range(n: usize, world: usize, rank: usize) -> Range<usize> {
    let chunk = n.div_ceil(world.max(1));
    let start = (rank * chunk).min(n);
    start..((rank + 1) * chunk).min(n)
}

#[cfg(test)]
mod tests {
    use super::shard_range;

    #[test]
    fn shards_cover_the_buffer_once() {
        for n in [0, 1, 5, 7, 8, 100] {
            for world in 1..=5 {
                let ranges: Vec<_> = (0..world).map(|r| shard_range(n, world, r)).collect();
                assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), n);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(shard_range(7, 3, 2), 6..7);
        assert_eq!(shard_range(2, 3, 2), 2..2);
    }
}
