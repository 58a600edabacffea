//! Layers the burnscale models share, where Burn's own are slow on the CPU backend.

mod activation;
mod blocks;
pub mod dropout;

pub use activation::gelu_tanh;
pub use blocks::BlockModel;
pub use dropout::{Dropout, DropoutConfig};
