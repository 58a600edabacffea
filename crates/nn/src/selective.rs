//! Selective activation checkpointing by op (PyTorch's `create_selective_checkpoint_contexts`
//! with every linear's product on its save list; torchtitan's `op` mode saves every second
//! one and attention's outputs): a
//! checkpointed block's forward keeps its linear layers' outputs beside its input, and the
//! backward's re-run of the block takes each from there instead of computing its product
//! again. Norms, activations, attention and dropout (its masks rewound) are recomputed.
//!
//! Under [`record`] every [`linear`](crate::regather::linear) of the models keeps a handle to
//! its output, in the order the layers ran. Under [`replay`] each takes the next kept output
//! and makes it a node of the graph whose backward is the linear's
//! ([`ReplayOps::replayed_linear`]): it keeps what Burn's linear keeps, the input where the
//! weight takes a gradient and the weight where the input does.
//! So a block's linears run forward once, as without checkpointing (full checkpointing runs
//! them twice), and the block keeps about half its graph instead of its input alone (minGPT:
//! 9 of the ~17 widths per token a block's graph keeps, the products' outputs
//! `3d + d + 4d + d`).

use std::cell::RefCell;
use std::collections::VecDeque;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::module::ParamId;
use burn::nn::Linear;
use burn::prelude::*;

use crate::gemm::{GemmOps, linear_weight_backward, linear_x_backward};

thread_local! {
    static TAPE: RefCell<Tape> = const { RefCell::new(Tape::Off) };
}

/// What this thread's linears do with their outputs.
enum Tape {
    Off,
    /// Keep them, in order ([`record`]).
    Record(Vec<Output>),
    /// Take them back, in order ([`replay`]).
    Replay(VecDeque<Output>),
}

/// A linear's output (`[rows, d_out]`, outside autodiff) and the id of its layer's weight.
type Output = (ParamId, Tensor<2>);

/// The outputs a block's linears made under [`record`], for its [`replay`].
#[derive(Debug)]
pub struct Kept(Vec<Output>);

/// Puts `tape` in place for the time of `f` and returns `f`'s result with the tape as `f`
/// left it; the earlier tape is put back however `f` ends.
fn with_tape<T>(tape: Tape, f: impl FnOnce() -> T) -> (T, Tape) {
    struct Restore(Option<Tape>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(earlier) = self.0.take() {
                TAPE.with(|t| *t.borrow_mut() = earlier);
            }
        }
    }
    let mut restore = Restore(Some(TAPE.with(|t| t.replace(tape))));
    let out = f();
    let left = TAPE.with(|t| t.replace(restore.0.take().expect("the earlier tape")));
    (out, left)
}

/// Runs `f` (a block's forward outside autodiff) keeping its linears' outputs.
pub fn record<T>(f: impl FnOnce() -> T) -> (T, Kept) {
    match with_tape(Tape::Record(Vec::new()), f) {
        (out, Tape::Record(kept)) => (out, Kept(kept)),
        _ => unreachable!("the tape stays a recording while recorded into"),
    }
}

/// Runs `f` (the same block's forward again, under autodiff) with its linears' outputs taken
/// from `kept`. Panics when `f` runs other linears than the recorded forward did: the block
/// must take the same path (the same dropout stream, the same inputs' shapes) both times.
pub fn replay<T>(kept: Kept, f: impl FnOnce() -> T) -> T {
    let recorded = kept.0.len();
    match with_tape(Tape::Replay(kept.0.into()), f) {
        (out, Tape::Replay(left)) if left.is_empty() => out,
        (_, Tape::Replay(left)) => panic!(
            "a replayed block ran {} of the {recorded} linears its forward ran",
            recorded - left.len()
        ),
        _ => unreachable!("the tape stays a replay while replayed from"),
    }
}

/// `layer` applied to `x` through [`crate::gemm::linear`]; under [`record`] its output kept,
/// under [`replay`] the output kept for it.
pub(crate) fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let replayed = TAPE.with(|t| match &mut *t.borrow_mut() {
        Tape::Replay(kept) => Some(
            kept.pop_front()
                .expect("a replayed block ran more linears than its forward"),
        ),
        _ => None,
    });
    if let Some((id, y)) = replayed {
        assert_eq!(
            id, layer.weight.id,
            "a replayed block ran its linears in another order than its forward"
        );
        return replayed_linear(layer, x, y);
    }
    let y = crate::gemm::linear(layer, x);
    TAPE.with(|t| {
        if let Tape::Record(kept) = &mut *t.borrow_mut() {
            let d_out = y.dims()[D - 1];
            let rows = y.shape().num_elements() / d_out;
            kept.push((layer.weight.id, y.clone().reshape([rows, d_out])));
        }
    });
    y
}

