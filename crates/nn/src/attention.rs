//! Scaled dot-product attention whose backward recomputes the attention probabilities.
//!
//! Written as ops, `softmax(q·kᵀ + bias)`, dropout and `·v`, the graph keeps the
//! probabilities for the last product: a `[b, heads, t, t]` tensor every layer (the largest
//! activation of a transformer at long contexts), where PyTorch's fused attention keeps none.
//! [`attention`] is one op, [`AttentionOps::attention`], that keeps `q`, `k`, `v` (kept for
//! the products anyway), the bias and the dropout mask, and in backward computes the
//! probabilities `p` again (one more `q·kᵀ`), then, with `p'` the dropped-out probabilities
//! and `o = p'·v`:
//!
//! ```text
//! dv = p'ᵀ·do      dp = dropout(do·vᵀ)      ds = p * (dp - sum(dp * p))      dq = ds·k      dk = dsᵀ·q
//! ```
//!
//! (`sum` along the keys); a tracked bias gets `ds`, summed over the axes it is broadcast along.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, ExtensionType, TensorMetadata};
use burn::prelude::*;
use burn::tensor::FloatDType;

use crate::activation::softmax_backward;
use crate::{Dropout, autocast};

/// `dropout(softmax(q·kᵀ + bias))·v` for `q`: `[b, heads, t_q, d]`, `k`: `[b, heads, t_k, d]`,
/// `v`: `[b, heads, t_k, d_v]` (scaled as the caller wants: models scale `q`), and `bias`
/// broadcast to `[b, heads, t_q, t_k]` (`-inf` where a key is masked). Under an autocast
/// [`scope`](autocast::scope) the softmax runs in f32, as [`autocast::softmax`] does.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    bias: Option<Tensor<4>>,
    dropout: &Dropout,
) -> Tensor<4> {
    let [b, h, t_q, _] = q.dims();
    let t_k = k.dims()[2];
    // The backward gives k and v gradients of q's batch and heads: none broadcast.
    assert!(
        k.dims()[..2] == [b, h] && v.dims()[..2] == [b, h],
        "attention's q, k and v differ in batch or heads: {:?}, {:?}, {:?}",
        q.dims(),
        k.dims(),
        v.dims()
    );
    let dropped = dropout.draw::<4>(Shape::new([b, h, t_q, t_k]), &q.device());
    let masking = Masking::from_parts(
        bias.map(Tensor::into_dispatch),
        dropped.map(|(mask, scale)| (mask.into_dispatch(), scale)),
    );
    let widen = autocast::widens(q.dtype());
    Tensor::from_dispatch(<burn::backend::Dispatch as AttentionOps>::attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        masking,
        widen,
    ))
}

/// What attention adds to the scores (a bias) and what dropout zeroes in the probabilities
/// (and the factor it scales the rest by): the extension macro takes enums of tensors, not
/// `Option`s.
#[derive(ExtensionType)]
pub enum Masking<B: Backend> {
    None,
    Bias(FloatTensor<B>),
    Dropout(BoolTensor<B>, f64),
    Both(FloatTensor<B>, BoolTensor<B>, f64),
}

type Dropped<B> = (BoolTensor<B>, f64);

impl<B: Backend> Masking<B> {
    fn from_parts(bias: Option<FloatTensor<B>>, dropped: Option<Dropped<B>>) -> Self {
        match (bias, dropped) {
            (None, None) => Self::None,
            (Some(bias), None) => Self::Bias(bias),
            (None, Some((mask, scale))) => Self::Dropout(mask, scale),
            (Some(bias), Some((mask, scale))) => Self::Both(bias, mask, scale),
        }
    }

    fn into_parts(self) -> (Option<FloatTensor<B>>, Option<Dropped<B>>) {
        match self {
            Self::None => (None, None),
            Self::Bias(bias) => (Some(bias), None),
            Self::Dropout(mask, scale) => (None, Some((mask, scale))),
            Self::Both(bias, mask, scale) => (Some(bias), Some((mask, scale))),
        }
    }
}

/// `softmax(q·kᵀ + bias)` along the keys: in f32 when `widen`, else in `q`'s dtype.
fn probabilities<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
    widen: bool,
) -> FloatTensor<B> {
    let mut scores = B::float_matmul(q, B::float_swap_dims(k, 2, 3));
    // Widened before the bias is added: f16's lowest value (a mask's) plus a score below
    // about -16 is -inf, and a row whose every key is masked would be NaN.
    let widened = |t: FloatTensor<B>| match widen {
        true => B::float_cast(t, FloatDType::F32),
        false => t,
    };
    scores = widened(scores);
    if let Some(bias) = bias {
        scores = B::float_add(scores, widened(bias.clone()));
    }
    B::softmax(scores, 3)
}

