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
}
