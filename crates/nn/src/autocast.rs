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

    /// In a scope, layer norm and softmax are the f32 ops on the widened input, rounded once
    /// to bf16 (a bf16 softmax outside it is not, for these values); both hand back bf16.
    #[test]
    fn widens_only_in_scope_and_returns_the_input_dtype() {
        let device = Device::default();
        let x = Tensor::<2>::random([16, 64], burn::tensor::Distribution::Default, &device) * 8.0;
        let x = x.cast(FloatDType::BF16);
        let wide_x = x.clone().cast(FloatDType::F32);
        let f32_norm = LayerNormConfig::new(64).init(&device);
        let norm = f32_norm.clone().map(&mut Bf16);
        let same = |a: Tensor<2>, b: Tensor<2>| a.equal(b).all().into_scalar::<bool>();
        let once = |t: Tensor<2>| t.cast(FloatDType::BF16);

        // The layer norm normalizes a 16-bit input in f32 itself (`crate::layer_norm`):
        // widening changes no value, only the dtype the parameters meet it in.
        let plain = layer_norm(&norm, x.clone());
        let wide = {
            let _on = scope(true);
            layer_norm(&norm, x.clone())
        };
        assert_eq!((plain.dtype(), wide.dtype()), (DType::BF16, DType::BF16));
        assert!(same(wide, once(f32_norm.forward(wide_x.clone()))));

        let plain = softmax(x.clone(), 1);
        let wide = {
            let _on = scope(true);
            softmax(x, 1)
        };
        assert_eq!((plain.dtype(), wide.dtype()), (DType::BF16, DType::BF16));
        assert!(same(wide.clone(), once(crate::softmax(wide_x, 1))));
        assert!(!same(wide, plain), "a bf16 softmax rounds along the way");
    }

    struct Bf16;
    impl ModuleMapper for Bf16 {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.cast(FloatDType::BF16))
        }
    }
}
