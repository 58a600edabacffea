//! One rank per GPU through NCCL (cudarc's `nccl`): ranks as threads of one process
//! ([`NcclComm::run`], one communicator per GPU from `ncclCommInitAll`), or one per MPI
//! process ([`NcclComm::over_mpi`]: rank 0 creates NCCL's unique id and broadcasts it over
//! MPI).
//!
//! Tensors on a CUDA device are moved in place: NCCL reads and writes the memory of Burn's
//! tensors (resolved out of the fusion graph and pinned in cubecl's pool while NCCL works),
//! with no host copy; 16-bit tensors are reduced by NCCL in their own dtype. Host buffers (and
//! tensors on other devices) are copied to the rank's GPU, moved there by NCCL, and copied
//! back; their reductions run in f32 (16-bit values widened, and rounded once at the end);
//! a mean is a sum divided once. Gathers and broadcasts
//! move 16-bit values as they are. Before each collective the ranks agree on the call (as
//! under MPI), and sizes that do not divide by the world size are padded before upload.
//! NCCL cannot be interrupted: a watchdog ends the process when a collective outlasts the
//! timeout (a dead peer), so the launcher stops every rank instead of letting them hang.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use std::marker::PhantomData;

use burn::backend::{Cube, DispatchDevice};
use burn::prelude::{Device, Tensor};
use burn_cubecl::{CubeBackend, fusion::FusionCubeRuntime, tensor::CubeTensor};
use burn_fusion::FusionTensor;
use cubecl::__private::Runtime;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nccl::{Comm, NcclType, ReduceOp as NcclOp};
use half::{bf16, f16};

use crate::guard::{self, Agreement, CALL_LEN, Watchdog};
use crate::tensor::{self as staged, dtype_of};
use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp, shard_range};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// This rank's NCCL communicator and the stream of its GPU.
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
    watchdog: Arc<Watchdog>,
    agreement: Agreement,
    /// The agreement's integers on the GPU, allocated once: a rank whose GPU is full (the
    /// error it leaves on) can still agree to leave.
    call: RefCell<CudaSlice<i64>>,
}

// SAFETY: the communicator is used by one thread at a time (the trait takes `&self` from the
// rank's own thread, and `NcclComm` is not `Sync`); NCCL allows a communicator to move
// between threads.
unsafe impl Send for NcclComm {}

/// `$body` on the values of `$buf` (bound to `$v`), as a buffer of the same dtype.
macro_rules! typed {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            Buffer::F32($v) => Buffer::F32($body?),
            Buffer::F16($v) => Buffer::F16($body?),
            Buffer::Bf16($v) => Buffer::Bf16($body?),
        }
    };
}

/// A value NCCL moves.
trait Element: DeviceRepr + ValidAsZeroBits + NcclType + Copy + Default {}
impl Element for f32 {}
impl Element for f16 {}
impl Element for bf16 {}
impl Element for u64 {}

impl NcclComm {
    /// GPUs this process sees (none without a CUDA driver).
    pub fn device_count() -> Result<usize, CollectiveError> {
        if !driver_present() {
            return Ok(0);
        }
        CudaContext::device_count()
            .map(|n| n as usize)
            .map_err(|e| init_failed(0)(format!("{e:?}")))
    }

    /// One communicator per GPU in `devices` (their CUDA ordinals), for ranks that are threads
    /// of this process; rank i runs on `devices[i]`.
    pub fn group(devices: &[usize], timeout: Duration) -> Result<Vec<Self>, CollectiveError> {
        libraries(0)?;
        let failed = init_failed(0);
        let (streams, calls): (Vec<_>, Vec<_>) = devices
            .iter()
            .map(|&d| {
                let stream = CudaContext::new(d)
                    .map(|ctx| ctx.default_stream())
                    .map_err(|e| failed(format!("GPU {d}: {e:?}")))?;
                Ok((stream.clone(), call_buffer(&stream, 0)?))
            })
            .collect::<Result<Vec<_>, CollectiveError>>()?
            .into_iter()
            .unzip();
        let comms = Comm::from_devices(streams).map_err(|e| failed(format!("{e:?}")))?;
        Ok(comms
            .into_iter()
            .zip(calls)
            .enumerate()
            .map(|(rank, (comm, call))| Self::new(comm, call, Watchdog::start(rank, timeout)))
            .collect())
    }

