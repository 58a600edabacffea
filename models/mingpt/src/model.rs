use burn::module::{ParamId, list_param_ids};
use burn::nn::{Embedding, EmbeddingConfig};
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burnscale_nn::autocast::{self, layer_norm};
use burnscale_nn::init::{INITIALIZER_RANGE, linear, normal};
use burnscale_nn::{
    BlockModel, Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Mask, RootWeights, attention,
    device_cache, gelu_tanh, regather,
};

use crate::{GptConfig, GptError};

/// Causal self-attention with one fused q/k/v projection, as GPT-2's `attn.c_attn`.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    pub c_attn: Linear,
    pub c_proj: Linear,
    attn_dropout: Dropout,
    resid_dropout: Dropout,
    n_head: usize,
}

impl CausalSelfAttention {
    fn new(config: &GptConfig, device: &Device) -> Self {
        let d = config.n_embd;
        Self {
            c_attn: linear(d, 3 * d, INITIALIZER_RANGE, device),
            c_proj: linear(d, d, residual_std(config), device),
            attn_dropout: DropoutConfig::new(config.attn_pdrop).init(),
            resid_dropout: DropoutConfig::new(config.resid_pdrop).init(),
            n_head: config.n_head,
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, c] = x.dims();
        let hd = c / self.n_head;
        let heads = |x: Tensor<3>| x.reshape([b, t, self.n_head, hd]).swap_dims(1, 2);
        let qkv = regather::linear(&self.c_attn, x); // [b, t, 3c]
        let mut qkv = qkv.chunk(3, 2).into_iter();
        let (q, k, v) = match (qkv.next(), qkv.next(), qkv.next()) {
            (Some(q), Some(k), Some(v)) => (heads(q), heads(k), heads(v)), // [b, nh, t, hd]
            _ => unreachable!("chunk(3) yields three tensors"),
        };

        // Scaling q rather than the scores touches t·hd elements per head instead of t².
        let q = q * (1.0 / (hd as f64).sqrt());
        // Built once per device, as nanoGPT registers its `bias` buffer once.
        let device = q.device();
        let future = device_cache::for_length("causal bias", t, &[2, 3], &device, |n| {
            let above = Tensor::<2, Bool>::tril_mask([n, n], 0, &device); // true where j > i
            Tensor::<2>::zeros([n, n], &device)
                .mask_fill(above, f32::NEG_INFINITY)
                .unsqueeze::<4>()
        });
        let future = autocast::like(future, &q);
        let y = attention(q, k, v, Some(future), &self.attn_dropout); // [b, nh, t, hd]
        let y = y.swap_dims(1, 2).reshape([b, t, c]);
        self.resid_dropout
            .forward(regather::linear(&self.c_proj, y))
    }
}

/// The 4x MLP with GPT-2's tanh-approximated GELU.
#[derive(Module, Debug)]
pub struct Mlp {
    pub c_fc: Linear,
    pub c_proj: Linear,
    dropout: Dropout,
}

