//! Collectives on flat Burn float tensors (f32, f16, bf16): what the sharding engine moves.
//! Engines that move host memory (threads, MPI) stage a tensor through a [`Buffer`] here (on
//! a CPU device that is the tensor's own memory); an engine that reads device memory
//! (NCCL) overrides the [`Communicator`] methods and never touches the host.

use burn::prelude::*;
use burn::tensor::DType as TensorDType;
use half::{bf16, f16};

use crate::{Buffer, CollectiveError, Communicator, DType, ReduceOp};

/// The collective dtype of a tensor's dtype.
pub fn dtype_of(dtype: TensorDType) -> Result<DType, CollectiveError> {
    match dtype {
        TensorDType::F32 => Ok(DType::F32),
        TensorDType::F16 => Ok(DType::F16),
        TensorDType::BF16 => Ok(DType::Bf16),
        other => Err(CollectiveError::Invalid(format!(
            "collectives move f32, f16 and bf16 tensors, not {other:?}"
        ))),
    }
}

/// The tensor dtype of a collective dtype.
pub fn tensor_dtype(dtype: DType) -> TensorDType {
    match dtype {
        DType::F32 => TensorDType::F32,
        DType::F16 => TensorDType::F16,
        DType::Bf16 => TensorDType::BF16,
    }
}

fn to_buffer(tensor: Tensor<1>) -> Result<Buffer, CollectiveError> {
    let dtype = dtype_of(tensor.dtype())?;
    let data = tensor.into_data();
    let bad = |e: burn::tensor::DataError| CollectiveError::Invalid(format!("{e:?}"));
    Ok(match dtype {
        DType::F32 => Buffer::F32(data.try_into_vec::<f32>().map_err(bad)?),
        DType::F16 => Buffer::F16(data.try_into_vec::<f16>().map_err(bad)?),
        DType::Bf16 => Buffer::Bf16(data.try_into_vec::<bf16>().map_err(bad)?),
    })
}

fn to_tensor(buf: Buffer, device: &Device) -> Tensor<1> {
    let len = buf.len();
    let data = match buf {
        Buffer::F32(v) => TensorData::new(v, [len]),
        Buffer::F16(v) => TensorData::new(v, [len]),
        Buffer::Bf16(v) => TensorData::new(v, [len]),
    };
    // Keep the buffer's dtype rather than the device's default float type.
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

/// [`Communicator::all_reduce_tensor`] through a host buffer.
pub(crate) fn all_reduce_staged<C: Communicator + ?Sized>(
    comm: &C,
    tensor: Tensor<1>,
    op: ReduceOp,
) -> Result<Tensor<1>, CollectiveError> {
    let device = tensor.device();
    let mut buf = to_buffer(tensor)?;
    comm.all_reduce(&mut buf, op)?;
    Ok(to_tensor(buf, &device))
}

/// [`Communicator::all_gather_tensor`] through host buffers.
pub(crate) fn all_gather_staged<C: Communicator + ?Sized>(
    comm: &C,
    tensor: Tensor<1>,
) -> Result<Tensor<1>, CollectiveError> {
    let device = tensor.device();
    Ok(to_tensor(comm.all_gather(&to_buffer(tensor)?)?, &device))
}

/// [`Communicator::reduce_scatter_tensor`] through host buffers.
pub(crate) fn reduce_scatter_staged<C: Communicator + ?Sized>(
    comm: &C,
    tensor: Tensor<1>,
    op: ReduceOp,
) -> Result<Tensor<1>, CollectiveError> {
    let device = tensor.device();
    Ok(to_tensor(
        comm.reduce_scatter(to_buffer(tensor)?, op)?,
        &device,
    ))
}

/// [`Communicator::broadcast_tensor`] through a host buffer.
pub(crate) fn broadcast_staged<C: Communicator + ?Sized>(
    comm: &C,
    tensor: Tensor<1>,
    root: usize,
) -> Result<Tensor<1>, CollectiveError> {
    let device = tensor.device();
    let mut buf = to_buffer(tensor)?;
    comm.broadcast(&mut buf, root)?;
    Ok(to_tensor(buf, &device))
}
