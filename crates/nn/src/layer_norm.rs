//! Layer normalization whose backward is one op, not the derivative of its decomposition.
//!
//! Burn's `LayerNorm` runs its backend's `layer_norm`, but Burn's autodiff has no such op: it
//! differentiates mean, centre, variance, square root, divide, scale and shift one by one,
//! about 19 kernels a layer norm on a GPU (README, Kernels per step), most of them unfused
//! element-wise ops between row statistics and full activations, and it keeps the centred
//! and the normalized activations for them. [`LayerNorm`] keeps the same parameters (`gamma`,
//! `beta`: checkpoints and loaders see no difference) and runs [`LayerNormOps::layer_norm`],
//! whose backward keeps only its input and computes, with `g = dy * gamma` and the normalized
//! input `x^ = (x - mean) * rstd`,
//!
//!     dx = rstd * (g - mean(g) - x^ * mean(g * x^))      dgamma = sum(dy * x^)      dbeta = sum(dy)
//!
//! (means over the normalized axis, sums over every other), the row statistics recomputed.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Shape, TensorMetadata};
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

/// [`LayerNorm`]'s settings, as Burn's `LayerNormConfig` has them.
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    /// The size of the normalized (last) axis.
    pub d_model: usize,
    /// Added to the variance before its square root.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl LayerNormConfig {
    pub fn init(&self, device: &Device) -> LayerNorm {
        LayerNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            beta: Initializer::Zeros.init([self.d_model], device),
            epsilon: self.epsilon,
        }
    }
}

