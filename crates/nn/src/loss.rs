//! The classification loss every model head ends in.

use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::activation::log_softmax;

/// Mean cross-entropy of `logits` against class ids; rows whose target is negative are
/// ignored (PyTorch's `ignore_index=-1`, which minGPT uses). Computed in f32 whatever the
/// logits' dtype.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = logits.dims();
    let logp = log_softmax(logits.cast(FloatDType::F32), 1); // [n, classes]
    let keep = kept(targets.clone());
    let picked = logp
        .gather(1, targets.clamp_min(0).reshape([n, 1]))
        .reshape([n]);
    (picked * keep.clone()).sum().neg() / keep.sum().clamp_min(1.0)
}

/// The items [`cross_entropy`] averages over: its targets that are not ignored (`[1]`, f32).
pub fn scored_items(targets: Tensor<1, Int>) -> Tensor<1> {
    kept(targets).sum()
}

/// 1 where a target is scored, 0 where it is ignored (`[n]`, f32).
fn kept(targets: Tensor<1, Int>) -> Tensor<1> {
    targets.greater_equal_elem(0).float().cast(FloatDType::F32)
}
