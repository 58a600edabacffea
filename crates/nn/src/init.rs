//! Initialisation the models share (GPT-2's, minGPT's and HF's `_init_weights`).

use burn::nn::{Initializer, Linear, LinearConfig};
use burn::prelude::*;

/// HF's default `initializer_range`, minGPT's 0.02.
pub const INITIALIZER_RANGE: f64 = 0.02;

/// N(0, std).
pub fn normal(std: f64) -> Initializer {
    Initializer::Normal { mean: 0.0, std }
}

/// A linear layer with an N(0, std) weight and a zero bias.
pub fn linear(d_in: usize, d_out: usize, std: f64, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_initializer(normal(std))
        .init(device);
    layer.bias = Some(Initializer::Zeros.init([d_out], device));
    layer
}
