//! BigBird (Zaheer et al. 2020) as Hugging Face's `BigBirdModel` /
//! `BigBirdForSequenceClassification`: the BERT encoder ([`burnscale_bert`]) with
//! block-sparse attention — every query block attends to the first and last (global) blocks,
//! a sliding window of three blocks and `num_random_blocks` random blocks, while the global
//! query blocks attend to everything ([`attention`]) — or `original_full` attention.

pub mod attention;
mod config;
pub mod loader;
mod model;

pub use config::{AttentionType, BigBirdConfig};
pub use model::{BigBird, ClassificationHead};