impl Mlp {
    fn new(config: &GptConfig, device: &Device) -> Self {
        let d = config.n_embd;
        Self {
            c_fc: linear(d, 4 * d, INITIALIZER_RANGE, device),
            c_proj: linear(4 * d, d, residual_std(config), device),
            dropout: DropoutConfig::new(config.resid_pdrop).init(),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = gelu_tanh(regather::linear(&self.c_fc, x)); // [b, t, 4c]
        self.dropout.forward(regather::linear(&self.c_proj, h))
    }
}

/// One pre-LN transformer block: the unit that sharding and checkpointing wrap.
#[derive(Module, Debug)]
pub struct Block {
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
}

impl Block {
    fn new(config: &GptConfig, device: &Device) -> Self {
        Self {
            ln_1: LayerNormConfig::new(config.n_embd).init(device),
            attn: CausalSelfAttention::new(config, device),
            ln_2: LayerNormConfig::new(config.n_embd).init(device),
            mlp: Mlp::new(config, device),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(layer_norm(&self.ln_1, x));
        x.clone() + self.mlp.forward(layer_norm(&self.ln_2, x))
    }
}

/// The language model. Field names are GPT-2's (`wte`, `wpe`, `h`, `ln_f`, `lm_head`).
#[derive(Module, Debug)]
pub struct Gpt {
    pub wte: Embedding,
    pub wpe: Embedding,
    drop: Dropout,
    pub h: Vec<Block>,
    pub ln_f: LayerNorm,
    pub lm_head: Linear,
    block_size: usize,
}

impl Gpt {
    /// A freshly initialised model, as minGPT's `_init_weights` does it.
    pub fn new(config: &GptConfig, device: &Device) -> Result<Self, GptError> {
        config.validate()?;
        let embedding = |n, d| {
            EmbeddingConfig::new(n, d)
                .with_initializer(normal(INITIALIZER_RANGE))
                .init(device)
        };
        let lm_head = LinearConfig::new(config.n_embd, config.vocab_size)
            .with_bias(false)
            .with_initializer(normal(INITIALIZER_RANGE))
            .init(device);
        Ok(Self {
            wte: embedding(config.vocab_size, config.n_embd),
            wpe: embedding(config.block_size, config.n_embd),
            drop: DropoutConfig::new(config.embd_pdrop).init(),
            h: (0..config.n_layer)
                .map(|_| Block::new(config, device))
                .collect(),
            ln_f: LayerNormConfig::new(config.n_embd).init(device),
            lm_head,
            block_size: config.block_size,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The tokens the model reads and predicts: `wte`'s rows.
    pub fn vocab_size(&self) -> usize {
        self.wte.weight.lazy_shape()[0]
    }

    /// Logits for every position. Panics if the sequence is longer than `block_size`:
    /// callers crop their context, as [`Gpt::generate`] does.
    pub fn forward(&self, idx: Tensor<2, Int>) -> Tensor<3> {
        let x = self
            .h
            .iter()
            .fold(self.embed(idx), |x, block| block.forward(x));
        self.head(x)
    }

    /// Token plus position embeddings, the input of the first block.
    pub fn embed(&self, idx: Tensor<2, Int>) -> Tensor<3> {
        let [_, t] = idx.dims();
        assert!(
            t <= self.block_size,
            "cannot forward a sequence of length {t}, block size is only {}",
            self.block_size
        );
        let pos = device_cache::positions(t, &idx.device()); // [1, t]
        let tok_emb = self.wte.forward(idx); // [b, t, c]
        let pos_emb = self.wpe.forward(pos); // [1, t, c]
        self.drop.forward(tok_emb + pos_emb)
    }

    /// Logits from the last block's output.
    pub fn head(&self, x: Tensor<3>) -> Tensor<3> {
        self.lm_head.forward(layer_norm(&self.ln_f, x)) // [b, t, vocab]
    }

    /// Logits and the mean cross-entropy against `targets` (`-1` marks ignored positions).
    pub fn forward_loss(
        &self,
        idx: Tensor<2, Int>,
        targets: Tensor<2, Int>,
    ) -> (Tensor<3>, Tensor<1>) {
        let logits = self.forward(idx);
        let loss = cross_entropy(logits.clone(), targets);
        (logits, loss)
    }
}

/// Mean token cross-entropy; positions whose target is negative are ignored.
pub fn cross_entropy(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    burnscale_nn::cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

/// GPT-2's scaled init of the projections that write into the residual stream.
fn residual_std(config: &GptConfig) -> f64 {
    INITIALIZER_RANGE / (2.0 * config.n_layer as f64).sqrt()
}

impl BlockModel for Gpt {
    type Block = Block;
    type Input = Tensor<2, Int>;
    type Target = Tensor<2, Int>;
    type Logits = Tensor<3>;

    /// Causality is each block's own mask; there is no padding.
    fn embed(&self, idx: Tensor<2, Int>) -> (Tensor<3>, Mask) {
        (Gpt::embed(self, idx), None)
    }

    fn extent(&self, idx: &Tensor<2, Int>) -> [usize; 2] {
        idx.dims()
    }

    /// Every weight but the two lookup tables runs at every position (nanoGPT leaves out
    /// `wpe` alone: its head is `wte`, ours a matrix of its own).
    fn root_weights(&self) -> Vec<RootWeights> {
        [
            RootWeights::of(&self.ln_f, true),
            RootWeights::of(&self.lm_head, true),
        ]
        .concat()
    }

    fn attention_width(&self) -> usize {
        self.h.len() * self.wte.weight.lazy_shape()[1]
    }

    fn block_forward(&self, block: &Block, x: Tensor<3>, _mask: &Mask) -> Tensor<3> {
        block.forward(x)
    }

    fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        cross_entropy(self.head(x), targets)
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        Gpt::head(self, x)
    }

    /// Targets of -1 (padding) are not scored.
    fn loss_items(&self, targets: &Tensor<2, Int>) -> Option<Tensor<1>> {
        Some(burnscale_nn::scored_items(targets.clone().flatten(0, 1)))
    }

    fn embedding_params(&self) -> Vec<ParamId> {
        [list_param_ids(&self.wte), list_param_ids(&self.wpe)].concat()
    }

    fn head_params(&self) -> Vec<ParamId> {
        [list_param_ids(&self.ln_f), list_param_ids(&self.lm_head)].concat()
    }

    burnscale_nn::block_list!(h);

    fn checkpoint_keys(&self) -> Box<dyn burnscale_nn::weights::KeyMap> {
        Box::new(crate::loader::Gpt2Keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefix's logits are the whole sequence's first logits (causal attention), at every
    /// prefix length: those that cut the cached power-of-two mask and positions as well as
    /// those that use them whole.
    #[test]
    fn every_prefix_sees_only_itself() {
        let device = Device::default();
        let config = GptConfig::tiny();
        let model = Gpt::new(&config, &device).unwrap();
        let t = config.block_size;
        let tokens: Vec<i64> = (0..t as i64).map(|i| (i * 7 + 3) % 11).collect();
        let idx = |n: usize| {
            Tensor::<2, Int>::from_data(TensorData::new(tokens[..n].to_vec(), [1, n]), &device)
        };
        let whole = model.forward(idx(t)); // [1, t, vocab]
        for n in 1..t {
            let prefix = model.forward(idx(n));
            let diff = (prefix - whole.clone().narrow(1, 0, n))
                .abs()
                .max()
                .into_scalar::<f32>();
            assert!(diff < 1e-5, "prefix of {n} differs by {diff}");
        }
    }

    /// The FLOPs of nanoGPT's `estimate_mfu` (PaLM's appendix B): 6 per parameter but the
    /// lookup tables' per token, and 12·L·d·T per token for attention; from the configuration's
    /// own count.
    #[test]
    fn flops_are_nanogpts() {
        let (device, config) = (Device::default(), GptConfig::gpt2());
        let model = Gpt::new(&config, &device).unwrap(); // lazy: nothing is drawn
        let (l, d, t) = (config.n_layer, config.n_embd, config.block_size);
        let n = config.num_params() - (config.vocab_size + t) * d;
        let per_token = 6 * n + 12 * l * d * t;
        let idx = Tensor::<2, Int>::zeros([3, t], &device);
        let ours = model.train_flops(&model.flops(), &idx);
        assert_eq!(ours, (3 * t * per_token) as f64);
    }
}