/// `t` in the dtype of `like`.
fn cast_like<B: Backend>(t: FloatTensor<B>, like: &FloatTensor<B>) -> FloatTensor<B> {
    let dtype = like.dtype();
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, FloatDType::from(dtype)),
    }
}

/// `t` with the `dropped` elements zeroed and the rest scaled; `t` without a mask.
fn drop_out<B: Backend>(t: FloatTensor<B>, dropped: Option<&Dropped<B>>) -> FloatTensor<B> {
    match dropped {
        Some((mask, scale)) => B::float_mul_scalar(
            B::float_mask_fill(t, mask.clone(), 0.0.into()),
            (*scale).into(),
        ),
        None => t,
    }
}

fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
    dropped: Option<&Dropped<B>>,
    widen: bool,
) -> FloatTensor<B> {
    let p = cast_like::<B>(probabilities::<B>(q, k, bias, widen), &v);
    B::float_matmul(drop_out::<B>(p, dropped), v)
}

backend_ops! {
    /// The op behind [`attention`](super::attention): on a backend's own tensors its ops;
    /// under autodiff, a node that keeps its inputs, not the probabilities.
    pub trait AttentionOps {
        /// `widen`: the softmax runs in f32.
        fn attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            #[extension_type] masking: Masking<Self>,
            widen: bool,
        ) -> FloatTensor<Self> {
            let (bias, dropped) = masking.into_parts();
            super::forward::<Self>(q, k, v, bias.as_ref(), dropped.as_ref(), widen)
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        masking: Masking<Self>,
        widen: bool,
    ) -> FloatTensor<Self> {
        /// Parents `q`, `k`, `v` and, where it is given, the bias.
        #[derive(Debug)]
        struct AttentionBackward;

        /// `q`, `k`, `v`, the bias, the dropout mask and its scale, whether the softmax widens.
        type State<B> = (
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            Option<FloatTensor<B>>,
            Option<Dropped<B>>,
            bool,
        );

        impl<B: Backend, const N: usize> Backward<B, N> for AttentionBackward {
            type State = State<B>;

            fn backward(
                self,
                ops: Ops<Self::State, N>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (q, k, v, bias, dropped, widen) = ops.state;
                let d_out = grads.consume::<B>(&ops.node);
                let mut parents = ops.parents.into_iter();
                let mut parent = || parents.next().flatten();
                let (q_node, k_node, v_node, bias_node) = (parent(), parent(), parent(), parent());
                // In f32 where the forward's softmax was.
                let p = probabilities::<B>(q.clone(), k.clone(), bias.as_ref(), widen);
                if let Some(node) = v_node {
                    let kept = drop_out::<B>(cast_like::<B>(p.clone(), &v), dropped.as_ref());
                    let dv = B::float_matmul(B::float_swap_dims(kept, 2, 3), d_out.clone());
                    grads.register::<B>(node.id, dv);
                }
                if q_node.is_none() && k_node.is_none() && bias_node.is_none() {
                    return;
                }
                let dp = B::float_matmul(d_out, B::float_swap_dims(v, 2, 3));
                let dp = cast_like::<B>(drop_out::<B>(dp, dropped.as_ref()), &p);
                let ds = softmax_backward::<B>(p, dp, 3); // d(scores)
                if let (Some(node), Some(bias)) = (bias_node, &bias) {
                    let db = cast_like::<B>(sum_to::<B>(ds.clone(), &bias.shape()), bias);
                    grads.register::<B>(node.id, db);
                }
                let ds = cast_like::<B>(ds, &q);
                if let Some(node) = q_node {
                    grads.register::<B>(node.id, B::float_matmul(ds.clone(), k));
                }
                if let Some(node) = k_node {
                    grads.register::<B>(node.id, B::float_matmul(B::float_swap_dims(ds, 2, 3), q));
                }
            }
        }

        let (bias, dropped) = masking.into_parts();
        let [q_node, k_node, v_node] = [q.node(), k.node(), v.node()];
        let bias_node = bias.as_ref().map(|b| b.node());
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let bias = bias.map(|b| b.into_primitive());
        let out = forward::<B>(
            q.clone(),
            k.clone(),
            v.clone(),
            bias.as_ref(),
            dropped.as_ref(),
            widen,
        );
        let state = (q, k, v, bias, dropped, widen);
        // The bias is a parent only where there is one: a mask gets no gradient, a learned
        // bias (relative positions, ALiBi's slopes) does.
        match bias_node {
            Some(bias_node) => match AttentionBackward
                .prepare::<C>([q_node, k_node, v_node, bias_node])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
            None => match AttentionBackward
                .prepare::<C>([q_node, k_node, v_node])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        }
    }
}