    /// A rank's engine on `comm`, with its agreement's buffer (allocated before the
    /// communicator: a rank that failed after it would leave through an agreement nobody else
    /// joins) and its watchdog.
    fn new(comm: Comm, call: CudaSlice<i64>, watchdog: Arc<Watchdog>) -> Self {
        Self {
            stream: comm.stream(),
            comm,
            watchdog,
            agreement: Agreement::default(),
            call: RefCell::new(call),
        }
    }

    /// Runs `f` on one thread per GPU in `devices`, each with its rank's communicator; their
    /// results in rank order (a rank that panicked gives its message).
    pub fn run<T: Send>(
        devices: &[usize],
        timeout: Duration,
        f: impl Fn(&dyn Communicator) -> T + Sync,
    ) -> Result<Vec<Result<T, String>>, CollectiveError> {
        let comms = Self::group(devices, timeout)?;
        // A stuck NCCL rank ends the process by its watchdog.
        Ok(crate::threads::on_threads(comms, None, |comm| f(&comm)))
    }

    /// This process's rank of `mpi`'s world, on GPU `device`: NCCL's unique id comes from
    /// rank 0 over MPI.
    ///
    /// What can fail on one rank alone (the libraries, the GPU, the agreement's buffer, the
    /// id) is done first and agreed on over MPI: every rank then returns an error naming the
    /// rank that failed, where its peers would wait in NCCL's init, which waits for every rank,
    /// until the launcher ended them.
    #[cfg(feature = "mpi")]
    pub fn over_mpi(
        mpi: &crate::mpi::MpiComm,
        device: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let me = mpi.rank();
        let failed = init_failed(me);
        let prepared = libraries(me).and_then(|()| {
            let stream = CudaContext::new(device)
                .map(|ctx| ctx.default_stream())
                .map_err(|e| failed(format!("GPU {device}: {e:?}")))?;
            let call = call_buffer(&stream, me)?;
            let id = match me {
                0 => Some(cudarc::nccl::Id::new().map_err(|e| failed(format!("{e:?}")))?),
                _ => None,
            };
            Ok((stream, call, id))
        });
        // The last rank that failed, plus one (0: none did).
        let mut failure = Buffer::F32(vec![prepared.as_ref().map_or(me as f32 + 1.0, |_| 0.0)]);
        mpi.all_reduce(&mut failure, ReduceOp::Max)?;
        let (stream, call, id) = prepared?;
        if let Some(&rank) = failure.to_f32().first().filter(|&&r| r > 0.0) {
            return Err(failed(format!(
                "rank {} could not set up its GPU for NCCL (its own error says why)",
                rank as usize - 1
            )));
        }
        // The id's 128 bytes travel as f32s (each exact), over the group's own broadcast.
        let mut id = Buffer::F32(match id {
            Some(created) => created.internal().iter().map(|&b| b as u8 as f32).collect(),
            None => vec![0.0; 128],
        });
        mpi.broadcast(&mut id, 0)?;
        let bytes: Vec<core::ffi::c_char> = id
            .to_f32()
            .iter()
            .map(|&b| b as u8 as core::ffi::c_char)
            .collect();
        let internal: [core::ffi::c_char; 128] = bytes
            .try_into()
            .map_err(|_| failed("NCCL's unique id is 128 bytes".into()))?;
        // Watched as every collective after it: NCCL's init waits for every rank (a peer
        // stuck in its handshake, an interface it cannot reach) and cannot be interrupted.
        let watchdog = Watchdog::start(me, timeout);
        let comm = {
            let _watch = watchdog.watch("NCCL init");
            Comm::from_rank(
                stream,
                me,
                mpi.world_size(),
                cudarc::nccl::Id::uninit(internal),
            )
        }
        .map_err(|e| failed(format!("{e:?}")))?;
        Ok(Self::new(comm, call, watchdog))
    }

    fn error(&self, op: &'static str) -> impl Fn(String) -> CollectiveError {
        failure(self.rank(), op)
    }

    /// `values` on this rank's GPU, followed by `pad` default values.
    fn upload<T: Element>(
        &self,
        values: &[T],
        pad: usize,
        op: &'static str,
    ) -> Result<CudaSlice<T>, CollectiveError> {
        let result = if pad == 0 {
            self.stream.clone_htod(values)
        } else {
            let mut padded = values.to_vec();
            padded.resize(values.len() + pad, T::default());
            self.stream.clone_htod(&padded)
        };
        result.map_err(|e| self.error(op)(format!("{e:?}")))
    }