/// `y` (`[rows, d_out]`, outside autodiff), which `layer` made of `x` before, as `layer(x)`:
/// on an autodiff device a node whose backward is the linear's.
fn replayed_linear<const D: usize>(layer: &Linear, x: Tensor<D>, y: Tensor<2>) -> Tensor<D> {
    let weight = layer.weight.val(); // [d_in, d_out]
    let mut shape = x.shape();
    let d_out = weight.dims()[1];
    shape[D - 1] = d_out;
    assert_eq!(
        y.dims(),
        [shape.num_elements() / d_out, d_out],
        "a replayed linear's kept output does not fit its layer ({:?} -> {d_out}) and input {:?}",
        weight.dims(),
        x.dims()
    );
    let device = x.device();
    let y = y.reshape(shape);
    if !device.is_autodiff() {
        return y;
    }
    let gemm = crate::gemm::takes(&x, &weight);
    // Without a bias of its own, a zero one, outside the graph: one op for both cases.
    let bias = match &layer.bias {
        Some(bias) => bias.val(),
        None => Tensor::zeros([weight.dims()[1]], (&weight.device(), weight.dtype())),
    };
    Tensor::from_dispatch(<burn::backend::Dispatch as ReplayOps>::replayed_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        crate::autodiff_on(y, &device).into_dispatch(),
        gemm,
    ))
}

backend_ops! {
    /// The op behind a linear under [`replay`](super::replay): on a backend's own tensors the
    /// kept output itself; under autodiff a node over the linear's input, weight and bias
    /// whose forward is the kept output and whose backward is the linear's.
    pub trait ReplayOps {
        /// `kept`: `x @ weight + bias` (`[.., d_in]` x `[d_in, d_out]` + `[d_out]`) as the
        /// forward computed it; backward's products through [`GemmOps`] where `gemm`, else
        /// the backend's linear ops.
        fn replayed_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            kept: FloatTensor<Self>,
            gemm: bool,
        ) -> FloatTensor<Self> {
            let _ = (x, weight, bias, gemm);
            kept
        }
    }
}

