//! Autocast for the mixed precision policies: while a [`scope`] is active on a thread, the
//! ops that lose too much in 16 bits (softmax and layer norm; the loss always) run in f32 on
//! widened inputs and hand back the caller's dtype, while everything else (matmuls,
//! convolutions, elementwise) runs in the dtype of the weights. Models call these instead of
//! Burn's ops; outside a scope they are Burn's ops unchanged, so the `*-true` policies keep
//! every activation in 16 bits.

use std::cell::Cell;

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

use crate::LayerNorm;

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

/// Autocasts on this thread until the guard drops (the engine opens one around a mixed
/// precision forward and its recomputation).
pub fn scope(on: bool) -> Scope {
    Scope(ACTIVE.with(|a| a.replace(on)))
}

pub struct Scope(bool);

impl Drop for Scope {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.0));
    }
}

/// Whether an op on `dtype` runs in f32 here (a 16-bit dtype inside a [`scope`]).
pub(crate) fn widens(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && ACTIVE.with(Cell::get)
}

pub fn softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    let dtype = x.dtype();
    if !widens(dtype) {
        return crate::softmax(x, dim);
    }
    crate::softmax(x.cast(FloatDType::F32), dim).cast(FloatDType::from(dtype))
}

pub fn layer_norm<const D: usize>(norm: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    if !widens(dtype) {
        return norm.forward(x);
    }
    struct Widen;
    impl ModuleMapper for Widen {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.cast(FloatDType::F32))
        }
    }
    // The cast parameters stay in the graph, so gradients reach the 16-bit weights.
    norm.clone()
        .map(&mut Widen)
        .forward(x.cast(FloatDType::F32))
        .cast(FloatDType::from(dtype))
}

/// The most negative finite value of `activations`' dtype, as an f32: what an additive mask
/// puts on a key that may not be attended (transformers' `finfo(dtype).min`). `f32::MIN`
/// rounds to -inf in f16 and bf16, and a row whose every key is masked would then be NaN
/// rather than uniform.
pub fn lowest<const D: usize>(activations: &Tensor<D>) -> f32 {
    match activations.dtype() {
        DType::F16 => half::f16::MIN.to_f32(),
        DType::BF16 => half::bf16::MIN.to_f32(),
        _ => f32::MIN,
    }
}

/// `created` (a mask or bias built in f32) in the dtype of the activations it meets.
pub fn like<const D: usize, const E: usize>(
    created: Tensor<D>,
    activations: &Tensor<E>,
) -> Tensor<D> {
    created.cast(FloatDType::from(activations.dtype()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LayerNormConfig;

    #[test]
    fn widens_only_in_scope_and_returns_the_input_dtype() {
        let device = Device::default();
        let x = Tensor::<2>::random([4, 8], burn::tensor::Distribution::Default, &device)
            .cast(FloatDType::BF16);
        let norm = LayerNormConfig::new(8).init(&device);
        let norm = norm.map(&mut Bf16);
        let plain = layer_norm(&norm, x.clone());
        let wide = {
            let _on = scope(true);
            layer_norm(&norm, x.clone())
        };
        assert_eq!(plain.dtype(), DType::BF16);
        assert_eq!(wide.dtype(), DType::BF16);
        let s = {
            let _on = scope(true);
            softmax(x, 1)
        };
        assert_eq!(s.dtype(), DType::BF16);
        let sums: Vec<f32> = s
            .cast(FloatDType::F32)
            .sum_dim(1)
            .into_data()
            .try_to_vec()
            .unwrap();
        assert!(sums.iter().all(|v| (v - 1.0).abs() < 1e-2), "{sums:?}");
    }

    struct Bf16;
    impl ModuleMapper for Bf16 {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.cast(FloatDType::BF16))
        }
    }
}
