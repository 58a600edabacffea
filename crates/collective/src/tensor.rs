//! Collectives on Burn float tensors (f32, f16, bf16), through [`Buffer`].

use burn::prelude::*;
use burn::tensor::DType as TensorDType;
use half::{bf16, f16};

use crate::{Buffer, CollectiveError, Communicator, ReduceOp};

fn to_buffer<const D: usize>(tensor: Tensor<D>) -> Result<Buffer, CollectiveError> {
    let data = tensor.into_data();
    let bad = |e: burn::tensor::DataError| CollectiveError::Invalid(format!("{e:?}"));
    Ok(match data.dtype() {
        TensorDType::F32 => Buffer::F32(data.try_into_vec::<f32>().map_err(bad)?),
        TensorDType::F16 => Buffer::F16(data.try_into_vec::<f16>().map_err(bad)?),
        TensorDType::BF16 => Buffer::Bf16(data.try_into_vec::<bf16>().map_err(bad)?),
        other => {
            return Err(CollectiveError::Invalid(format!(
                "collectives move f32, f16 and bf16 tensors, not {other:?}"
            )));
        }
    })
}

fn to_tensor<const D: usize>(buf: Buffer, shape: Shape, device: &Device) -> Tensor<D> {
    let (data, dtype) = match buf {
        Buffer::F32(v) => (TensorData::new(v, shape), TensorDType::F32),
        Buffer::F16(v) => (TensorData::new(v, shape), TensorDType::F16),
        Buffer::Bf16(v) => (TensorData::new(v, shape), TensorDType::BF16),
    };
    // Keep the buffer's dtype rather than the device's default float type.
    Tensor::from_data(data, (device, dtype))
}

/// The element-wise reduction of `tensor` over all ranks.
pub fn all_reduce_tensor<const D: usize>(
    comm: &dyn Communicator,
    tensor: Tensor<D>,
    op: ReduceOp,
) -> Result<Tensor<D>, CollectiveError> {
    let (shape, device) = (tensor.shape(), tensor.device());
    let mut buf = to_buffer(tensor)?;
    comm.all_reduce(&mut buf, op)?;
    Ok(to_tensor(buf, shape, &device))
}

/// `root`'s `tensor` on every rank (shapes must match).
pub fn broadcast_tensor<const D: usize>(
    comm: &dyn Communicator,
    tensor: Tensor<D>,
    root: usize,
) -> Result<Tensor<D>, CollectiveError> {
    let (shape, device) = (tensor.shape(), tensor.device());
    let mut buf = to_buffer(tensor)?;
    comm.broadcast(&mut buf, root)?;
    if buf.len() != shape.num_elements() {
        return Err(CollectiveError::Mismatch {
            me: comm.rank(),
            detail: format!(
                "broadcast of shape {:?} received {} elements from rank {root}",
                shape.dims::<D>(),
                buf.len()
            ),
        });
    }
    Ok(to_tensor(buf, shape, &device))
}

/// Every rank's `tensor` concatenated along dim 0; dim 0 may differ between ranks, the
/// other dims must match.
pub fn all_gather_tensor<const D: usize>(
    comm: &dyn Communicator,
    tensor: Tensor<D>,
) -> Result<Tensor<D>, CollectiveError> {
    let (shape, device) = (tensor.shape(), tensor.device());
    let dims = shape.dims::<D>();
    let row: usize = dims[1..].iter().product();
    let gathered = comm.all_gather(&to_buffer(tensor)?)?;
    if row == 0 || gathered.len() % row != 0 {
        return Err(CollectiveError::Mismatch {
            me: comm.rank(),
            detail: format!(
                "all_gather of rows of {:?} received {} elements",
                &dims[1..],
                gathered.len()
            ),
        });
    }
    let mut out = dims;
    out[0] = gathered.len() / row;
    Ok(to_tensor(gathered, Shape::from(out), &device))
}

/// This rank's chunk ([`crate::shard_range`]) of the flattened reduction of `tensor`.
pub fn reduce_scatter_tensor<const D: usize>(
    comm: &dyn Communicator,
    tensor: Tensor<D>,
    op: ReduceOp,
) -> Result<Tensor<1>, CollectiveError> {
    let device = tensor.device();
    let chunk = comm.reduce_scatter(&to_buffer(tensor)?, op)?;
    let len = chunk.len();
    Ok(to_tensor(chunk, Shape::from([len]), &device))
}