/// `t` summed over the axes where `shape` is 1 (a broadcast operand's gradient).
fn sum_to<B: Backend>(t: FloatTensor<B>, shape: &Shape) -> FloatTensor<B> {
    (0..shape.num_dims()).fold(t, |t, d| match shape[d] == 1 && t.shape()[d] != 1 {
        true => B::float_sum_dim(t, d),
        false => t,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DropoutConfig, dropout};
    use burn::tensor::activation::softmax;
    use burn::tensor::{DType, Distribution, Tolerance};

    /// The same attention written as Burn's ops (its softmax, differentiated by its autodiff;
    /// none of this crate's ops), the softmax in f32 under autocast.
    fn as_ops(
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        bias: Option<Tensor<4>>,
        dropout: &Dropout,
    ) -> Tensor<4> {
        let dtype = q.dtype();
        let widened = |t: Tensor<4>| match autocast::widens(dtype) {
            true => t.cast(FloatDType::F32),
            false => t,
        };
        let mut scores = widened(q.matmul(k.swap_dims(2, 3)));
        if let Some(bias) = bias {
            scores = scores + widened(bias);
        }
        let p = softmax(scores, 3).cast(FloatDType::from(dtype));
        dropout.forward(p).matmul(v)
    }

    /// The output and the gradients of `q`, `k` and `v` under the cotangent `r`, flat and in
    /// f32, with this thread's dropout stream at `seed`.
    fn run(
        f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
        qkv: &[Tensor<4>; 3],
        r: &Tensor<4>,
        seed: u64,
    ) -> Vec<Tensor<1>> {
        dropout::seed(seed);
        let [q, k, v] = qkv.clone().map(Tensor::require_grad);
        let out = f(q.clone(), k.clone(), v.clone());
        let r = r.clone().cast(FloatDType::from(out.dtype()));
        let grads = (out.clone() * r).sum().backward();
        let flat = |t: Tensor<4>| t.cast(FloatDType::F32).flatten::<1>(0, 3);
        let mut all = vec![flat(out.inner())];
        for t in [q, k, v] {
            all.push(flat(t.grad(&grads).expect("a gradient")));
        }
        all
    }

    /// The two sides differ in the order of their f32 operations (Burn's softmax backward
    /// against this crate's); a gradient is a difference of terms up to about 8 in size, each
    /// through about 8 roundings of 2^-23 (relative): 2^-17 apart at most.
    fn f32_tolerance() -> Tolerance<f32> {
        Tolerance::rel_abs(1e-5, 2f32.powi(-17))
    }

    /// `q`, `k`, `v` (`t_q` = 5) and a cotangent for the output, drawn once: the device's
    /// random stream is shared with tests running beside this one.
    fn qkv(device: &Device, t_k: usize) -> ([Tensor<4>; 3], Tensor<4>) {
        let normal =
            |shape: [usize; 4]| Tensor::random(shape, Distribution::Normal(0.0, 1.0), device);
        (
            [
                normal([2, 3, 5, 4]),
                normal([2, 3, t_k, 4]),
                normal([2, 3, t_k, 6]),
            ],
            normal([2, 3, 5, 6]),
        )
    }

    /// Without a bias, with a causal `-inf` mask and with a finite bias broadcast over heads,
    /// with and without dropout: the output and every gradient equal the ops'.
    #[test]
    fn equals_the_ops_in_value_and_every_gradient() {
        let device = Device::default().autodiff();
        let (inputs, r) = qkv(&device, 5);
        let causal = Tensor::<2>::zeros([5, 5], &device)
            .mask_fill(
                Tensor::<2, Bool>::tril_mask([5, 5], 0, &device),
                f32::NEG_INFINITY,
            )
            .unsqueeze::<4>();
        let padding = Tensor::<4>::random([2, 1, 1, 5], Distribution::Uniform(-3.0, 0.0), &device);
        for p in [0.0, 0.3] {
            let dropout = DropoutConfig::new(p).init();
            for (what, bias) in [
                ("none", None),
                ("causal", Some(causal.clone())),
                ("padding", Some(padding.clone())),
            ] {
                let want = run(
                    &|q, k, v| as_ops(q, k, v, bias.clone(), &dropout),
                    &inputs,
                    &r,
                    5,
                );
                let got = run(
                    &|q, k, v| attention(q, k, v, bias.clone(), &dropout),
                    &inputs,
                    &r,
                    5,
                );
                for (name, (got, want)) in ["out", "dq", "dk", "dv"]
                    .iter()
                    .zip(got.into_iter().zip(want))
                {
                    let (got, want) = (got.into_data(), want.into_data());
                    assert_eq!(
                        got.shape(),
                        want.shape(),
                        "{name}, bias {what}, dropout {p}"
                    );
                    got.assert_approx_eq::<f32>(&want, f32_tolerance());
                }
            }
        }
    }

    /// bf16 inputs under autocast: the softmax and its backward run in f32 on the f32
    /// probabilities, the products in bf16, as the ops run them (so the two agree but for a
    /// rare rounding); the result is bf16.
    #[test]
    fn widens_the_softmax_under_autocast() {
        let device = Device::default().autodiff();
        let (inputs, r) = qkv(&device, 7);
        let inputs = inputs.map(|t| t.cast(FloatDType::BF16));
        let dropout = DropoutConfig::new(0.0).init();
        let _on = autocast::scope(true);
        let want = run(&|q, k, v| as_ops(q, k, v, None, &dropout), &inputs, &r, 1);
        let got = run(
            &|q, k, v| attention(q, k, v, None, &dropout),
            &inputs,
            &r,
            1,
        );
        dropout::seed(1);
        let out = attention(
            inputs[0].clone(),
            inputs[1].clone(),
            inputs[2].clone(),
            None,
            &dropout,
        );
        assert_eq!(out.dtype(), DType::BF16);
        for (got, want) in got.into_iter().zip(want) {
            let (got, want) = (got.into_data(), want.into_data());
            got.assert_approx_eq::<f32>(&want, Tolerance::rel_abs(2f32.powi(-8), 2f32.powi(-8)));
            // Here the two agree exactly; another CPU's order of the f32 sums may flip a
            // rounding to bf16 here and there. A softmax in bf16 moves a quarter to a half of
            // the values by a rounding, which the tolerance above cannot tell.
            let (got, want) = (
                got.try_to_vec::<f32>().unwrap(),
                want.try_to_vec::<f32>().unwrap(),
            );
            let moved = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            assert!(
                moved <= got.len() / 16,
                "{moved} of {} values differ",
                got.len()
            );
        }
    }

    /// f16 under autocast (16-mixed): a row whose every key is masked with f16's lowest value
    /// (a sequence of padding) has a finite output and gradients, however low its scores
    /// (added to the mask in f16, a score below about -16 made it -inf, and the row NaN).
    #[test]
    fn a_row_masked_whole_in_f16_stays_finite() {
        let device = Device::default().autodiff();
        let (inputs, r) = qkv(&device, 7);
        let [q, k, v] = inputs.map(|t| t.cast(FloatDType::F16));
        // Scores of -16 and below: a head's width of 4 products of at most -4 x 1.
        let inputs = [q.abs() * -4.0 - 4.0, k.abs() + 1.0, v];
        let [b, _, _, _] = inputs[0].dims();
        let t_k = inputs[1].dims()[2];
        let lowest = autocast::lowest(&inputs[0]);
        // The first sequence's keys all masked; the second's none.
        let bias = Tensor::<4>::zeros([b, 1, 1, t_k], &device)
            .slice_fill([0..1, 0..1, 0..1, 0..t_k], lowest)
            .cast(FloatDType::F16);
        let dropout = DropoutConfig::new(0.0).init();
        let _on = autocast::scope(true);
        let all = run(
            &|q, k, v| attention(q, k, v, Some(bias.clone()), &dropout),
            &inputs,
            &r,
            1,
        );
        for (name, t) in ["out", "dq", "dk", "dv"].iter().zip(all) {
            let values: Vec<f32> = t.into_data().try_to_vec().expect("f32");
            assert!(values.iter().all(|x| x.is_finite()), "{name}: {values:?}");
        }
    }

    /// A learned bias (per head, as relative positions are; per batch and key, broadcast)
    /// gets the ops' gradient, `d(scores)` summed over the axes it is broadcast along.
    #[test]
    fn a_learned_bias_gets_the_ops_gradient() {
        let device = Device::default().autodiff();
        let (inputs, r) = qkv(&device, 5);
        let dropout = DropoutConfig::new(0.3).init();
        for shape in [[1, 3, 5, 5], [2, 1, 1, 5]] {
            let bias = Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
            let grad = |f: &dyn Fn(Tensor<4>) -> Tensor<4>| {
                dropout::seed(9);
                let bias = bias.clone().require_grad();
                let grads = (f(bias.clone()) * r.clone()).sum().backward();
                bias.grad(&grads).expect("a bias gradient").into_data()
            };
            let [q, k, v] = inputs.clone();
            let want = grad(&|b| as_ops(q.clone(), k.clone(), v.clone(), Some(b), &dropout));
            let got = grad(&|b| attention(q.clone(), k.clone(), v.clone(), Some(b), &dropout));
            assert_eq!(got.shape().to_vec(), shape.to_vec(), "bias {shape:?}");
            got.assert_approx_eq::<f32>(&want, f32_tolerance());
        }
    }
}
