//! The gradients an optimizer step is given, with the factor they are still to be multiplied
//! by (16-mixed's unscaling and global-norm clipping). The optimizer multiplies each one as it
//! steps it, as PyTorch's fused AdamW takes a `grad_scale`: on a fusing backend the multiply
//! joins the update's kernel instead of making a pass of its own over every gradient, and no
//! scaled copy is held beside a reduced bucket.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;

pub struct StepGrads {
    grads: GradientsParams,
    /// `[1]`, f32, on the gradients' device; `None`: 1.
    factor: Option<Tensor<1>>,
}

impl StepGrads {
    pub fn new(grads: GradientsParams, factor: Option<Tensor<1>>) -> Self {
        Self { grads, factor }
    }

    /// The gradient of `id`, multiplied, left in place (for statistics read before a step).
    pub fn get<const D: usize>(&self, id: ParamId) -> Option<Tensor<D>> {
        self.grads
            .get(id)
            .map(|grad| Self::multiply(grad, self.factor.as_ref()))
    }

    /// The gradient of `id`, multiplied, taken out.
    pub fn remove<const D: usize>(&mut self, id: ParamId) -> Option<Tensor<D>> {
        self.grads
            .remove(id)
            .map(|grad| Self::multiply(grad, self.factor.as_ref()))
    }

    /// The gradient of `id` taken out, not yet multiplied, and the factor (`None`: 1) it is
    /// still to be multiplied by, for an optimizer that multiplies as it reads it.
    pub fn remove_with_factor<const D: usize>(
        &mut self,
        id: ParamId,
    ) -> Option<(Tensor<D>, Option<Tensor<1>>)> {
        let grad = self.grads.remove(id)?;
        Some((grad, self.factor.clone()))
    }

    /// Every gradient of `module`'s parameters multiplied, for an optimizer that takes
    /// Burn's `GradientsParams`.
    pub fn into_gradients<M: Module>(self, module: &M) -> GradientsParams {
        struct Multiply {
            grads: StepGrads,
            out: GradientsParams,
        }
        impl ModuleVisitor for Multiply {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(grad) = self.grads.remove::<D>(param.id) {
                    self.out.register(param.id, grad);
                }
            }
        }
        let mut multiply = Multiply {
            grads: self,
            out: GradientsParams::new(),
        };
        module.visit(&mut multiply);
        multiply.out
    }

    /// `grad` times `factor` (`[1]`, f32, on its device; `None`: 1), rounded to the gradient's
    /// dtype as a scalar factor would be (so a clipped bf16 norm may exceed its maximum by a
    /// rounding of the factor, as in PyTorch's `clip_grad_norm_`). AdamW's kernel, which
    /// takes the factor itself, multiplies in f32 instead, as PyTorch's fused AdamW applies
    /// its `grad_scale`.
    pub fn multiply<const D: usize>(grad: Tensor<D>, factor: Option<&Tensor<1>>) -> Tensor<D> {
        match factor {
            Some(factor) => {
                let factor = factor.clone().cast(grad.dtype()).reshape([1; D]);
                grad * factor
            }
            None => grad,
        }
    }
}

impl From<GradientsParams> for StepGrads {
    fn from(grads: GradientsParams) -> Self {
        Self::new(grads, None)
    }
}
