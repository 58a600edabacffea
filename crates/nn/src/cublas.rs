//! cuBLAS's GEMM on cubecl's CUDA buffers, for [`GemmOps`](crate::gemm::GemmOps) on a CUDA
//! device. cuBLAS is opened at run time (cudarc's dynamic loading, as cubecl-cuda opens the
//! driver). Each product is a task on cubecl's device thread, queued behind the kernels
//! launched before it and not waited for, as a kernel launch is: there it resolves the buffers
//! on the stream of the caller (the one change of vendor/cubecl-cuda, PATCH.md hands that
//! stream out) and enqueues cuBLAS's GEMM on it, in order with cubecl's kernels and without a
//! host synchronization. A buffer freed after it is reused on that stream only after it.
//!
//! Why a task and not `ComputeClient::get_resource` on the calling thread: each such call
//! waits for the device thread to drain everything queued before it (cubecl batches launches
//! 32 to a buffer and a blocking call flushes a part-filled one). On an H200 three of them a
//! product made ViT-L/16's bf16 step 1.48x slower than with cubecl's own matmul (218 against
//! 147 ms), though cuBLAS's bf16 GEMMs run at 4.3x cubecl's rate (README, Measured on a GPU).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use burn::backend::Shape;
use burn::tensor::DType;
use burn::tensor::StreamId;
use burn_cubecl::cubecl::std::tensor::{TensorHandle, into_contiguous as into_contiguous_packed};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::__private::Runtime;
use cubecl::cuda::CudaRuntime;
use cubecl::server::{BufferBinding, ServerStorage};
use cubecl_common::device::Device as _;
use cubecl_common::device_handle::DeviceHandle;
use cudarc::cublas::sys::{
    self, cublasComputeType_t, cublasHandle_t, cublasOperation_t, cublasStatus_t, cudaDataType,
};
use cudarc::driver::CudaContext;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// One cuBLAS handle per CUDA device and stream, on that device's cubecl thread (the one that
/// runs the products), with the device's primary context (cubecl's) current. A handle per
/// stream, as PyTorch keeps: a handle's default workspace serves one stream at a time.
struct Handle {
    context: Arc<CudaContext>,
    handle: cublasHandle_t,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // At thread exit: the status is of no use to anyone then.
        let _ = unsafe { sys::cublasDestroy_v2(self.handle) };
    }
}

thread_local! {
    static HANDLES: RefCell<HashMap<(usize, usize), Handle>> = RefCell::new(HashMap::new());
}

/// The first product that failed on a device thread, where a panic is only logged: the next
/// product on any thread panics with it, so a failed product cannot pass silently.
static FAILED: Mutex<Option<String>> = Mutex::new(None);

fn check(status: cublasStatus_t, call: &str) -> Result<(), String> {
    match status {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        _ => Err(format!("cuBLAS {call} failed: {status:?}")),
    }
}

impl Handle {
    /// A handle on CUDA device `index` enqueuing on `stream`, the device's context bound to
    /// this thread; dropped (destroyed) if a setting fails.
    fn new(index: usize, stream: sys::cudaStream_t) -> Result<Self, String> {
        let context = CudaContext::new(index)
            .map_err(|e| format!("CUDA device {index} for cuBLAS: {e:?}"))?;
        context
            .bind_to_thread()
            .map_err(|e| format!("CUDA device {index}'s context: {e:?}"))?;
        let mut handle = std::ptr::null_mut();
        check(unsafe { sys::cublasCreate_v2(&mut handle) }, "cublasCreate")?;
        let handle = Handle { context, handle };
        check(
            unsafe { sys::cublasSetStream_v2(handle.handle, stream) },
            "cublasSetStream",
        )?;
        // cuBLAS's default lets a split-k product sum its partial results in the output's
        // dtype (bf16: 8 bits); this keeps every sum in f32, so a 16-bit product is rounded
        // once, at the end. (DISALLOW_... is the flag alone, on CUBLAS_DEFAULT_MATH = 0:
        // cudarc types the mode as an enum, not as bits.)
        check(
            unsafe {
                sys::cublasSetMathMode(
                    handle.handle,
                    sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                )
            },
            "cublasSetMathMode",
        )?;
        Ok(handle)
    }
}

/// Runs `f` with this thread's cuBLAS handle for CUDA device `index` and `stream`, its
/// context current.
fn with_handle<T>(
    index: usize,
    stream: sys::cudaStream_t,
    f: impl FnOnce(cublasHandle_t) -> Result<T, String>,
) -> Result<T, String> {
    HANDLES.with(|handles| {
        let mut handles = handles.borrow_mut();
        let entry = match handles.entry((index, stream as usize)) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(Handle::new(index, stream)?)
            }
        };
        entry
            .context
            .bind_to_thread()
            .map_err(|e| format!("CUDA device {index}'s context: {e:?}"))?;
        f(entry.handle)
    })
}

/// One product as cuBLAS reads it: column-major, so row-major `C = op(A) op(B)` is
/// `C^T = op(B)^T op(A)^T`, each row-major operand read as its transpose with its row length
/// as leading dimension.
struct Product {
    data_type: cudaDataType,
    trans_a: bool,
    trans_b: bool,
    m: i32,
    n: i32,
    k: i32,
    a_cols: i32,
    b_cols: i32,
}

