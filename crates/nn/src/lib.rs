//! What the burnscale models share: layers where Burn's own are slow on the CPU backend, the
//! block split that wrap policies use, and checkpoint reading and writing.

mod activation;
pub mod autocast;
mod blocks;
pub mod config;
pub mod dropout;
pub mod init;
mod loss;
pub mod weights;

pub use activation::gelu_tanh;
pub use blocks::{BlockModel, Mask};
pub use dropout::{Dropout, DropoutConfig};
pub use loss::cross_entropy;
