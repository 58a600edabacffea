//! Model FLOPs, MFU's numerator, counted as PaLM (Chowdhery et al. 2022, appendix B) and
//! nanoGPT's `estimate_mfu` count them: a forward and backward pass costs 6 FLOPs per weight
//! of a matrix product per position the product runs at (2 forward, 4 backward), and
//! attention's two products (the scores, and the values they mix) 12·d per query per key it
//! scores, in every block (a causal mask's half included, as there). Embedding lookups are
//! left out; the norms' few weights count among their blocks', as nanoGPT counts them, and
//! activations and the softmax count nothing. So is recomputation left out
//! (`--checkpoint-activations` does more work for the same model FLOPs, as PaLM's MFU,
//! unlike its HFU, says).

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;

/// A model's FLOP count, from its whole parameters' shapes: taken before training, when no
/// parameter is a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flops {
    /// Weights of the products run at every position the blocks run (the blocks', a language
    /// model's head, a ViT's patch projection).
    pub per_position: usize,
    /// Weights of the products run once per sequence (a classifier on its first position).
    pub per_sequence: usize,
    /// The blocks' attention widths summed (layers · d_model).
    pub attention_width: usize,
}

/// One parameter outside the blocks that [`Flops`] counts (a head's, a patch projection's, a
/// final norm's): its weights, and whether they run at every position or once a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootWeights {
    pub id: ParamId,
    pub weights: usize,
    pub per_position: bool,
}

impl RootWeights {
    /// Every parameter of `module`, each run at every position or once a sequence.
    pub fn of<M: Module>(module: &M, per_position: bool) -> Vec<Self> {
        struct Collect(Vec<RootWeights>, bool);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push(RootWeights {
                    id: param.id,
                    weights: param.lazy_shape().num_elements(),
                    per_position: self.1,
                });
            }
        }
        let mut collect = Collect(Vec::new(), per_position);
        module.visit(&mut collect);
        collect.0
    }

    /// What these weights leave undone in [`Flops::of`] when frozen: their weight gradient, 2
    /// FLOPs a weight each time they run, over `batch` sequences of `seq` positions. (Their
    /// input gradient is still counted: backward goes on below them, or, at a patch
    /// projection, the count has it as it has it for a trained one.)
    pub fn frozen(&self, batch: usize, seq: usize) -> f64 {
        let runs = if self.per_position { seq } else { 1 };
        2.0 * (self.weights * runs * batch) as f64
    }
}

impl Flops {
    /// The count of a model whose blocks hold `block_weights` (all run at every position) and
    /// whose `root` weights run as each says; `attention_width` is layers · d_model.
    pub fn new(block_weights: usize, root: &[RootWeights], attention_width: usize) -> Self {
        let outside = |per_position: bool| {
            root.iter()
                .filter(|r| r.per_position == per_position)
                .map(|r| r.weights)
                .sum::<usize>()
        };
        Flops {
            per_position: block_weights + outside(true),
            per_sequence: outside(false),
            attention_width,
        }
    }

    /// FLOPs of a forward and backward pass over `batch` sequences of `seq` positions, each
    /// query scoring `keys` keys (on average).
    pub fn of(&self, batch: usize, seq: usize, keys: f64) -> f64 {
        let (batch, seq) = (batch as f64, seq as f64);
        let weights = self.per_position as f64 * seq + self.per_sequence as f64;
        batch * (6.0 * weights + 12.0 * self.attention_width as f64 * seq * keys)
    }

    /// The part of [`Flops::of`] that frozen parameters of the blocks leave undone: no
    /// weight gradient for a frozen weight (2 FLOPs per position), and for a block below the
    /// lowest unit that trains, which backward does not reach, no input gradient either (2
    /// more per weight, and attention's backward, 8·d per query per key). `blocks` gives each
    /// block's weights, frozen weights, and whether backward stops above it. Frozen weights
    /// outside the blocks are [`RootWeights::frozen`]'s; the input gradient that the lowest
    /// block that trains leaves out above frozen embeddings is not counted out (its first
    /// products' alone: which those are is the block's to say).
    pub fn frozen_in_blocks(
        &self,
        batch: usize,
        seq: usize,
        keys: f64,
        blocks: &[(usize, usize, bool)],
    ) -> f64 {
        let width = self.attention_width as f64 / blocks.len().max(1) as f64;
        let (batch, seq) = (batch as f64, seq as f64);
        let per_sequence: f64 = blocks
            .iter()
            .map(|&(weights, frozen, unreached)| {
                let no_input_grad = match unreached {
                    true => 2.0 * weights as f64 * seq + 8.0 * width * seq * keys,
                    false => 0.0,
                };
                2.0 * frozen as f64 * seq + no_input_grad
            })
            .sum();
        batch * per_sequence
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two blocks of 100 weights and width 8, at 4 sequences of 10 positions: the bottom one
    /// frozen below the lowest that trains (its forward alone: 2 per weight, 4·d a query-key
    /// pair), the top one with 30 frozen weights (their weight gradients out).
    #[test]
    fn frozen_blocks_leave_out_their_backward() {
        let flops = Flops {
            per_position: 200,
            per_sequence: 0,
            attention_width: 16,
        };
        let (batch, seq, keys) = (4, 10, 10.0);
        let all = flops.of(batch, seq, keys);
        let saved = flops.frozen_in_blocks(batch, seq, keys, &[(100, 100, true), (100, 30, false)]);
        let bottom = 2.0 * 100.0 * 10.0 + 4.0 * 8.0 * 10.0 * 10.0;
        let top = (6.0 * 100.0 - 2.0 * 30.0) * 10.0 + 12.0 * 8.0 * 10.0 * 10.0;
        assert_eq!(all - saved, 4.0 * (bottom + top));
        assert_eq!(
            flops.frozen_in_blocks(batch, seq, keys, &[(100, 0, false); 2]),
            0.0
        );
    }
}
