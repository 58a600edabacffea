//! Linear layers whose backward reads the weight from a copy gathered again for it, as FSDP
//! reads a resharded parameter: ZeRO-3 can then drop a block's gathered weights after its
//! forward and keep its graph, instead of recomputing the block in backward.
//!
//! Burn's own matmul keeps both operands for backward, so a graph through `Linear::forward`
//! holds every gathered weight until backward. Models call [`linear`] instead; outside
//! [`forward`] it is [`gemm::linear`](crate::gemm::linear) (`Linear::forward`, or cuBLAS's
//! product where asked). Inside, the product is one op ([`RegatherOps::regathered_linear`],
//! its products cuBLAS's where [`gemm::linear`](crate::gemm::linear)'s would be), whose
//! backward keeps the input and the weight's id,
//! not the weight: the engine hands the block's weights gathered again to [`backward`], which
//! stages them for that op and returns their gradients (the op delivers them there, not to
//! Burn's `Gradients`, since the forward's weight tensors are gone by then).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::ModuleOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DispatchKindConversion, DispatchTensor};
use burn::module::ParamId;
use burn::nn::Linear;
use burn::prelude::*;

use crate::gemm::{GemmOps, linear_forward, linear_weight_backward, linear_x_backward};

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static READ: RefCell<Vec<ParamId>> = const { RefCell::new(Vec::new()) };
    static STAGED: RefCell<HashMap<ParamId, Tensor<2>>> = RefCell::new(HashMap::new());
    static GRADS: RefCell<HashMap<ParamId, Tensor<2>>> = RefCell::new(HashMap::new());
}

/// `layer` applied to `x` (`[.., d_in]` -> `[.., d_out]`): [`gemm::linear`](crate::gemm::linear)
/// (`Linear::forward`, or cuBLAS's product where asked), its output kept or taken back in
/// [`selective`](crate::selective) checkpointing, or inside [`forward`] the same through
/// [`RegatherOps::regathered_linear`].
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    match ON.with(Cell::get) {
        true => {
            let gemm = crate::gemm::takes(&x, &layer.weight.val());
            regathered_linear(layer, x, gemm)
        }
        false => crate::selective::linear(layer, x),
    }
}

/// [`linear`] inside [`forward`], its products through [`GemmOps`] where `gemm`, else the
/// backend's linear ops.
fn regathered_linear<const D: usize>(layer: &Linear, x: Tensor<D>, gemm: bool) -> Tensor<D> {
    // An untracked input would leave the op untracked and its weight without a gradient.
    assert!(
        x.is_tracked(),
        "a regathered linear needs a tracked input: the engine runs each block on one"
    );
    READ.with(|r| {
        let mut read = r.borrow_mut();
        if !read.contains(&layer.weight.id) {
            read.push(layer.weight.id);
        }
    });
    let weight = layer.weight.val();
    // A frozen weight is read in backward (for the input's gradient) but gets no gradient.
    let weight_grad = weight.is_tracked();
    // Without a bias of its own, a zero one, outside the graph: one op for both cases.
    let bias = match &layer.bias {
        Some(bias) => bias.val(),
        None => Tensor::zeros([weight.dims()[1]], (&weight.device(), weight.dtype())),
    };
    Tensor::from_dispatch(<burn::backend::Dispatch as RegatherOps>::regathered_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        layer.weight.id.val(),
        weight_grad,
        gemm,
    ))
}

/// Runs `f` (a block's forward under autodiff) with [`linear`]'s weights left out of the graph,
/// and returns what it returns with the ids of the weights read, which backward then needs
/// from [`backward`].
pub fn forward<T>(f: impl FnOnce() -> T) -> (T, Vec<ParamId>) {
    struct On(bool);
    impl Drop for On {
        fn drop(&mut self) {
            ON.with(|on| on.set(self.0));
        }
    }
    READ.with(|r| r.borrow_mut().clear());
    let out = {
        let _on = On(ON.with(|on| on.replace(true)));
        f()
    };
    (out, READ.with(|r| std::mem::take(&mut *r.borrow_mut())))
}

/// Runs `f` (a backward through graphs built in [`forward`]) with `weights` (their full values,
/// gathered again) staged for it, dropped when it ends, and returns what `f` returns with the
/// weights' gradients, in the weights' order (`None` where backward did not reach one).
pub fn backward<T>(
    weights: Vec<(ParamId, Tensor<2>)>,
    f: impl FnOnce() -> T,
) -> (T, Vec<(ParamId, Option<Tensor<2>>)>) {
    struct Staged;
    impl Drop for Staged {
        fn drop(&mut self) {
            STAGED.with(|s| s.borrow_mut().clear());
        }
    }
    let ids: Vec<ParamId> = weights.iter().map(|(id, _)| *id).collect();
    let weights = weights.into_iter().map(|(id, w)| (id, w.inner()));
    GRADS.with(|g| g.borrow_mut().clear());
    STAGED.with(|s| s.borrow_mut().extend(weights));
    let out = {
        let _staged = Staged;
        f()
    };
    let grads = GRADS.with(|g| {
        let mut g = g.borrow_mut();
        ids.into_iter().map(|id| (id, g.remove(&id))).collect()
    });
    (out, grads)
}

