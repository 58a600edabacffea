//! A [`Communicator`] that counts the bytes its collectives move, by kind, as DeepSpeed's
//! communication logger and nccl-tests size a message: an all-reduce's or a broadcast's
//! buffer, an all-gather's output (every rank's part), a reduce-scatter's input (every
//! rank's chunk), each in the dtype the caller gives. Wraps any engine; what it counts is
//! the same on threads, MPI and NCCL.

use std::cell::Cell;
use std::ops::{AddAssign, Sub};

use burn::prelude::Tensor;
use serde::ser::{Serialize, SerializeStruct, Serializer};

use crate::{Buffer, CollectiveError, Communicator, ReduceOp};

/// Bytes of the messages of each kind of collective (serialized with their
/// [`CollectiveBytes::volume`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveBytes {
    pub all_reduce: u64,
    pub all_gather: u64,
    pub reduce_scatter: u64,
    pub broadcast: u64,
}

impl CollectiveBytes {
    /// The communication volume as the ZeRO paper (Rajbhandari et al. 2020, section 7)
    /// counts it: an all-reduce twice its size (a reduce-scatter, then an all-gather), the
    /// others once. In a ring each rank sends (N-1)/N of it. DDP moves 2Ψ a step, ZeRO-1 and
    /// ZeRO-2 too (a reduce-scatter of the gradients, an all-gather of the updated
    /// parameters), ZeRO-3 3Ψ (parameters gathered for forward and again for backward).
    pub fn volume(&self) -> u64 {
        2 * self.all_reduce + self.all_gather + self.reduce_scatter + self.broadcast
    }

    /// Each count divided by `n` (a mean over `n` steps; `n` of 0 leaves them).
    pub fn per(&self, n: u64) -> CollectiveBytes {
        let n = n.max(1);
        CollectiveBytes {
            all_reduce: self.all_reduce / n,
            all_gather: self.all_gather / n,
            reduce_scatter: self.reduce_scatter / n,
            broadcast: self.broadcast / n,
        }
    }
}

impl Serialize for CollectiveBytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("CollectiveBytes", 5)?;
        s.serialize_field("all_reduce", &self.all_reduce)?;
        s.serialize_field("all_gather", &self.all_gather)?;
        s.serialize_field("reduce_scatter", &self.reduce_scatter)?;
        s.serialize_field("broadcast", &self.broadcast)?;
        s.serialize_field("volume", &self.volume())?;
        s.end()
    }
}

/// What a counter read at `self` counted after its reading `earlier`.
impl Sub for CollectiveBytes {
    type Output = CollectiveBytes;

    fn sub(self, earlier: CollectiveBytes) -> CollectiveBytes {
        CollectiveBytes {
            all_reduce: self.all_reduce - earlier.all_reduce,
            all_gather: self.all_gather - earlier.all_gather,
            reduce_scatter: self.reduce_scatter - earlier.reduce_scatter,
            broadcast: self.broadcast - earlier.broadcast,
        }
    }
}

impl AddAssign for CollectiveBytes {
    fn add_assign(&mut self, more: CollectiveBytes) {
        self.all_reduce += more.all_reduce;
        self.all_gather += more.all_gather;
        self.reduce_scatter += more.reduce_scatter;
        self.broadcast += more.broadcast;
    }
}

/// `inner`, counting ([`Counted::bytes`]).
pub struct Counted<'a> {
    inner: &'a dyn Communicator,
    bytes: Cell<CollectiveBytes>,
}

impl<'a> Counted<'a> {
    pub fn new(inner: &'a dyn Communicator) -> Self {
        Counted {
            inner,
            bytes: Cell::new(CollectiveBytes::default()),
        }
    }

    /// What this rank's collectives moved so far (an all-gather once it returns, its output's
    /// length known; the others as they start).
    pub fn bytes(&self) -> CollectiveBytes {
        self.bytes.get()
    }

    fn count(&self, bytes: usize, kind: fn(&mut CollectiveBytes) -> &mut u64) {
        let mut counted = self.bytes.get();
        *kind(&mut counted) += bytes as u64;
        self.bytes.set(counted);
    }
}

fn tensor_bytes(tensor: &Tensor<1>) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}