/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` over the last axis.
#[derive(Module, Debug)]
pub struct LayerNorm {
    pub gamma: Param<Tensor<1>>,
    pub beta: Param<Tensor<1>>,
    epsilon: f64,
}

impl LayerNorm {
    /// `x`: `[.., d_model]` -> the same shape.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let (gamma, beta) = (self.gamma.val(), self.beta.val());
        assert_eq!(
            x.dims()[D - 1],
            gamma.dims()[0],
            "a layer norm of width {} given an input of shape {:?}",
            gamma.dims()[0],
            x.dims()
        );
        // As Burn's: f16 cannot hold the sum of squares, so it normalizes in f32; so does
        // bf16 where the backend would take the row statistics in bf16 (its 8 bits round a
        // mean of 1000-odd by 4), as PyTorch's kernels do not.
        let dtype = x.dtype();
        let widens = match dtype {
            DType::F16 => true,
            DType::BF16 => takes_statistics_in_bf16(&x.device()),
            _ => false,
        };
        if widens {
            let wide = |t: Tensor<1>| t.cast(FloatDType::F32);
            return apply(
                x.cast(FloatDType::F32),
                wide(gamma),
                wide(beta),
                self.epsilon,
            )
            .cast(FloatDType::from(dtype));
        }
        apply(x, gamma, beta, self.epsilon)
    }
}

/// Whether `device`'s backend computes a bf16 layer norm in bf16: cubecl's runs Burn's
/// decomposition (mean, centre, variance) in the input's dtype, where Flex's and LibTorch's
/// kernels accumulate in f32.
fn takes_statistics_in_bf16(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().without_autodiff().as_dispatch(),
            DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

fn apply<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as LayerNormOps>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    ))
}

backend_ops! {
    /// The op behind [`LayerNorm`](super::LayerNorm): on a backend's own tensors its
    /// `layer_norm` (Flex's one pass, fused on Cube); under autodiff, a node that keeps the
    /// input and gamma and differentiates in one step.
    pub trait LayerNormOps {
        /// `x`: `[.., d]`; `gamma`, `beta`: `[d]`.
        fn layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> FloatTensor<Self> {
            <Self as ModuleOps<Self>>::layer_norm(x, gamma, Some(beta), epsilon)
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LayerNormBackward;

        impl<B: Backend> Backward<B, 3> for LayerNormBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, f64);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (x, gamma, epsilon) = ops.state;
                let dy = grads.consume::<B>(&ops.node);
                // In f32 whatever the inputs' dtype, as PyTorch's backward accumulates: in
                // bf16 each of the steps below would round (8 bits), the sums most of all.
                let dtype = FloatDType::from(x.dtype());
                let widens = !matches!(dtype, FloatDType::F32 | FloatDType::F64);
                let cast = |t: FloatTensor<B>, to: FloatDType| match widens {
                    true => B::float_cast(t, to),
                    false => t,
                };
                let wide = |t| cast(t, FloatDType::F32);
                let narrow = |t| cast(t, dtype);
                let (x, gamma, dy) = (wide(x), wide(gamma), wide(dy));
                let shape = x.shape();
                let last = shape.num_dims() - 1;
                let d = shape[last];
                let rows = Shape::new([shape.num_elements() / d, d]);
                let mean = B::float_mean_dim(x.clone(), last);
                let centred = B::float_sub(x, mean);
                let var = B::float_mean_dim(B::float_mul(centred.clone(), centred.clone()), last);
                let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(var, epsilon.into())));
                let normed = B::float_mul(centred, rstd.clone());
                // Sums over every axis but the last, as `[rows, d]` summed down its rows.
                let column_sum = |t: FloatTensor<B>| {
                    let summed = B::float_sum_dim(B::float_reshape(t, rows.clone()), 0);
                    B::float_reshape(summed, Shape::new([d]))
                };
                let [x_node, gamma_node, beta_node] = ops.parents;
                if let Some(node) = beta_node {
                    grads.register::<B>(node.id, narrow(column_sum(dy.clone())));
                }
                if let Some(node) = gamma_node {
                    let dgamma = column_sum(B::float_mul(dy.clone(), normed.clone()));
                    grads.register::<B>(node.id, narrow(dgamma));
                }
                if let Some(node) = x_node {
                    let mut broadcast = vec![1; last + 1];
                    broadcast[last] = d;
                    let g = B::float_mul(dy, B::float_reshape(gamma, Shape::from(broadcast)));
                    let mean_g = B::float_mean_dim(g.clone(), last);
                    let mean_gn = B::float_mean_dim(B::float_mul(g.clone(), normed.clone()), last);
                    let inner =
                        B::float_sub(B::float_sub(g, mean_g), B::float_mul(normed, mean_gn));
                    grads.register::<B>(node.id, narrow(B::float_mul(inner, rstd)));
                }
            }
        }

        let nodes = [x.node(), gamma.node(), beta.node()];
        let (x, gamma) = (x.into_primitive(), gamma.into_primitive());
        let y = B::layer_norm(
            x.clone(),
            gamma.clone(),
            Some(beta.into_primitive()),
            epsilon,
        );
        match LayerNormBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x, gamma, epsilon), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    /// Burn's own layer norm with our parameters' values (shifted off 1 and 0, so that every
    /// term of the backward counts).
    fn pair(device: &Device) -> (LayerNorm, burn::nn::LayerNorm) {
        let ours = LayerNormConfig::new(6).init(device);
        let gamma = Tensor::<1>::random([6], Distribution::Uniform(0.5, 1.5), device);
        let beta = Tensor::<1>::random([6], Distribution::Uniform(-0.5, 0.5), device);
        let mut burns = burn::nn::LayerNormConfig::new(6).init(device);
        burns.gamma = Param::from_tensor(gamma.clone());
        burns.beta = Some(Param::from_tensor(beta.clone()));
        let ours = LayerNorm {
            gamma: Param::from_tensor(gamma),
            beta: Param::from_tensor(beta),
            ..ours
        };
        (ours, burns)
    }

    #[test]
    fn equals_burns_layer_norm_in_value_and_every_gradient() {
        let device = Device::default().autodiff();
        let (ours, burns) = pair(&device);
        let x = Tensor::<3>::random([2, 5, 6], Distribution::Normal(0.3, 2.0), &device);
        let r = Tensor::<3>::random([2, 5, 6], Distribution::Default, &device);
        let run = |f: &dyn Fn(Tensor<3>) -> Tensor<3>, gamma: &Tensor<1>, beta: &Tensor<1>| {
            let x = x.clone().require_grad();
            let y = f(x.clone());
            let grads = (y.clone() * r.clone()).sum().backward();
            [
                y.inner().flatten::<1>(0, 2),
                x.grad(&grads).expect("x").flatten(0, 2),
                gamma.grad(&grads).expect("gamma"),
                beta.grad(&grads).expect("beta"),
            ]
        };
        let want = run(
            &|x| burns.forward(x),
            &burns.gamma.val(),
            &burns.beta.as_ref().expect("beta").val(),
        );
        let got = run(&|x| ours.forward(x), &ours.gamma.val(), &ours.beta.val());
        for (name, (got, want)) in ["y", "dx", "dgamma", "dbeta"]
            .iter()
            .zip(got.into_iter().zip(want))
        {
            let (got, want) = (got.into_data(), want.into_data());
            assert_eq!(got.shape(), want.shape(), "{name}");
            got.assert_approx_eq::<f32>(&want, Tolerance::rel_abs(1e-5, 1e-5));
        }
    }

    #[test]
    fn f16_inputs_are_normalized_in_f32_and_handed_back_in_f16() {
        let device = Device::default();
        let (ours, _) = pair(&device);
        let x = Tensor::<2>::random([4, 6], Distribution::Normal(0.0, 300.0), &device);
        let y = ours.forward(x.clone().cast(FloatDType::F16));
        assert_eq!(y.dtype(), DType::F16);
        // y is within 4 of 0 here: rounding x to f16 moves it by up to 4 * 2^-11, and rounding
        // y itself as much again.
        y.cast(FloatDType::F32).into_data().assert_approx_eq::<f32>(
            &ours.forward(x).into_data(),
            Tolerance::absolute(8.0 * 2f32.powi(-11)),
        );
    }

    /// bf16 activations (a real width): the backward works in f32, so the gradients are the
    /// f32 ones of the same (bf16-valued) inputs but for the one rounding of each result to
    /// bf16, within 2^-8 of the largest. Computed in bf16 throughout, dx was off by about 1%.
    #[test]
    fn bf16_gradients_are_f32_gradients_rounded_once() {
        let device = Device::default().autodiff();
        device.seed(3);
        let d = 768;
        // bf16 values, so that the bf16 run starts from exactly the f32 run's inputs.
        let draw = |shape: [usize; 2], distribution| {
            Tensor::<2>::random(shape, distribution, &device)
                .cast(FloatDType::BF16)
                .cast(FloatDType::F32)
        };
        let x = draw([64, d], Distribution::Normal(0.5, 3.0));
        let r = draw([64, d], Distribution::Normal(0.0, 1.0));
        let gamma = draw([1, d], Distribution::Uniform(0.5, 1.5));
        let beta = draw([1, d], Distribution::Uniform(-0.5, 0.5));
        let run = |dtype: FloatDType| {
            let norm = LayerNorm {
                gamma: Param::from_tensor(gamma.clone().reshape([d]).cast(dtype)),
                beta: Param::from_tensor(beta.clone().reshape([d]).cast(dtype)),
                epsilon: 1e-5,
            };
            let x = x.clone().cast(dtype).require_grad();
            let grads = (norm.forward(x.clone()) * r.clone().cast(dtype))
                .sum()
                .backward();
            let f32s = |t: Tensor<1>| t.cast(FloatDType::F32);
            [
                f32s(x.grad(&grads).expect("dx").flatten(0, 1)),
                f32s(norm.gamma.val().grad(&grads).expect("dgamma")),
                f32s(norm.beta.val().grad(&grads).expect("dbeta")),
            ]
        };
        let want = run(FloatDType::F32);
        let got = run(FloatDType::BF16);
        for (name, (got, want)) in ["dx", "dgamma", "dbeta"]
            .iter()
            .zip(got.into_iter().zip(want))
        {
            let largest = want.clone().abs().max().into_scalar::<f32>();
            let off = (got - want).abs().max().into_scalar::<f32>();
            assert!(
                off <= largest * 2f32.powi(-8),
                "{name}: off by {off}, {} of the largest",
                off / largest
            );
        }
    }
}
