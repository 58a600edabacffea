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
    let ignored = targets.clone().lower_elem(0);
    let picked = logp
        .gather(1, targets.clone().clamp_min(0).reshape([n, 1]))
        .reshape([n]);
    // Filled, not multiplied by 0: an ignored row's stand-in class may have a logit of -inf
    // (a masked token), and 0 * -inf is NaN.
    picked.mask_fill(ignored, 0.0).sum().neg() / scored_items(targets).clamp_min(1.0)
}

/// The items [`cross_entropy`] averages over: its targets that are not ignored (`[1]`, f32).
pub fn scored_items(targets: Tensor<1, Int>) -> Tensor<1> {
    targets
        .greater_equal_elem(0)
        .float()
        .cast(FloatDType::F32)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ignored rows (target -1) count for nothing, even one whose first class (the stand-in
    /// the gather reads) has a logit of -inf: the loss and its gradient are the scored rows'.
    #[test]
    fn ignored_rows_count_for_nothing_whatever_their_logits() {
        let device = Device::default().autodiff();
        let logits = Tensor::<2>::from_floats(
            [
                [f32::NEG_INFINITY, 1.0, 2.0],
                [0.5, -1.0, 3.0],
                [2.0, 0.0, 1.0],
            ],
            &device,
        )
        .require_grad();
        let targets = Tensor::<1, Int>::from_ints([-1, 2, 0], &device);
        let loss = cross_entropy(logits.clone(), targets);
        let grads = loss.backward();
        let logp = |row: [f32; 3], class: usize| {
            let log_sum = row.iter().map(|x| x.exp()).sum::<f32>().ln();
            row[class] - log_sum
        };
        let want = -(logp([0.5, -1.0, 3.0], 2) + logp([2.0, 0.0, 1.0], 0)) / 2.0;
        let got = loss.into_scalar::<f32>();
        assert!((got - want).abs() <= 1e-6, "loss {got}, want {want}");
        let dx: Vec<f32> = logits
            .grad(&grads)
            .expect("dx")
            .into_data()
            .try_to_vec()
            .expect("f32");
        assert_eq!(&dx[..3], &[0.0; 3], "an ignored row's gradient: {dx:?}");
        assert!(dx.iter().all(|g| g.is_finite()), "{dx:?}");
    }
}
