//! Activations whose backward is one op, not the derivative of their decomposition.
//!
//! Burn's autodiff has no node for softmax nor for the tanh GELU: it differentiates the ops
//! they are built from one by one, so a graph keeps their intermediates (softmax: the
//! exponentials, a second tensor of the attention scores' size; the GELU: two more tensors of
//! the MLP's width) and the backward runs as many kernels again. Here each is one op,
//! [`ActivationOps`], whose forward is the backend's own (Flex's one-pass softmax; on Cube the
//! same ops, fused) and whose backward keeps one tensor:
//!
//! ```text
//! softmax:  keeps y = softmax(x);  dx = y * (dy - sum(dy * y))      (sum along its axis)
//! GELU:     keeps x;               dx = dy * (s + x * s * (1 - s) * z'(x))
//! ```
//!
//! with `z(x) = 2·√(2/π)·(x + 0.044715·x³)`, `s = σ(z)`: GPT-2's GELU
//! `0.5·x·(1 + tanh(z/2))` is `x·σ(z)`.

use burn::backend::Backend;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ActivationOps as BurnActivationOps;
use burn::backend::tensor::FloatTensor;
use burn::prelude::*;
use burn::tensor::FloatDType;

/// `exp(x) / sum(exp(x))` along `dim`.
pub fn softmax<const D: usize>(x: Tensor<D>, dim: usize) -> Tensor<D> {
    assert!(dim < D, "a softmax along axis {dim} of a {D}-d tensor");
    Tensor::from_dispatch(<burn::backend::Dispatch as ActivationOps>::softmax(
        x.into_dispatch(),
        dim,
    ))
}

/// GPT-2's GELU, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as ActivationOps>::gelu_tanh(
        x.into_dispatch(),
    ))
}

const TWO_SQRT_2_OVER_PI: f64 = 1.595_769_121_605_730_7;
const CUBIC: f64 = 0.044715;

/// `z(x) = 2·√(2/π)·(x + 0.044715·x³)`, computed as `(0.044715·x² + 1)·x·2√(2/π)` from `x`
/// and its `square` (which the backward needs too).
fn gelu_z<B: Backend>(x: FloatTensor<B>, square: FloatTensor<B>) -> FloatTensor<B> {
    let factor = B::float_add_scalar(B::float_mul_scalar(square, CUBIC.into()), 1.0.into());
    B::float_mul_scalar(B::float_mul(factor, x), TWO_SQRT_2_OVER_PI.into())
}

/// Softmax's backward along `dim`, from its output `y`: `y * (dy - sum(dy * y))`.
pub(crate) fn softmax_backward<B: Backend>(
    y: FloatTensor<B>,
    dy: FloatTensor<B>,
    dim: usize,
) -> FloatTensor<B> {
    let dot = B::float_sum_dim(B::float_mul(dy.clone(), y.clone()), dim);
    B::float_mul(B::float_sub(dy, dot), y)
}

/// `x·σ(z(x))` on a backend's own tensors.
fn gelu_tanh_of<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let square = B::float_mul(x.clone(), x.clone());
    let s = B::sigmoid(gelu_z::<B>(x.clone(), square));
    B::float_mul(x, s)
}

