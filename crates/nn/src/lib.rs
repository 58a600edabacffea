//! What the burnscale models share: layers where Burn's own are slow on the CPU backend, the
//! block split that wrap policies use, and checkpoint reading and writing.

#[macro_use]
mod extension;

pub mod activation;
pub mod attention;
pub mod autocast;
mod blocks;
pub mod config;
pub mod counter_random;
#[cfg(feature = "cublas")]
mod cublas;
pub mod device_cache;
pub mod dropout;
pub mod flops;
pub mod gemm;
pub mod init;
pub mod layer_norm;
mod loss;
pub mod regather;
pub mod selective;
pub mod weights;

pub use activation::{ActivationOps, gelu_tanh, softmax};
pub use attention::{AttentionOps, attention};
pub use blocks::{BlockModel, Mask};
pub use dropout::{Dropout, DropoutConfig};
pub use flops::{Flops, RootWeights};
pub use gemm::{GemmOps, gemm};
pub use layer_norm::{LayerNorm, LayerNormConfig};
pub use loss::{cross_entropy, scored_items};

use burn::prelude::*;

/// `inner` (a tensor without autodiff) on the autodiff device `device`, with its gradient
/// checkpointing strategy: `Tensor::from_inner` alone takes the default strategy, and Burn
/// refuses to mix strategies in one operation.
pub fn autodiff_on<const D: usize>(inner: Tensor<D>, device: &Device) -> Tensor<D> {
    let tensor = Tensor::from_inner(inner);
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => tensor.with_gradient_checkpointing_strategy(strategy),
        None => tensor,
    }
}