backend_ops! {
    /// The op behind [`linear`](super::linear) inside [`forward`](super::forward): on a
    /// backend's own tensors its `linear`; under autodiff, a node that keeps `x` and `key` (the
    /// weight's `ParamId`) and in backward reads the weight staged by
    /// [`backward`](super::backward).
    pub trait RegatherOps {
        /// `x @ weight + bias` (`[.., d_in]` x `[d_in, d_out]` + `[d_out]`); under autodiff
        /// (the op's only use: its input is tracked) forward and backward products through
        /// [`GemmOps`] where `gemm`, else the backend's linear ops, and the weight's gradient
        /// only where `weight_grad` (not for a frozen weight).
        fn regathered_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            key: u64,
            weight_grad: bool,
            gemm: bool,
        ) -> FloatTensor<Self> {
            let _ = (key, weight_grad, gemm);
            <Self as ModuleOps<Self>>::linear(x, weight, Some(bias))
        }
    }
}

impl<B, C> RegatherOps for Autodiff<B, C>
where
    B: GemmOps,
    C: CheckpointStrategy,
    DispatchTensor: DispatchKindConversion<B>,
{
    fn regathered_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        key: u64,
        weight_grad: bool,
        gemm: bool,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct RegatheredLinear;

        impl<B: GemmOps> Backward<B, 2> for RegatheredLinear
        where
            DispatchTensor: DispatchKindConversion<B>,
        {
            type State = (FloatTensor<B>, u64, bool, bool);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (x, key, weight_grad, gemm) = ops.state;
                let id = ParamId::from(key);
                let grad = grads.consume::<B>(&ops.node);
                // Read, not taken: a layer may run more than once in a block.
                let weight = STAGED
                    .with(|s| s.borrow().get(&id).cloned())
                    .unwrap_or_else(|| panic!("weight {id} was not staged for its backward"));
                let weight = primitive::<B>(weight);
                if weight_grad {
                    let grad_weight = linear_weight_backward::<B>(x, grad.clone(), gemm);
                    GRADS.with(|g| {
                        let mut g = g.borrow_mut();
                        let sum = match g.remove(&id) {
                            Some(earlier) => B::float_add(primitive::<B>(earlier), grad_weight),
                            None => grad_weight,
                        };
                        g.insert(id, Tensor::from_primitive::<B>(sum));
                    });
                }
                let [x_node, bias_node] = ops.parents;
                if let Some(node) = bias_node {
                    grads.register::<B>(node.id, B::linear_bias_backward(grad.clone()));
                }
                if let Some(node) = x_node {
                    let dx = linear_x_backward::<B>(weight, grad, gemm);
                    grads.register::<B>(node.id, dx);
                }
            }
        }

        let nodes = [x.node(), bias.node()];
        let x = x.into_primitive();
        let (weight, bias) = (weight.into_primitive(), Some(bias.into_primitive()));
        let y = match gemm {
            true => linear_forward::<B>(x.clone(), weight, bias),
            false => B::linear(x.clone(), weight, bias),
        };
        match RegatheredLinear
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x, key, weight_grad, gemm), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