backend_ops! {
    /// The ops behind [`softmax`](super::softmax) and [`gelu_tanh`](super::gelu_tanh): on a
    /// backend's own tensors, its ops; under autodiff, nodes that keep one tensor each and
    /// differentiate in one step.
    pub trait ActivationOps {
        fn softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
            <Self as BurnActivationOps<Self>>::softmax(x, dim)
        }

        // `x·σ(z)` rather than Burn's `gelu_approximate`: on Flex its `tanh` goes through libm
        // per element and the cube through `powf`, 2.7x slower.
        fn gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self> {
            super::gelu_tanh_of::<Self>(x)
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> ActivationOps for Autodiff<B, C> {
    fn softmax(x: FloatTensor<Self>, dim: usize) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SoftmaxBackward;

        impl<B: Backend> Backward<B, 1> for SoftmaxBackward {
            type State = (FloatTensor<B>, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (y, dim) = ops.state;
                let dy = grads.consume::<B>(&ops.node);
                let [x_node] = ops.parents;
                if let Some(node) = x_node {
                    grads.register::<B>(node.id, softmax_backward::<B>(y, dy, dim));
                }
            }
        }

        let nodes = [x.node()];
        let y = B::softmax(x.into_primitive(), dim);
        match SoftmaxBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((y.clone(), dim), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn gelu_tanh(x: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GeluTanhBackward;

        impl<B: Backend> Backward<B, 1> for GeluTanhBackward {
            type State = FloatTensor<B>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let x = ops.state;
                let dy = grads.consume::<B>(&ops.node);
                let [x_node] = ops.parents;
                if let Some(node) = x_node {
                    // In f32 for 16-bit inputs: f16's x² overflows from |x| = 256, and the slope
                    // x·σ(1-σ)·z' would be 0·inf, NaN, where the gradient is 1 or 0.
                    let dtype = FloatDType::from(x.dtype());
                    let widens = !matches!(dtype, FloatDType::F32 | FloatDType::F64);
                    let cast = |t: FloatTensor<B>, to: FloatDType| match widens {
                        true => B::float_cast(t, to),
                        false => t,
                    };
                    let (x, dy) = (cast(x, FloatDType::F32), cast(dy, FloatDType::F32));
                    let square = B::float_mul(x.clone(), x.clone());
                    let s = B::sigmoid(gelu_z::<B>(x.clone(), square.clone()));
                    // z'(x) = 2√(2/π)·(1 + 3·0.044715·x²)
                    let dz = B::float_mul_scalar(
                        B::float_add_scalar(
                            B::float_mul_scalar(square, (3.0 * CUBIC).into()),
                            1.0.into(),
                        ),
                        TWO_SQRT_2_OVER_PI.into(),
                    );
                    let one_minus_s = B::float_add_scalar(B::float_neg(s.clone()), 1.0.into());
                    let slope =
                        B::float_mul(B::float_mul(x, B::float_mul(s.clone(), one_minus_s)), dz);
                    let dx = B::float_mul(dy, B::float_add(s, slope));
                    grads.register::<B>(node.id, cast(dx, dtype));
                }
            }
        }

        let nodes = [x.node()];
        let x = x.into_primitive();
        let y = gelu_tanh_of::<B>(x.clone());
        match GeluTanhBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(x, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::activation::gelu_approximate;
    use burn::tensor::{Distribution, Tolerance};

    /// `f`'s value at `x` and its input gradient under the cotangent `r`, each flat.
    fn values_and_gradients<const D: usize>(
        x: &Tensor<D>,
        r: Tensor<D>,
        f: &dyn Fn(Tensor<D>) -> Tensor<D>,
    ) -> [Tensor<1>; 2] {
        let x = x.clone().require_grad();
        let y = f(x.clone());
        let grads = (y.clone() * r).sum().backward();
        let dx = x.grad(&grads).expect("dx");
        [y.inner().flatten(0, D - 1), dx.flatten(0, D - 1)]
    }

    fn assert_same<const D: usize>(
        x: &Tensor<D>,
        ours: &dyn Fn(Tensor<D>) -> Tensor<D>,
        burns: &dyn Fn(Tensor<D>) -> Tensor<D>,
        tolerance: Tolerance<f32>,
        what: &str,
    ) {
        let r = Tensor::<D>::random(x.shape(), Distribution::Default, &x.device());
        let got = values_and_gradients(x, r.clone(), ours);
        let want = values_and_gradients(x, r, burns);
        for (name, (got, want)) in ["y", "dx"].iter().zip(got.into_iter().zip(want)) {
            let (got, want) = (got.into_data(), want.into_data());
            assert_eq!(got.shape(), want.shape(), "{what}: {name}");
            got.assert_approx_eq::<f32>(&want, tolerance);
        }
    }

    /// Against Burn's softmax (its decomposition under autodiff), along the last axis and a
    /// middle one, with masked (`-inf`) scores as attention has.
    #[test]
    fn softmax_equals_burns_in_value_and_gradient() {
        let device = Device::default().autodiff();
        let x = Tensor::<4>::random([2, 3, 5, 7], Distribution::Normal(0.0, 3.0), &device);
        // About 30% of the scores masked, never a row's first, so no row is all `-inf`.
        let masked = Tensor::<4>::random([1, 1, 5, 7], Distribution::Default, &device)
            .slice_assign(
                [0..1, 0..1, 0..5, 0..1],
                Tensor::zeros([1, 1, 5, 1], &device),
            )
            .greater_elem(0.7)
            .expand([2, 3, 5, 7]);
        let x = x.mask_fill(masked, f32::NEG_INFINITY);
        for dim in [3, 1] {
            assert_same(
                &x,
                &|x| softmax(x, dim),
                &|x| burn::tensor::activation::softmax(x, dim),
                Tolerance::rel_abs(1e-5, 1e-6),
                &format!("softmax along {dim}"),
            );
        }
    }

    /// Against Burn's `gelu_approximate` (tanh; its decomposition under autodiff), over the
    /// range where both branches of the curve count.
    #[test]
    fn gelu_tanh_equals_burns_in_value_and_gradient() {
        let device = Device::default().autodiff();
        let x = Tensor::<2>::random([16, 33], Distribution::Normal(0.0, 3.0), &device);
        assert_same(
            &x,
            &gelu_tanh,
            &gelu_approximate,
            Tolerance::rel_abs(1e-5, 1e-6),
            "gelu_tanh",
        );
    }

    /// In f16 far out on the curve, where it is flat (x² overflows f16 from |x| = 256), the
    /// gradient is 0 on the left and 1 on the right, not NaN; nearer in, f32's within f16's
    /// rounding.
    #[test]
    fn gelu_tanh_has_a_gradient_far_out_in_f16() {
        let device = Device::default().autodiff();
        let xs = [-300.0, -3.0, 0.5, 3.0, 300.0];
        let gradient = |dtype: FloatDType| -> Vec<f32> {
            let x = Tensor::<1>::from_floats(xs, &device)
                .cast(dtype)
                .require_grad();
            let grads = gelu_tanh(x.clone()).sum().backward();
            let dx = x.grad(&grads).expect("dx").cast(FloatDType::F32);
            dx.into_data().try_to_vec().expect("f32")
        };
        let (half, full) = (gradient(FloatDType::F16), gradient(FloatDType::F32));
        assert_eq!((half[0], half[4]), (0.0, 1.0), "{half:?}");
        for (h, f) in half.iter().zip(&full) {
            assert!(
                (h - f).abs() <= 4.0 * f32::from(half::f16::EPSILON),
                "{half:?} against {full:?}"
            );
        }
    }
}
