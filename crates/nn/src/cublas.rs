//! cuBLAS's GEMM on cubecl's CUDA buffers, for [`GemmOps`](crate::gemm::GemmOps) on a CUDA
//! device. cuBLAS is opened at run time (cudarc's dynamic loading, as cubecl-cuda opens the
//! driver); each product is enqueued on the stream of cubecl's command that handed out the
//! buffers (the one change of vendor/cubecl-cuda, PATCH.md), so it runs in order with
//! cubecl's kernels and no host synchronization: a buffer freed after it is reused on that
//! stream only after it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use burn::backend::Shape;
use burn::tensor::DType;
use burn::tensor::StreamId;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::__private::Runtime;
use cubecl::cuda::CudaRuntime;
use cudarc::cublas::sys::{
    self, cublasComputeType_t, cublasHandle_t, cublasOperation_t, cublasStatus_t, cudaDataType,
};
use cudarc::driver::CudaContext;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// One cuBLAS handle per CUDA device a thread runs products on, with the device's primary
/// context (cubecl's), which cuBLAS's launches need current on the calling thread.
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
    static HANDLES: RefCell<HashMap<usize, Handle>> = RefCell::new(HashMap::new());
}

fn check(status: cublasStatus_t, call: &str) {
    assert!(
        status == cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        "cuBLAS {call} failed: {status:?}"
    );
}

/// Runs `f` with this thread's cuBLAS handle for CUDA device `index`, its context current.
fn with_handle<T>(index: usize, f: impl FnOnce(cublasHandle_t) -> T) -> T {
    HANDLES.with(|handles| {
        let mut handles = handles.borrow_mut();
        let entry = match handles.entry(index) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                let context = CudaContext::new(index)
                    .unwrap_or_else(|e| panic!("CUDA device {index} for cuBLAS: {e:?}"));
                context
                    .bind_to_thread()
                    .unwrap_or_else(|e| panic!("CUDA device {index}'s context: {e:?}"));
                let mut handle = std::ptr::null_mut();
                check(unsafe { sys::cublasCreate_v2(&mut handle) }, "cublasCreate");
                entry.insert(Handle { context, handle })
            }
        };
        entry
            .context
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("CUDA device {index}'s context: {e:?}"));
        f(entry.handle)
    })
}

/// `op(a) @ op(b)` by cuBLAS on CUDA device `index`, in the operands' dtype (f32, bf16 or
/// f16), accumulated in f32 as PyTorch's default (f32 products do not use TF32).
pub(crate) fn gemm(
    index: usize,
    a: CubeTensor,
    b: CubeTensor,
    trans_a: bool,
    trans_b: bool,
) -> CubeTensor {
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
    if m == 0 || n == 0 {
        return c;
    }
    let int = |x: usize| i32::try_from(x).expect("a matrix side within cuBLAS's 32-bit ints");
    let resource = |t: &CubeTensor| {
        t.client
            .get_resource::<CudaServer>(t.handle.clone())
            .unwrap_or_else(|e| panic!("a cubecl buffer for cuBLAS: {e:?}"))
    };
    let (ra, rb, rc) = (resource(&a), resource(&b), resource(&c));
    let stream = rc.resource().stream;
    assert!(
        !stream.is_null(),
        "cubecl-cuda without burnscale's stream patch"
    );
    let op = |transpose| match transpose {
        true => cublasOperation_t::CUBLAS_OP_T,
        false => cublasOperation_t::CUBLAS_OP_N,
    };
    let (alpha, beta) = (1f32, 0f32);
    with_handle(index, |handle| unsafe {
        check(
            sys::cublasSetStream_v2(handle, stream as sys::cudaStream_t),
            "cublasSetStream",
        );
        // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS reads
        // each row-major operand as its transpose, with its row length as leading dimension.
        check(
            sys::cublasGemmEx(
                handle,
                op(trans_b),
                op(trans_a),
                int(n),
                int(m),
                int(k),
                (&alpha as *const f32).cast::<c_void>(),
                rb.resource().ptr as *const c_void,
                data_type,
                int(b_cols),
                ra.resource().ptr as *const c_void,
                data_type,
                int(a_cols),
                (&beta as *const f32).cast::<c_void>(),
                rc.resource().ptr as *mut c_void,
                data_type,
                int(n),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        );
    });
    c
}

/// `t` laid out in packed rows, in a buffer of the calling thread's stream. cubecl lets the
/// stream that made a buffer reuse it once this stream's command that last read it is done;
/// cuBLAS's read is enqueued after the command that handed the buffer out, so a buffer of
/// another stream (a tensor made on another thread) is copied here first.
fn operand(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    match t.handle.stream == StreamId::current() {
        true => t,
        false => t.copy(),
    }
}

fn matrix(t: &CubeTensor) -> [usize; 2] {
    let shape = t.meta.shape();
    assert_eq!(shape.num_dims(), 2, "a cuBLAS operand of shape {shape:?}");
    [shape[0], shape[1]]
}
