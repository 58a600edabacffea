//! What a micro-step's mean loss counts for in its optimizer step's loss: the step's loss is
//! the mean over every item of its global batch, however those fall on ranks and
//! micro-batches, and so are the gradients the engine averages over the ranks.

use burn::prelude::*;
use burnscale_collective::{Communicator, ReduceOp};

use crate::ShardError;

/// A micro-step's share of its step's loss.
#[derive(Debug, Clone)]
pub enum Share {
    /// One of `n` micro-batches, each rank's counting as many items: `1/n`.
    Even(usize),
    /// The fraction (a `[1]` device scalar) that a micro-batch's items make of those that
    /// every rank's micro-batches of the step score: for a loss that ignores some targets
    /// (padding, tokens not masked), whose batches count differently.
    Items(Box<Tensor<1>>),
}

impl Share {
    /// The [`Share::Items`] of each of this rank's micro-batches, `first` and the `rest`,
    /// scoring that many items each: their sum over the ranks is one all-reduce of one value
    /// (on the device with NCCL; the CPU engines reduce through the host, as they always
    /// do). A step without items to score gives shares of 0, not NaN.
    pub fn of_items(
        comm: &dyn Communicator,
        first: Tensor<1>,
        rest: Vec<Tensor<1>>,
    ) -> Result<Vec<Share>, ShardError> {
        let mut total = rest
            .iter()
            .fold(first.clone(), |sum, items| sum + items.clone());
        total = total.inner();
        if comm.world_size() > 1 {
            total = comm.all_reduce_tensor(total, ReduceOp::Sum)?;
        }
        let total = total.clamp_min(1.0);
        Ok(std::iter::once(first)
            .chain(rest)
            .map(|items| Share::Items(Box::new(items.inner() / total.clone())))
            .collect())
    }

    /// The micro-step's part of the step's loss, from its mean `loss`, on a rank of `world`
    /// whose gradients the engine then averages over the ranks (so `world` times its share).
    pub(crate) fn of(&self, loss: Tensor<1>, world: usize) -> Tensor<1> {
        match self {
            Share::Even(n) => loss / *n as f64,
            Share::Items(fraction) => loss * (*fraction.clone() * world as f64),
        }
    }
}
