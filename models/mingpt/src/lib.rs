//! minGPT as in karpathy/minGPT: token + position embeddings, pre-LN blocks with causal
//! self-attention and a 4x GELU MLP, final LayerNorm and LM head. Weight names follow GPT-2's
//! Hugging Face layout, so a GPT-2 `model.safetensors` loads (see [`loader`]).

mod config;
mod error;
mod generate;
pub mod loader;
mod model;

pub use config::GptConfig;
pub use error::GptError;
pub use generate::Sampling;
pub use model::{Block, CausalSelfAttention, Gpt, Mlp, cross_entropy};