impl Communicator for Counted<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CollectiveError> {
        self.count(buf.num_bytes(), |b| &mut b.all_reduce);
        self.inner.all_reduce(buf, op)
    }

    fn all_gather_into(&self, input: &Buffer, output: &mut Buffer) -> Result<(), CollectiveError> {
        self.inner.all_gather_into(input, output)?;
        self.count(output.num_bytes(), |b| &mut b.all_gather);
        Ok(())
    }

    fn reduce_scatter_into(
        &self,
        input: &Buffer,
        output: &mut Buffer,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.count(input.num_bytes(), |b| &mut b.reduce_scatter);
        self.inner.reduce_scatter_into(input, output, op)
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CollectiveError> {
        self.count(input.num_bytes(), |b| &mut b.reduce_scatter);
        self.inner.reduce_scatter(input, op)
    }

    /// Counted once it is done: a rank that receives may hold a buffer of another length
    /// before, the root's after.
    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CollectiveError> {
        self.inner.broadcast(buf, root)?;
        self.count(buf.num_bytes(), |b| &mut b.broadcast);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        self.inner.barrier()
    }

    fn all_reduce_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        self.count(tensor_bytes(&tensor), |b| &mut b.all_reduce);
        self.inner.all_reduce_tensor(tensor, op)
    }

    fn all_gather_tensor(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CollectiveError> {
        let gathered = self.inner.all_gather_tensor(tensor)?;
        self.count(tensor_bytes(&gathered), |b| &mut b.all_gather);
        Ok(gathered)
    }

    fn reduce_scatter_tensor(
        &self,
        tensor: Tensor<1>,
        op: ReduceOp,
    ) -> Result<Tensor<1>, CollectiveError> {
        self.count(tensor_bytes(&tensor), |b| &mut b.reduce_scatter);
        self.inner.reduce_scatter_tensor(tensor, op)
    }

    fn broadcast_tensor(
        &self,
        tensor: Tensor<1>,
        root: usize,
    ) -> Result<Tensor<1>, CollectiveError> {
        let broadcast = self.inner.broadcast_tensor(tensor, root)?;
        self.count(tensor_bytes(&broadcast), |b| &mut b.broadcast);
        Ok(broadcast)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::prelude::*;

    use super::*;
    use crate::threads::ThreadComm;

    /// Every kind counted by its message: the all-gather's whole output, the reduce-scatter's
    /// whole input, in the dtype given (bf16: 2 bytes an element), over buffers and tensors.
    #[test]
    fn counts_each_message_by_kind() {
        let counted = ThreadComm::run(2, Duration::from_secs(60), |comm| {
            let counted = Counted::new(&comm);
            let device = Default::default();
            let mut buf = Buffer::from_f32(crate::DType::F32, vec![1.0; 10]);
            counted.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            counted.all_gather(&buf).unwrap();
            counted.reduce_scatter(buf.clone(), ReduceOp::Sum).unwrap();
            // A receiving rank's buffer may be of another length: the root's is counted.
            let mut received = match comm.rank() {
                0 => buf.clone(),
                _ => Buffer::empty(crate::DType::F32),
            };
            counted.broadcast(&mut received, 0).unwrap();
            let t = Tensor::<1>::ones([8], (&device, burn::tensor::DType::BF16));
            counted
                .all_reduce_tensor(t.clone(), ReduceOp::Mean)
                .unwrap();
            counted.all_gather_tensor(t.clone()).unwrap();
            counted
                .reduce_scatter_tensor(t.clone(), ReduceOp::Mean)
                .unwrap();
            counted.broadcast_tensor(t, 0).unwrap();
            counted.bytes()
        });
        for bytes in counted {
            let bytes = bytes.unwrap();
            assert_eq!(
                bytes,
                CollectiveBytes {
                    all_reduce: 40 + 16,
                    all_gather: 80 + 32,
                    reduce_scatter: 40 + 16,
                    broadcast: 40 + 16,
                }
            );
            assert_eq!(bytes.volume(), 2 * 56 + 112 + 56 + 56);
            assert_eq!(bytes - bytes, CollectiveBytes::default());
            let mut twice = bytes;
            twice += bytes;
            assert_eq!(twice.per(2), bytes);
        }
    }
}