fn primitive<B: Backend>(t: Tensor<2>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    t.try_into_primitive::<B>()
        .unwrap_or_else(|e| panic!("a staged weight on another backend: {e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tolerance};

    fn setup() -> (Linear, Tensor<3>, Tensor<3>) {
        let device = Device::default().autodiff();
        let layer = LinearConfig::new(4, 5).init(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device);
        let r = Tensor::<3>::random([2, 3, 5], Distribution::Default, &device);
        (layer, x, r)
    }

    /// Gradients of `(y * r).sum()` for x, the weight and the bias: Burn's own linear.
    fn reference(layer: &Linear, x: Tensor<3>, r: Tensor<3>) -> [Tensor<1>; 3] {
        let x = x.require_grad();
        let grads = (layer.forward(x.clone()) * r).sum().backward();
        let bias = layer.bias.as_ref().expect("a bias");
        [
            x.grad(&grads).expect("x").flatten(0, 2),
            layer.weight.val().grad(&grads).expect("w").flatten(0, 1),
            bias.val().grad(&grads).expect("b"),
        ]
    }

    /// The same through the regathered op, `staged` handed to backward as the weight, its
    /// products through [`GemmOps`] where `gemm` (cuBLAS's path, here on the CPU).
    fn regathered(
        layer: &Linear,
        x: Tensor<3>,
        r: Tensor<3>,
        staged: Tensor<2>,
        gemm: bool,
    ) -> [Tensor<1>; 3] {
        let x = x.require_grad();
        let (y, read) = forward(|| regathered_linear(layer, x.clone(), gemm));
        assert_eq!(read, vec![layer.weight.id]);
        let (grads, weights) =
            backward(vec![(layer.weight.id, staged)], || (y * r).sum().backward());
        let [(id, grad_weight)] = <[_; 1]>::try_from(weights).expect("one weight");
        assert_eq!(id, layer.weight.id);
        assert!(
            layer.weight.val().grad(&grads).is_none(),
            "the weight's own node has no gradient"
        );
        let bias = layer.bias.as_ref().expect("a bias");
        [
            x.grad(&grads).expect("x").flatten(0, 2),
            grad_weight.expect("w").flatten(0, 1),
            bias.val().grad(&grads).expect("b").inner(),
        ]
    }

    #[test]
    fn equals_burns_linear_in_value_and_every_gradient() {
        let (layer, x, r) = setup();
        let plain = layer.forward(x.clone()).inner();
        let expected = reference(&layer, x.clone(), r.clone());
        let staged = layer.weight.val().inner();
        for gemm in [false, true] {
            let (y, _) = forward(|| regathered_linear(&layer, x.clone().require_grad(), gemm));
            y.inner()
                .into_data()
                .assert_approx_eq::<f32>(&plain.clone().into_data(), Tolerance::default());
            let got = regathered(&layer, x.clone(), r.clone(), staged.clone(), gemm);
            for (got, want) in got.into_iter().zip(expected.clone()) {
                got.inner()
                    .into_data()
                    .assert_approx_eq::<f32>(&want.inner().into_data(), Tolerance::default());
            }
        }
    }

    #[test]
    fn backward_reads_the_weight_it_is_handed_not_the_forwards() {
        let (layer, x, r) = setup();
        let [x_grad, w_grad, _] = reference(&layer, x.clone(), r.clone());
        let doubled = layer.weight.val().inner() * 2.0;
        for gemm in [false, true] {
            let [got_x, got_w, _] = regathered(&layer, x.clone(), r.clone(), doubled.clone(), gemm);
            // dL/dx = g @ w^T doubles with w; dL/dw = x^T @ g does not depend on it.
            got_x.inner().into_data().assert_approx_eq::<f32>(
                &(x_grad.clone().inner() * 2.0).into_data(),
                Tolerance::default(),
            );
            got_w
                .inner()
                .into_data()
                .assert_approx_eq::<f32>(&w_grad.clone().inner().into_data(), Tolerance::default());
        }
    }

    /// A frozen weight is still read for the input's gradient, but gets none of its own.
    #[test]
    fn a_frozen_weight_gets_no_gradient() {
        let (mut layer, x, r) = setup();
        let [x_grad, _, _] = reference(&layer, x.clone(), r.clone());
        layer.weight = layer.weight.set_require_grad(false);
        let x = x.require_grad();
        let (y, read) = forward(|| linear(&layer, x.clone()));
        assert_eq!(
            read,
            vec![layer.weight.id],
            "staged for the input's gradient"
        );
        let staged = vec![(layer.weight.id, layer.weight.val().inner())];
        let (grads, weights) = backward(staged, || (y * r).sum().backward());
        assert!(weights[0].1.is_none(), "a frozen weight's gradient");
        x.grad(&grads)
            .expect("x")
            .flatten::<1>(0, 2)
            .into_data()
            .assert_approx_eq::<f32>(&x_grad.inner().into_data(), Tolerance::default());
    }

    #[test]
    fn a_layer_run_twice_in_a_block_gets_both_uses_gradients() {
        let device = Device::default().autodiff();
        let layer = LinearConfig::new(4, 4).init(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device);
        let twice = |x: Tensor<3>| linear(&layer, linear(&layer, x));
        let grads = twice(x.clone().require_grad()).sum().backward();
        let want = layer.weight.val().grad(&grads).expect("w").inner();
        let x = x.require_grad();
        let (y, read) = forward(|| twice(x.clone()));
        assert_eq!(read, vec![layer.weight.id]);
        let staged = vec![(layer.weight.id, layer.weight.val().inner())];
        let (_, weights) = backward(staged, || y.sum().backward());
        let got = weights[0].1.clone().expect("w");
        got.into_data()
            .assert_approx_eq::<f32>(&want.into_data(), Tolerance::default());
    }

    #[test]
    fn outside_forward_it_is_burns_linear() {
        let (layer, x, _) = setup();
        let (_, read) = forward(|| ());
        assert!(read.is_empty());
        linear(&layer, x.clone())
            .inner()
            .into_data()
            .assert_approx_eq::<f32>(&layer.forward(x).inner().into_data(), Tolerance::default());
    }
}
