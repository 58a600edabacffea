//! Model FLOPs, MFU's numerator, counted as PaLM (Chowdhery et al. 2022, appendix B) and
//! nanoGPT's `estimate_mfu` count them: a forward and backward pass costs 6 FLOPs per weight
//! of a matrix product per position the product runs at (2 forward, 4 backward), and
//! attention's two products (the scores, and the values they mix) 12·d per query per key it
//! scores, in every block (a causal mask's half included, as there). Embedding lookups are
//! left out; the norms' few weights count among their blocks', as nanoGPT counts them, and
//! activations and the softmax count nothing. So is recomputation left out
//! (`--checkpoint-activations` does more work for the same model FLOPs, as PaLM's MFU,
//! unlike its HFU, says).

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

impl Flops {
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
    /// outside the blocks are not counted out (a frozen head or patch projection: how often
    /// they run is the model's to say), nor is the input gradient that the lowest block that
    /// trains leaves out above frozen embeddings (its first products' alone: which those are
    /// is the block's to say).
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
