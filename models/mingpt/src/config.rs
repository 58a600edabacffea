use serde::{Deserialize, Serialize};

use crate::GptError;

/// minGPT hyper-parameters. `n_layer`, `n_head` and `n_embd` come from a preset or are set
/// freely (as the DeepSpeed benchmark's `--n_layer 15 --n_head 16 --n_embd 3072`);
/// `vocab_size` and `block_size` come from the data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab_size: usize,
    pub block_size: usize,
    pub embd_pdrop: f64,
    pub resid_pdrop: f64,
    pub attn_pdrop: f64,
}

impl GptConfig {
    /// The model types minGPT ships, by name.
    pub const PRESETS: [&'static str; 9] = [
        "openai-gpt",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gopher-44m",
        "gpt-mini",
        "gpt-micro",
        "gpt-nano",
    ];

    /// A config with free layer/head/width and minGPT's default dropout of 0.1.
    pub fn new(
        n_layer: usize,
        n_head: usize,
        n_embd: usize,
        vocab_size: usize,
        block_size: usize,
    ) -> Self {
        Self {
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            block_size,
            embd_pdrop: 0.1,
            resid_pdrop: 0.1,
            attn_pdrop: 0.1,
        }
    }

    /// A named minGPT model type (`gpt-mini`, `gpt2-xl`, ...).
    pub fn preset(name: &str, vocab_size: usize, block_size: usize) -> Result<Self, GptError> {
        let (n_layer, n_head, n_embd) = match name {
            // GPT-1
            "openai-gpt" => (12, 12, 768), // 117M params
            // GPT-2 configs
            "gpt2" => (12, 12, 768),         // 124M params
            "gpt2-medium" => (24, 16, 1024), // 350M params
            "gpt2-large" => (36, 20, 1280),  // 774M params
            "gpt2-xl" => (48, 25, 1600),     // 1558M params
            // Gophers
            "gopher-44m" => (8, 16, 512),
            // minGPT's own tiny models
            "gpt-mini" => (6, 6, 192),
            "gpt-micro" => (4, 4, 128),
            "gpt-nano" => (3, 3, 48),
            other => return Err(GptError::UnknownPreset(other.to_string())),
        };
        Ok(Self::new(n_layer, n_head, n_embd, vocab_size, block_size))
    }

    /// GPT-2 small with its real vocabulary and context.
    pub fn gpt2() -> Self {
        Self::new(12, 12, 768, 50257, 1024)
    }

    /// A two-layer model for tests.
    pub fn tiny() -> Self {
        Self::new(2, 2, 16, 11, 8)
    }

    pub fn with_dropout(mut self, p: f64) -> Self {
        self.embd_pdrop = p;
        self.resid_pdrop = p;
        self.attn_pdrop = p;
        self
    }

    /// Rejects configs that cannot build a model, naming the fix.
    pub fn validate(&self) -> Result<(), GptError> {
        use burnscale_nn::config::{check_heads, check_positive, check_probabilities};
        check_positive(&[
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ])
        .and_then(|()| check_heads(("n_embd", self.n_embd), ("n_head", self.n_head)))
        .and_then(|()| {
            check_probabilities(&[
                ("embd_pdrop", self.embd_pdrop),
                ("resid_pdrop", self.resid_pdrop),
                ("attn_pdrop", self.attn_pdrop),
            ])
        })
        .map_err(GptError::InvalidConfig)
    }

    /// Parameter count of the model this config builds (untied LM head, as minGPT).
    pub fn num_params(&self) -> usize {
        let (d, v, t) = (self.n_embd, self.vocab_size, self.block_size);
        let block = 2 * 2 * d // ln_1, ln_2
            + d * 3 * d + 3 * d // c_attn
            + d * d + d // attn.c_proj
            + d * 4 * d + 4 * d // c_fc
            + 4 * d * d + d; // mlp.c_proj
        v * d + t * d + self.n_layer * block + 2 * d + d * v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_mingpt() {
        for name in GptConfig::PRESETS {
            let c = GptConfig::preset(name, 50257, 1024).unwrap();
            c.validate().unwrap();
        }
        let gpt2 = GptConfig::preset("gpt2", 50257, 1024).unwrap();
        assert_eq!(gpt2, GptConfig::gpt2());
        // GPT-2 small is 124M with the head tied to wte; minGPT's untied head adds vocab * d.
        assert_eq!(gpt2.num_params() - 50257 * 768, 124_439_808);
    }

    #[test]
    fn bad_configs_are_named() {
        let err = GptConfig::new(2, 3, 16, 11, 8).validate().unwrap_err();
        assert!(err.to_string().contains("divisible by n_head"), "{err}");
        let err = GptConfig::new(2, 2, 16, 11, 0).validate().unwrap_err();
        assert!(err.to_string().contains("block_size"), "{err}");
        let err = GptConfig::preset("gpt5", 11, 8).unwrap_err();
        assert!(err.to_string().contains("gpt-mini"), "{err}");
    }
}