impl Product {
    /// Enqueues the product of `a` and `b` into `c` on the stream of `stream_id`'s commands;
    /// runs on the device's cubecl thread.
    fn enqueue(
        &self,
        server: &mut CudaServer,
        index: usize,
        stream_id: StreamId,
        [a, b, c]: [BufferBinding; 3],
    ) -> Result<(), String> {
        let mut resource = |binding| {
            server
                .get_resource(binding, stream_id)
                .map_err(|e| format!("a cubecl buffer for cuBLAS: {e:?}"))
        };
        let (ra, rb, rc) = (resource(a)?, resource(b)?, resource(c)?);
        let stream = rc.resource().stream;
        if stream.is_null() {
            return Err("cubecl-cuda without burnscale's stream patch".into());
        }
        let op = |transpose| match transpose {
            true => cublasOperation_t::CUBLAS_OP_T,
            false => cublasOperation_t::CUBLAS_OP_N,
        };
        let (alpha, beta) = (1f32, 0f32);
        with_handle(index, stream as sys::cudaStream_t, |handle| unsafe {
            check(
                sys::cublasGemmEx(
                    handle,
                    op(self.trans_b),
                    op(self.trans_a),
                    self.n,
                    self.m,
                    self.k,
                    (&alpha as *const f32).cast::<c_void>(),
                    rb.resource().ptr as *const c_void,
                    self.data_type,
                    self.b_cols,
                    ra.resource().ptr as *const c_void,
                    self.data_type,
                    self.a_cols,
                    (&beta as *const f32).cast::<c_void>(),
                    rc.resource().ptr as *mut c_void,
                    self.data_type,
                    self.n,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                ),
                "cublasGemmEx",
            )
        })
    }
}

/// `op(a) @ op(b)` by cuBLAS on CUDA device `index`, in the operands' dtype (f32, bf16 or
/// f16), accumulated in f32 (f32 products do not use TF32, as PyTorch's default; 16-bit ones
/// never sum partial results in 16 bits, which PyTorch's default allows). Returns at once,
/// the product queued on the device thread.
pub(crate) fn gemm(
    index: usize,
    a: CubeTensor,
    b: CubeTensor,
    trans_a: bool,
    trans_b: bool,
) -> CubeTensor {
    if let Some(failure) = FAILED.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        panic!("an earlier cuBLAS product failed, so its output was never written: {failure}");
    }
    let data_type = match a.dtype {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        DType::F16 => cudaDataType::CUDA_R_16F,
        other => panic!("a cuBLAS product of {other:?} tensors: f32, bf16 and f16 only"),
    };
    assert_eq!(a.dtype, b.dtype, "a product's operands in one dtype");
    let (a, b) = (operand(a), operand(b));
    let ([a_rows, a_cols], [b_rows, b_cols]) = (matrix(&a), matrix(&b));
    let (m, k) = if trans_a {
        (a_cols, a_rows)
    } else {
        (a_rows, a_cols)
    };
    let (k_b, n) = if trans_b {
        (b_cols, b_rows)
    } else {
        (b_rows, b_cols)
    };
    assert_eq!(
        k, k_b,
        "a product of {a_rows}x{a_cols} and {b_rows}x{b_cols} matrices"
    );
    let shape = Shape::new([m, n]);
    if k == 0 {
        // cuBLAS wants leading dimensions of at least 1; a sum of no products is zero.
        return zeros_client(a.client.clone(), a.device.clone(), shape, a.dtype);
    }
    let c = empty_device_contiguous_dtype(a.client.clone(), a.device.clone(), shape, a.dtype);
    // Under cubecl's dry run (the device plan) kernels are compiled and dropped: so is the
    // product, whose output is carved and never written.
    if m == 0 || n == 0 || cubecl::dry_run::launch_mode().is_skipped() {
        return c;
    }
    let int = |x: usize| i32::try_from(x).expect("a matrix side within cuBLAS's 32-bit ints");
    let product = Product {
        data_type,
        trans_a,
        trans_b,
        m: int(m),
        n: int(n),
        k: int(k),
        a_cols: int(a_cols),
        b_cols: int(b_cols),
    };
    let bindings = [&a, &b, &c].map(|t| t.handle.clone().binding());
    let stream_id = StreamId::current();
    // The handle cubecl's client reaches the device thread by (one per device and server
    // type): a lookup, not kept, so that it never holds a device cubecl has shut down.
    let device = DeviceHandle::<CudaServer>::new(cubecl::cuda::CudaDevice { index }.to_id());
    device.submit(move |server: &mut CudaServer| {
        // The device thread only logs a panic: it is recorded for the next product instead.
        let enqueued = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            product.enqueue(server, index, stream_id, bindings)
        }))
        .unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(format!("the cuBLAS task panicked: {message}"))
        });
        if let Err(failure) = enqueued {
            FAILED
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(failure);
        }
    });
    c
}

/// `t` laid out in packed rows, in a buffer of the calling thread's stream. cubecl lets the
/// stream that made a buffer reuse it once this stream's command that last read it is done;
/// cuBLAS's read is enqueued after the command that handed the buffer out, so a buffer of
/// another stream (a tensor made on another thread) is copied here first, into a fresh packed
/// buffer (not `CubeTensor::copy`, which writes in place into a buffer only it holds, and
/// whose output rows may be padded).
fn operand(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    if t.handle.stream == StreamId::current() {
        return t;
    }
    let (client, device, dtype) = (t.client.clone(), t.device.clone(), t.dtype);
    let foreign = TensorHandle::from(t);
    let elem = foreign.dtype;
    let copied = into_contiguous_packed(&client, foreign.binding(), elem);
    let t = CubeTensor::new(client, copied.handle, *copied.metadata, device, dtype);
    assert!(
        t.handle.stream == StreamId::current(),
        "a copy on this stream"
    );
    t
}

fn matrix(t: &CubeTensor) -> [usize; 2] {
    let shape = t.meta.shape();
    assert_eq!(shape.num_dims(), 2, "a cuBLAS operand of shape {shape:?}");
    assert!(t.is_contiguous(), "a cuBLAS operand in packed rows");
    [shape[0], shape[1]]
}