    /// `len` zeros on this rank's GPU.
    fn zeros<T: Element>(
        &self,
        len: usize,
        op: &'static str,
    ) -> Result<CudaSlice<T>, CollectiveError> {
        self.stream
            .alloc_zeros(len)
            .map_err(|e| self.error(op)(format!("{e:?}")))
    }

    /// `dev` back on the host, once the stream has finished with it.
    fn download<T: Element>(
        &self,
        dev: &CudaSlice<T>,
        op: &'static str,
    ) -> Result<Vec<T>, CollectiveError> {
        let err = self.error(op);
        let values = self
            .stream
            .clone_dtoh(dev)
            .map_err(|e| err(format!("{e:?}")))?;
        self.stream
            .synchronize()
            .map_err(|e| err(format!("{e:?}")))?;
        Ok(values)
    }

    /// An NCCL call's status as this engine's error.
    fn nccl<S>(
        &self,
        op: &'static str,
        status: Result<S, cudarc::nccl::result::NcclError>,
    ) -> Result<(), CollectiveError> {
        status
            .map(|_| ())
            .map_err(|e| self.error(op)(format!("{e:?}")))
    }

    /// All ranks must be making the same call, and none may have left ([`Agreement`]).
    fn agree(
        &self,
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<(), CollectiveError> {
        let proposal = self.agreement.propose(self.rank(), op, dtype, len)?;
        let err = self.error(op);
        let mut call = self.call.borrow_mut();
        self.stream
            .memcpy_htod(&proposal[..], &mut *call)
            .map_err(|e| err(format!("{e:?}")))?;
        self.nccl(op, self.comm.all_reduce_in_place(&mut *call, &NcclOp::Max))?;
        let mut max = [0; CALL_LEN];
        self.stream
            .memcpy_dtoh(&*call, &mut max[..])
            .map_err(|e| err(format!("{e:?}")))?;
        self.stream
            .synchronize()
            .map_err(|e| err(format!("{e:?}")))?;
        self.agreement.read(self.rank(), &max, op, dtype, len)
    }

    /// The ranks meet again once a call has allocated buffers whose lengths came from the
    /// ranks after its agreement: a rank out of GPU memory has returned its error and leaves
    /// here, where its peers see it, rather than leaving them in NCCL's call.
    fn allocated(&self, op: &'static str) -> Result<(), CollectiveError> {
        self.agree(op, DType::F32, Some(0))
    }

    /// Every rank's `values` (`counts[r]` elements from rank r) in rank order. NCCL gathers
    /// equal blocks, so each is padded to the largest.
    fn all_gather_typed<T: Element>(
        &self,
        values: &[T],
        counts: &[usize],
    ) -> Result<Vec<T>, CollectiveError> {
        let block = counts.iter().copied().max().unwrap_or(0);
        if block == 0 {
            return Ok(Vec::new());
        }
        let send = self.upload(values, block - values.len(), "all_gather")?;
        let mut recv = self.zeros(block * counts.len(), "all_gather")?;
        self.allocated("all_gather")?;
        self.nccl("all_gather", self.comm.all_gather(&send, &mut recv))?;
        let all = self.download(&recv, "all_gather")?;
        Ok(counts
            .iter()
            .enumerate()
            .flat_map(|(r, &c)| all[r * block..r * block + c].iter().copied())
            .collect())
    }

    /// `root`'s `values` (of `len` elements) on every rank.
    fn broadcast_typed<T: Element>(
        &self,
        values: &[T],
        len: usize,
        root: usize,
    ) -> Result<Vec<T>, CollectiveError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut dev = if self.rank() == root {
            self.upload(values, 0, "broadcast")?
        } else {
            self.zeros(len, "broadcast")?
        };
        self.allocated("broadcast")?;
        self.nccl(
            "broadcast",
            self.comm.broadcast_in_place(&mut dev, root as i32),
        )?;
        self.download(&dev, "broadcast")
    }

    /// Host buffers' 16-bit values are reduced widened to f32 and rounded once; a mean is a
    /// sum divided here.
    fn finish(&self, dtype: DType, mut values: Vec<f32>, op: ReduceOp) -> Buffer {
        if op == ReduceOp::Mean {
            let n = self.world_size() as f32;
            values.iter_mut().for_each(|x| *x /= n);
        }
        Buffer::from_f32(dtype, values)
    }

    /// Every rank's element count.
    fn counts(&self, len: usize) -> Result<Vec<usize>, CollectiveError> {
        let counts = self.all_gather_typed(&[len as u64], &vec![1; self.world_size()])?;
        Ok(counts.into_iter().map(|c| c as usize).collect())
    }
}

