//! BERT (Devlin et al. 2019) and DistilBERT (Sanh et al. 2019) as Hugging Face lays them out:
//! embeddings (word, position, token type), post-LN encoder layers with padding masks, and
//! the pooler, sequence-classification and masked-LM heads. One model serves both; the
//! layouts differ in key names and heads ([`loader`]). Tokenization is the `tokenizers`
//! crate's ([`tokenizer`]).

mod config;
mod error;
pub mod loader;
mod model;
pub mod tokenizer;

pub use config::{Activation, BertConfig, BertHead, Layout};
pub use error::BertError;
pub use model::{
    Bert, BertInput, Classifier, Embeddings, Kernel, Layer, MaskedLmHead, SelfAttention,
    first_token, full_attention,
};