impl<B: GemmOps, C: CheckpointStrategy> ReplayOps for Autodiff<B, C> {
    fn replayed_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        kept: FloatTensor<Self>,
        gemm: bool,
    ) -> FloatTensor<Self> {
        /// Parents `x`, the weight and the bias.
        #[derive(Debug)]
        struct ReplayedLinear;

        impl<B: GemmOps> Backward<B, 3> for ReplayedLinear {
            /// `x` where the weight takes a gradient, the weight where `x` does, whether the
            /// products go through [`GemmOps`].
            type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>, bool);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (x, weight, gemm) = ops.state;
                let grad = grads.consume::<B>(&ops.node);
                let [x_node, weight_node, bias_node] = ops.parents;
                if let Some(node) = bias_node {
                    grads.register::<B>(node.id, B::linear_bias_backward(grad.clone()));
                }
                if let (Some(node), Some(x)) = (weight_node, x) {
                    let grad_weight = linear_weight_backward::<B>(x, grad.clone(), gemm);
                    grads.register::<B>(node.id, grad_weight);
                }
                if let (Some(node), Some(weight)) = (x_node, weight) {
                    let dx = linear_x_backward::<B>(weight, grad, gemm);
                    grads.register::<B>(node.id, dx);
                }
            }
        }

        let nodes = [x.node(), weight.node(), bias.node()];
        // Each operand is read only for the other's gradient, as Burn's linear keeps them.
        let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
        let state = (
            weight_tracked.then(|| x.into_primitive()),
            x_tracked.then(|| weight.into_primitive()),
            gemm,
        );
        let kept = kept.into_primitive();
        match ReplayedLinear
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, kept),
            OpsKind::UnTracked(prep) => prep.finish(kept),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tolerance};

    use crate::{DropoutConfig, gelu_tanh, regather};

    /// `layer` with its parameters outside autodiff (sharing their values and ids).
    fn detached(layer: &Linear) -> Linear {
        Linear {
            weight: Param::initialized(layer.weight.id, layer.weight.val().inner()),
            bias: (layer.bias.as_ref()).map(|b| Param::initialized(b.id, b.val().inner())),
        }
    }

    /// A block in small: two linears around a GELU and a dropout, and a residual.
    struct Tiny {
        up: Linear,
        down: Linear,
        dropout: crate::Dropout,
    }

    impl Tiny {
        fn new(device: &Device) -> Self {
            Self {
                up: LinearConfig::new(4, 8).init(device),
                down: LinearConfig::new(8, 4).with_bias(false).init(device),
                dropout: DropoutConfig::new(0.25).init(),
            }
        }

        /// The same block with its parameters outside autodiff (sharing their values).
        fn detached(&self) -> Self {
            Self {
                up: detached(&self.up),
                down: detached(&self.down),
                dropout: self.dropout.clone(),
            }
        }

        fn forward(&self, x: Tensor<3>) -> Tensor<3> {
            let h = self
                .dropout
                .forward(gelu_tanh(regather::linear(&self.up, x.clone())));
            x + regather::linear(&self.down, h)
        }
    }

    /// The output and the gradients of x and of every parameter of `(f(x) * r).sum()`.
    fn gradients(
        tiny: &Tiny,
        x: Tensor<3>,
        r: &Tensor<3>,
        f: &dyn Fn(Tensor<3>) -> Tensor<3>,
    ) -> Vec<Tensor<1>> {
        let x = x.require_grad();
        let y = f(x.clone());
        let grads = (y.clone() * r.clone()).sum().backward();
        let up_bias = tiny.up.bias.as_ref().expect("a bias").val();
        vec![
            y.inner().flatten(0, 2),
            x.grad(&grads).expect("x").flatten(0, 2),
            tiny.up.weight.val().grad(&grads).expect("up").flatten(0, 1),
            up_bias.grad(&grads).expect("up's bias"),
            tiny.down
                .weight
                .val()
                .grad(&grads)
                .expect("down")
                .flatten(0, 1),
        ]
    }

    /// A block recorded outside autodiff and replayed under it (the dropout stream rewound
    /// between, as the engine does) has the plain run's output and every gradient.
    #[test]
    fn a_replayed_block_has_the_plain_runs_gradients() {
        let device = Device::flex().autodiff();
        let tiny = Tiny::new(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let r = Tensor::<3>::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        crate::dropout::seed(5);
        let want = gradients(&tiny, x.clone(), &r, &|x| tiny.forward(x));
        crate::dropout::seed(5);
        let (_, kept) = {
            let _training = crate::dropout::training_scope();
            let plain = tiny.detached();
            record(|| plain.forward(x.clone().inner()))
        };
        let dims: Vec<[usize; 2]> = kept.0.iter().map(|(_, y)| y.dims()).collect();
        assert_eq!(
            dims,
            [[6, 8], [6, 4]],
            "each linear's output, its rows folded"
        );
        crate::dropout::seed(5);
        let got = replay(kept, || {
            gradients(&tiny, x.clone(), &r, &|x| tiny.forward(x))
        });
        for (got, want) in got.into_iter().zip(want) {
            got.inner()
                .into_data()
                .assert_approx_eq::<f32>(&want.inner().into_data(), Tolerance::default());
        }
    }

    /// Under [`replay`] a linear's output is the one kept for it, not its product again.
    #[test]
    fn a_replayed_linear_is_what_was_kept() {
        let device = Device::flex().autodiff();
        let layer = LinearConfig::new(4, 5).init(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device).require_grad();
        let kept = Kept(vec![(
            layer.weight.id,
            Tensor::ones([6, 5], &Device::flex()),
        )]);
        let y = replay(kept, || regather::linear(&layer, x));
        y.inner().into_data().assert_eq(
            &Tensor::<3>::ones([2, 3, 5], &Device::flex()).into_data(),
            true,
        );
    }

    #[test]
    #[should_panic(expected = "ran 1 of the 2 linears")]
    fn a_replay_that_leaves_outputs_unread_fails() {
        let device = Device::flex().autodiff();
        let layer = LinearConfig::new(4, 5).init(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device).require_grad();
        let output = (layer.weight.id, Tensor::ones([6, 5], &Device::flex()));
        replay(Kept(vec![output; 2]), || regather::linear(&layer, x));
    }

    /// Two layers of one shape (q's and k's) taken back in another order are an error, not
    /// each other's outputs.
    #[test]
    #[should_panic(expected = "in another order than its forward")]
    fn a_replay_in_another_order_fails() {
        let device = Device::flex().autodiff();
        let [a, b] = [0, 1].map(|_| LinearConfig::new(4, 5).init(&device));
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device).require_grad();
        let output = |layer: &Linear| (layer.weight.id, Tensor::ones([6, 5], &Device::flex()));
        replay(Kept(vec![output(&a), output(&b)]), || {
            regather::linear(&b, x.clone()) + regather::linear(&a, x)
        });
    }

    /// A frozen weight gets no gradient through the re-run's op, and the input still does.
    #[test]
    fn a_replayed_frozen_linear_passes_its_inputs_gradient() {
        let device = Device::flex().autodiff();
        let mut layer = LinearConfig::new(4, 5).init(&device);
        layer.weight = layer.weight.set_require_grad(false);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device);
        let r = Tensor::<3>::random([2, 3, 5], Distribution::Default, &device);
        let grad_x = |f: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let x = x.clone().require_grad();
            let grads = (f(x.clone()) * r.clone()).sum().backward();
            assert!(
                layer.weight.val().grad(&grads).is_none(),
                "a frozen weight's gradient"
            );
            x.grad(&grads).expect("x").into_data()
        };
        let want = grad_x(&|x| layer.forward(x));
        let (_, kept) = record(|| regather::linear(&detached(&layer), x.clone().inner()));
        let got = replay(kept, || grad_x(&|x| regather::linear(&layer, x)));
        got.assert_approx_eq::<f32>(&want, Tolerance::default());
    }
}