/// The agreement's integers on `stream`'s GPU (`NcclComm::call`).
fn call_buffer(stream: &Arc<CudaStream>, me: usize) -> Result<CudaSlice<i64>, CollectiveError> {
    stream
        .alloc_zeros(CALL_LEN)
        .map_err(|e| init_failed(me)(format!("{e:?}")))
}

/// Rank `me`'s `op` failing on the device, for the detail given.
fn failure(me: usize, op: &'static str) -> impl Fn(String) -> CollectiveError {
    move |detail| CollectiveError::Device { me, op, detail }
}

/// Rank `me`'s setup failing, for the detail given.
fn init_failed(me: usize) -> impl Fn(String) -> CollectiveError {
    failure(me, "init")
}

/// Whether the CUDA driver's library is installed (cudarc opens it at its first call, and
/// panics without).
fn driver_present() -> bool {
    // SAFETY: it only tries to open the library by its candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The CUDA driver's and NCCL's libraries: their absence as an error naming what to install,
/// not cudarc's panic at the first call.
fn libraries(me: usize) -> Result<(), CollectiveError> {
    let missing = init_failed(me);
    if !driver_present() {
        return Err(missing(
            "the CUDA driver (libcuda.so) is not installed: this machine has no usable GPU".into(),
        ));
    }
    // SAFETY: it only tries to open the library by its candidate names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(missing(
            "NCCL (libnccl.so) was not found: install it and put its directory on LD_LIBRARY_PATH (PyPI's nvidia-nccl wheels ship libnccl.so.2: link it as libnccl.so)".into(),
        ));
    }
    Ok(())
}

/// A flat CUDA tensor's memory as NCCL sees it: resolved out of Burn's fusion graph, with
/// cubecl's pending work on it finished, and pinned in cubecl's pool (neither freed nor
/// moved) while this lives.
struct Pinned<'s, T> {
    ptr: u64,
    len: usize,
    stream: &'s Arc<CudaStream>,
    _resource: Box<dyn std::any::Any>,
    _tensor: CubeTensor,
    _element: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Pinned<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

// The caller synchronizes NCCL's stream before the pin is released: nothing to record.
impl<T> DevicePtr<T> for Pinned<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Pinned<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// Whether `tensor` lives on a CUDA device (whose memory NCCL can use in place).
fn on_cuda(tensor: &Tensor<1>) -> bool {
    matches!(
        tensor.device().without_autodiff().as_dispatch(),
        DispatchDevice::Cube(cubecl::Device::Cuda(_))
    )
}

impl NcclComm {
    /// `tensor`'s memory, pinned for NCCL (see [`Pinned`]).
    fn pin<T>(
        &self,
        tensor: &Tensor<1>,
        op: &'static str,
    ) -> Result<Pinned<'_, T>, CollectiveError> {
        let err = self.error(op);
        let fused: FusionTensor<FusionCubeRuntime> = tensor
            .clone()
            .without_autodiff()
            .try_into_primitive::<Cube>()
            .map_err(|e| err(format!("{e:?}")))?;
        let cube: CubeTensor = fused
            .client
            .clone()
            .resolve_tensor_float::<CubeBackend>(fused);
        if !cube.is_contiguous() {
            return Err(err("a collective's tensor must be contiguous".into()));
        }
        let resource = cube
            .client
            .get_resource::<CudaServer>(cube.handle.clone())
            .map_err(|e| err(format!("{e:?}")))?;
        cubecl::future::block_on(cube.client.sync()).map_err(|e| err(format!("{e:?}")))?;
        Ok(Pinned {
            ptr: resource.resource().ptr,
            len: cube.meta.shape().num_elements(),
            stream: &self.stream,
            _resource: Box::new(resource),
            _tensor: cube,
            _element: PhantomData,
        })
    }

    /// A fresh tensor of `recv_len` elements on `send`'s device (in its dtype), for NCCL to
    /// write, and the pins of both for NCCL (none under cubecl's dry run, the device plan:
    /// kernels are dropped there, and pinning would back buffers that NCCL would then move
    /// unwritten). Called before the ranks agree on the call: a rank that fails here (out of
    /// memory) leaves at the agreement, where the others see it, rather than after, out of
    /// step with their NCCL call.
    fn pinned(
        &self,
        op: &'static str,
        send: &Tensor<1>,
        recv_len: usize,
    ) -> Result<(Tensor<1>, Option<TypedPair<'_>>), CollectiveError> {
        let device: Device = send.device().without_autodiff();
        let recv = Tensor::<1>::empty([recv_len], (&device, send.dtype()));
        if cubecl::dry_run::launch_mode().is_skipped() {
            return Ok((recv, None));
        }
        let pair = match dtype_of(send.dtype())? {
            DType::F32 => TypedPair::F32(self.pin(send, op)?, self.pin(&recv, op)?),
            DType::F16 => TypedPair::F16(self.pin(send, op)?, self.pin(&recv, op)?),
            DType::Bf16 => TypedPair::Bf16(self.pin(send, op)?, self.pin(&recv, op)?),
        };
        Ok((recv, Some(pair)))
    }

    /// Runs `nccl` on a [`Self::pinned`] pair, and waits for the stream, whatever NCCL said,
    /// before the pins are released (cubecl's pool could otherwise hand the memory out while
    /// queued NCCL work still uses it).
    fn launch(
        &self,
        op: &'static str,
        pair: Option<TypedPair<'_>>,
        nccl: impl Fn(&Self, &mut TypedPair) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let Some(mut pair) = pair else {
            return Ok(());
        };
        let launched = nccl(self, &mut pair);
        let finished = self
            .stream
            .synchronize()
            .map_err(|e| self.error(op)(format!("{e:?}")));
        drop(pair);
        launched.and(finished)
    }
}

/// A send and a receive tensor, pinned, in one dtype.
enum TypedPair<'s> {
    F32(Pinned<'s, f32>, Pinned<'s, f32>),
    F16(Pinned<'s, f16>, Pinned<'s, f16>),
    Bf16(Pinned<'s, bf16>, Pinned<'s, bf16>),
}

/// `$body` with `$send` and `$recv` bound to a pair's pinned tensors, whatever their dtype.
macro_rules! on_pair {
    ($pair:expr, ($send:ident, $recv:ident) => $body:expr) => {
        match $pair {
            TypedPair::F32($send, $recv) => $body(&*$send, $recv),
            TypedPair::F16($send, $recv) => $body(&*$send, $recv),
            TypedPair::Bf16($send, $recv) => $body(&*$send, $recv),
        }
    };
}

/// A rank leaves the group as MPI's does (`crate::mpi`): the others' next call fails saying
/// so, instead of waiting in NCCL, which cannot be interrupted, for the watchdog.
impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.agreement.leaves() {
            let _watch = self.watchdog.watch(guard::LEAVE);
            let _ = self.agree(guard::LEAVE, DType::F32, None);
        }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("all_reduce");
        // On the GPU before the ranks agree: a rank out of memory leaves at the agreement.
        let mut dev = match buf.len() {
            0 => None,
            _ => Some(self.upload(&buf.to_f32(), 0, "all_reduce")?),
        };
        self.agree("all_reduce", buf.dtype(), Some(buf.len()))?;
        let Some(dev) = dev.as_mut() else {
            return Ok(());
        };
        self.nccl(
            "all_reduce",
            self.comm.all_reduce_in_place(dev, &nccl_op(op)),
        )?;
        *buf = self.finish(buf.dtype(), self.download(dev, "all_reduce")?, op);
        Ok(())
    }

    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("all_gather");
        self.agree("all_gather", input.dtype(), None)?;
        let counts = self.counts(input.len())?;
        *output = typed!(input, v => self.all_gather_typed(v, &counts));
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("reduce_scatter");
        // Every rank's input padded to equal blocks of `ceil(n / world)` (the padding cut
        // off again), on the GPU before the ranks agree: a rank out of memory leaves there.
        let (n, world) = (input.len(), self.world_size());
        let chunk = n.div_ceil(world);
        let buffers = match chunk {
            0 => None,
            _ => Some((
                self.upload(&input.to_f32(), chunk * world - n, "reduce_scatter")?,
                self.zeros(chunk, "reduce_scatter")?,
            )),
        };
        self.agree("reduce_scatter", input.dtype(), Some(n))?;
        let Some((send, mut recv)) = buffers else {
            *output = Buffer::from_f32(input.dtype(), Vec::new());
            return Ok(());
        };
        self.nccl(
            "reduce_scatter",
            self.comm.reduce_scatter(&send, &mut recv, &nccl_op(op)),
        )?;
        let mut mine = self.download(&recv, "reduce_scatter")?;
        mine.truncate(shard_range(n, world, self.rank()).len());
        *output = self.finish(input.dtype(), mine, op);
        Ok(())
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError> {
        crate::check_root(root, self.world_size())?;
        let _watch = self.watchdog.watch("broadcast");
        self.agree("broadcast", buf.dtype(), Some(root))?;
        let len = self.counts(buf.len())?[root];
        *buf = typed!(&*buf, v => self.broadcast_typed(v, len, root));
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        let _watch = self.watchdog.watch("barrier");
        self.agree("barrier", DType::F32, Some(0))
    }

    fn all_reduce_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        if !on_cuda(&tensor) {
            return staged::all_reduce_staged(self, tensor, op);
        }
        let _watch = self.watchdog.watch("all_reduce");
        let n = tensor.dims()[0];
        let (reduced, pair) = self.pinned("all_reduce", &tensor, n)?;
        self.agree("all_reduce", dtype_of(tensor.dtype())?, Some(n))?;
        self.launch("all_reduce", pair, |this, pair| {
            let status =
                on_pair!(pair, (send, recv) => |s, r| this.comm.all_reduce(s, r, &device_op(op)));
            this.nccl("all_reduce", status)
        })?;
        Ok(reduced)
    }

    fn all_gather_tensor(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CollectiveError> {
        if !on_cuda(&tensor) {
            return staged::all_gather_staged(self, tensor);
        }
        let watch = self.watchdog.watch("all_gather");
        let n = tensor.dims()[0];
        let (gathered, pair) = self.pinned("all_gather", &tensor, n * self.world_size())?;
        self.agree("all_gather", dtype_of(tensor.dtype())?, None)?;
        // NCCL gathers equal blocks; unequal ones (every rank sees it) go through the host.
        if self.counts(n)?.iter().any(|&c| c != n) {
            drop((watch, pair, gathered));
            return staged::all_gather_staged(self, tensor);
        }
        self.launch("all_gather", pair, |this, pair| {
            let status = on_pair!(pair, (send, recv) => |s, r| this.comm.all_gather(s, r));
            this.nccl("all_gather", status)
        })?;
        Ok(gathered)
    }

    fn reduce_scatter_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        let (n, world) = (tensor.dims()[0], self.world_size());
        // NCCL scatters equal chunks; a length that does not divide goes through the host.
        if !on_cuda(&tensor) || n % world != 0 {
            return staged::reduce_scatter_staged(self, tensor, op);
        }
        let _watch = self.watchdog.watch("reduce_scatter");
        let (mine, pair) = self.pinned("reduce_scatter", &tensor, n / world)?;
        self.agree("reduce_scatter", dtype_of(tensor.dtype())?, Some(n))?;
        self.launch("reduce_scatter", pair, |this, pair| {
            let status =
                on_pair!(pair, (send, recv) => |s, r| this.comm.reduce_scatter(s, r, &device_op(op)));
            this.nccl("reduce_scatter", status)
        })?;
        Ok(mine)
    }

    fn broadcast_tensor(
        &self,
        tensor: Tensor<1>,
        root: usize,
    ) -> Result<Tensor<1>, CollectiveError> {
        crate::check_root(root, self.world_size())?;
        if !on_cuda(&tensor) {
            return staged::broadcast_staged(self, tensor, root);
        }
        let watch = self.watchdog.watch("broadcast");
        let n = tensor.dims()[0];
        let (root_values, pair) = self.pinned("broadcast", &tensor, n)?;
        self.agree("broadcast", dtype_of(tensor.dtype())?, Some(root))?;
        // In place only when every rank's tensor has the root's length.
        let counts = self.counts(n)?;
        if counts.iter().any(|&c| c != counts[root]) {
            drop((watch, pair, root_values));
            return staged::broadcast_staged(self, tensor, root);
        }
        let is_root = self.rank() == root;
        self.launch("broadcast", pair, |this, pair| {
            let status = on_pair!(pair, (send, recv) => |s, r| this.comm.broadcast(Some(s).filter(|_| is_root), r, root as i32));
            this.nccl("broadcast", status)
        })?;
        Ok(root_values)
    }
}

/// NCCL's operation for `op` on device tensors, reduced in their dtype: a mean is NCCL's
/// average (each value divided by the world size before the sum, so that the sum cannot
/// overflow where the mean fits).
fn device_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Mean => NcclOp::Avg,
    }
}

/// NCCL's operation for `op` on host buffers (a mean is a sum, divided afterwards).
fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Sum | ReduceOp::Mean => NcclOp::Sum,
    }
}
