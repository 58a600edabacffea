//! The models' linear layers as one matrix-product op, [`GemmOps::gemm`]: `op(a) @ op(b)` for
//! 2-D `a` and `b`, each optionally transposed, with a backward made of the same op.
//!
//! On cubecl's backend on a CUDA device (the `cublas` feature, which the `cuda` build sets) the
//! op runs cuBLAS's GEMM (`cublas.rs`): cubecl 0.11's bf16 matmuls reach about a quarter of
//! cuBLAS's rate on an H100 (README, Measured on a GPU), and they were 42% of a ViT-L/16 step.
//! Everywhere else it is Burn's `matmul`. [`linear`] goes through it when [`use_cublas`] says so
//! (`--matmul cublas`) on a CUDA device, and is `Linear::forward` itself otherwise: models on
//! the CPU backends compute exactly what they did.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Shape, TensorMetadata};
use burn::nn::Linear;
use burn::prelude::*;

static CUBLAS: AtomicBool = AtomicBool::new(false);

/// Whether [`linear`] on a CUDA device runs cuBLAS (`--matmul cublas`) or cubecl's matmul (the
/// default until a step is measured faster with cuBLAS's). Process-wide.
pub fn use_cublas(on: bool) {
    CUBLAS.store(on, Ordering::Relaxed);
}

/// Whether this build can run cuBLAS's GEMM (the `cublas` feature).
pub const HAS_CUBLAS: bool = cfg!(feature = "cublas");

/// Whether this machine has cuBLAS's library, which a `cublas` build opens at its first
/// product (and panics without).
pub fn cublas_library_found() -> bool {
    #[cfg(feature = "cublas")]
    {
        // Opened once: each `auto` candidate's validation asks.
        static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // SAFETY: it only tries to open the library by its candidate names.
        *FOUND.get_or_init(|| unsafe { cudarc::cublas::sys::is_culib_present() })
    }
    #[cfg(not(feature = "cublas"))]
    false
}

/// `layer` applied to `x` (`[.., d_in]` -> `[.., d_out]`): where [`takes`] says so, one
/// [`gemm`] of its rows ([`linear_forward`]); elsewhere `Linear::forward`.
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let weight = layer.weight.val(); // [d_in, d_out]
    if !takes(&x, &weight) {
        return layer.forward(x);
    }
    Tensor::from_dispatch(linear_forward::<burn::backend::Dispatch>(
        x.into_dispatch(),
        weight.into_dispatch(),
        layer.bias.as_ref().map(|bias| bias.val().into_dispatch()),
    ))
}

/// Whether a linear layer of `weight` runs on `x` through [`gemm`]: cuBLAS's products are
/// asked for and `x` is on a CUDA device, in the weight's dtype (cuBLAS's product takes one).
pub fn takes<const D: usize>(x: &Tensor<D>, weight: &Tensor<2>) -> bool {
    on_cublas(&x.device()) && x.dtype() == weight.dtype()
}

/// `x @ weight + bias` with `x`'s rows folded into one `[rows, d_in] @ [d_in, d_out]` [`gemm`].
pub fn linear_forward<B: GemmOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let d_out = weight.shape()[1];
    let out = with_last(x.shape(), d_out);
    let y = B::gemm(rows::<B>(x), weight, false, false); // [rows, d_out]
    let y = match bias {
        Some(bias) => B::float_add(y, B::float_reshape(bias, Shape::new([1, d_out]))),
        None => y,
    };
    B::float_reshape(y, out)
}

/// A linear layer's gradient for `x`: `dy @ weight^T`, in `dy`'s shape but its last axis;
/// through [`GemmOps::gemm`] where `gemm` (as [`linear_forward`]), else the backend's linear op.
pub fn linear_x_backward<B: GemmOps>(
    weight: FloatTensor<B>,
    dy: FloatTensor<B>,
    gemm: bool,
) -> FloatTensor<B> {
    if !gemm {
        return B::linear_x_backward(weight, dy);
    }
    let d_in = weight.shape()[0];
    let out = with_last(dy.shape(), d_in);
    B::float_reshape(B::gemm(rows::<B>(dy), weight, false, true), out)
}

/// A linear layer's gradient for the weight: `x^T @ dy` over every row; through
/// [`GemmOps::gemm`] where `gemm`, else the backend's linear op.
pub fn linear_weight_backward<B: GemmOps>(
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
    gemm: bool,
) -> FloatTensor<B> {
    match gemm {
        true => B::gemm(rows::<B>(x), rows::<B>(dy), true, false),
        false => B::linear_weight_backward(x, dy),
    }
}

/// `t` (`[.., d]`) as `[rows, d]`.
fn rows<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let shape = t.shape();
    let d = shape[shape.num_dims() - 1];
    B::float_reshape(t, Shape::new([shape.num_elements() / d, d]))
}

/// `shape` with its last axis `d`.
fn with_last(mut shape: Shape, d: usize) -> Shape {
    let last = shape.num_dims() - 1;
    shape[last] = d;
    shape
}

/// Whether [`linear`] on `device` goes through cuBLAS.
pub fn on_cublas(device: &Device) -> bool {
    #[cfg(feature = "cublas")]
    {
        use burn::backend::DispatchDevice;
        CUBLAS.load(Ordering::Relaxed)
            && matches!(
                device.clone().without_autodiff().as_dispatch(),
                DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_))
            )
    }
    #[cfg(not(feature = "cublas"))]
    {
        let _ = device;
        false
    }
}

/// `op(a) @ op(b)`, `op` transposing where asked: `[m, k]` x `[k, n]` -> `[m, n]`; cuBLAS's
/// on a CUDA device in a `cublas` build (whatever [`use_cublas`] says: that switch is
/// [`linear`]'s), Burn's matmul elsewhere.
pub fn gemm(a: Tensor<2>, b: Tensor<2>, trans_a: bool, trans_b: bool) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as GemmOps>::gemm(
        a.into_dispatch(),
        b.into_dispatch(),
        trans_a,
        trans_b,
    ))
}

/// The shape of `op(a) @ op(b)`, for the Fusion op.
#[cfg(feature = "cube")]
fn product_shape(a: &Shape, b: &Shape, trans_a: &bool, trans_b: &bool) -> Shape {
    let m = if *trans_a { a[1] } else { a[0] };
    let n = if *trans_b { b[0] } else { b[1] };
    Shape::new([m, n])
}

/// Burn's matmul of `op(a)` and `op(b)`: the op everywhere but cuBLAS.
fn matmul<B: Backend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    trans_a: bool,
    trans_b: bool,
) -> FloatTensor<B> {
    let op = |t, transpose| match transpose {
        true => B::float_transpose(t),
        false => t,
    };
    B::float_matmul(op(a, trans_a), op(b, trans_b))
}

backend_ops! {
    lazy
    /// The op behind [`gemm`](super::gemm): Burn's matmul, cuBLAS on cubecl's CUDA devices;
    /// under autodiff a node whose two gradients are the same op on the other operand.
    pub trait GemmOps {
        /// `a`: `[m, k]` (`[k, m]` when `trans_a`), `b`: `[k, n]` (`[n, k]` when `trans_b`).
        #[fusion(dtype = a, shape = product_shape(a, b, trans_a, trans_b))]
        fn gemm(
            a: FloatTensor<Self>,
            b: FloatTensor<Self>,
            trans_a: bool,
            trans_b: bool,
        ) -> FloatTensor<Self> {
            matmul::<Self>(a, b, trans_a, trans_b)
        }
    }
}

#[cfg(feature = "cube")]
impl GemmOps for burn_cubecl::CubeBackend {
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cublas")]
        if let burn_cubecl::CubeDevice::Cuda(device) = &a.device {
            return crate::cublas::gemm(device.index, a, b, trans_a, trans_b);
        }
        matmul::<Self>(a, b, trans_a, trans_b)
    }
}

impl<B: GemmOps, C: CheckpointStrategy> GemmOps for Autodiff<B, C> {
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GemmBackward;

        // With C = op(a) op(b): d op(a) = dC op(b)^T and d op(b) = op(a)^T dC, each written
        // back in its operand's own layout.
        impl<B: GemmOps> Backward<B, 2> for GemmBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, bool, bool);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (a, b, trans_a, trans_b) = ops.state;
                let dc = grads.consume::<B>(&ops.node);
                let [a_node, b_node] = ops.parents;
                if let Some(node) = a_node {
                    let da = match trans_a {
                        true => B::gemm(b.clone(), dc.clone(), trans_b, true),
                        false => B::gemm(dc.clone(), b.clone(), false, !trans_b),
                    };
                    grads.register::<B>(node.id, da);
                }
                if let Some(node) = b_node {
                    let db = match trans_b {
                        true => B::gemm(dc, a, true, trans_a),
                        false => B::gemm(a, dc, !trans_a, false),
                    };
                    grads.register::<B>(node.id, db);
                }
            }
        }

        let nodes = [a.node(), b.node()];
        let (a, b) = (a.into_primitive(), b.into_primitive());
        let c = B::gemm(a.clone(), b.clone(), trans_a, trans_b);
        match GemmBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((a, b, trans_a, trans_b), c),
            OpsKind::UnTracked(prep) => prep.finish(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    /// Every (trans_a, trans_b) pair.
    const TRANSPOSES: [(bool, bool); 4] =
        [(false, false), (true, false), (false, true), (true, true)];

    /// The stored shapes of `op(a)`'s `[m, k]` and `op(b)`'s `[k, n]` operands.
    fn operand_dims(
        (m, k, n): (usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
    ) -> [[usize; 2]; 2] {
        [
            if trans_a { [k, m] } else { [m, k] },
            if trans_b { [n, k] } else { [k, n] },
        ]
    }

    /// Every transpose pair: the value and both gradients of `(op(a) op(b) * r).sum()` equal
    /// Burn's `matmul` of the transposed operands under Burn's own autodiff.
    #[test]
    fn equals_burns_matmul_in_value_and_both_gradients() {
        let device = Device::flex().autodiff();
        let (m, k, n) = (3, 5, 4);
        let r = Tensor::<2>::random([m, n], Distribution::Default, &device);
        for (trans_a, trans_b) in TRANSPOSES {
            let [a_dims, b_dims] = operand_dims((m, k, n), (trans_a, trans_b));
            let a = Tensor::<2>::random(a_dims, Distribution::Normal(0.0, 1.0), &device);
            let b = Tensor::<2>::random(b_dims, Distribution::Normal(0.0, 1.0), &device);
            let run = |f: &dyn Fn(Tensor<2>, Tensor<2>) -> Tensor<2>| {
                let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
                let c = f(a.clone(), b.clone());
                let grads = (c.clone() * r.clone()).sum().backward();
                let grad = |t: &Tensor<2>| t.grad(&grads).expect("a gradient");
                (c.inner(), grad(&a), grad(&b))
            };
            let op = |t: Tensor<2>, on| if on { t.transpose() } else { t };
            let ours = run(&|a, b| gemm(a, b, trans_a, trans_b));
            let burns = run(&|a, b| op(a, trans_a).matmul(op(b, trans_b)));
            // k = 5 products of N(0, 1) terms a sum: f32's order differences stay under 1e-6.
            for (got, want) in [(ours.0, burns.0), (ours.1, burns.1), (ours.2, burns.2)] {
                got.into_data()
                    .assert_approx_eq::<f32>(&want.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
            }
        }
    }

    /// The linear layer [`linear`] runs through the op (on a CUDA device, here on the CPU):
    /// Burn's `Linear::forward` in value and in the gradients of x, the weight and the bias.
    #[test]
    fn a_linear_layer_through_the_op_equals_burns() {
        let device = Device::flex().autodiff();
        let layer = burn::nn::LinearConfig::new(4, 5).init(&device);
        let x = Tensor::<3>::random([2, 3, 4], Distribution::Default, &device);
        let r = Tensor::<3>::random([2, 3, 5], Distribution::Default, &device);
        let run = |f: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let x = x.clone().require_grad();
            let y = f(x.clone());
            let grads = (y.clone() * r.clone()).sum().backward();
            let bias = layer.bias.as_ref().expect("a bias").val();
            [
                y.inner().flatten::<1>(0, 2),
                x.grad(&grads).expect("x").flatten(0, 2),
                layer.weight.val().grad(&grads).expect("w").flatten(0, 1),
                bias.grad(&grads).expect("b"),
            ]
        };
        let ours = run(&|x| {
            Tensor::from_dispatch(linear_forward::<burn::backend::Dispatch>(
                x.into_dispatch(),
                layer.weight.val().into_dispatch(),
                layer.bias.as_ref().map(|b| b.val().into_dispatch()),
            ))
        });
        for (got, want) in ours.into_iter().zip(run(&|x| layer.forward(x))) {
            got.into_data()
                .assert_approx_eq::<f32>(&want.into_data(), Tolerance::rel_abs(1e-5, 1e-6));
        }
    }

    /// cuBLAS on GPU 0 (a `cuda` build on a machine with one; skipped, saying so, without):
    /// for every transpose pair and f32, bf16 and f16, the value and both gradients of
    /// `(op(a) op(b) * r).sum()` equal Burn's f32 matmul on the CPU of the same (16-bit
    /// rounded) operands. Run with `cargo test --release --workspace --features cuda --lib gemm`.
    #[cfg(feature = "cublas")]
    #[test]
    fn cublas_equals_burns_matmul_on_the_cpu() {
        use burn::tensor::FloatDType;
        assert!(
            !Device::enumerate(burn::tensor::DeviceType::Cuda).is_empty(),
            "no GPU: this test checks cuBLAS's products and needs one"
        );
        let (cpu, gpu) = (Device::flex().autodiff(), Device::cuda(0).autodiff());
        // Sides off cuBLAS's tile sizes, k long enough for its split reductions.
        let (m, k, n) = (37, 300, 21);
        let mut failures = Vec::new();
        for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
            // Each 16-bit value rounds once (2^-8, 2^-11); the f32 sums of k terms
            // differ by order only.
            let tolerance = match dtype {
                FloatDType::F32 => Tolerance::rel_abs(1e-4, 1e-4),
                FloatDType::BF16 => Tolerance::rel_abs(2f32.powi(-7), 2f32.powi(-7)),
                _ => Tolerance::rel_abs(2f32.powi(-9), 2f32.powi(-9)),
            };
            for (trans_a, trans_b) in TRANSPOSES {
                let [a_dims, b_dims] = operand_dims((m, k, n), (trans_a, trans_b));
                // Operands and weights rounded to the dtype first, so both sides see the same.
                let data = |dims: [usize; 2]| {
                    Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &cpu)
                        .cast(dtype)
                        .cast(FloatDType::F32)
                        .into_data()
                };
                let (a, b, r) = (data(a_dims), data(b_dims), data([m, n]));
                let run = |device: &Device, dtype: FloatDType| {
                    let on = |data: &burn::tensor::TensorData| {
                        Tensor::<2>::from_data(data.clone(), device).cast(dtype)
                    };
                    let (x, y) = (on(&a).require_grad(), on(&b).require_grad());
                    let c = gemm(x.clone(), y.clone(), trans_a, trans_b);
                    let grads = (c.clone().cast(FloatDType::F32) * on(&r).cast(FloatDType::F32))
                        .sum()
                        .backward();
                    let grad = |t: &Tensor<2>| {
                        t.grad(&grads)
                            .expect("a gradient")
                            .cast(FloatDType::F32)
                            .into_data()
                    };
                    [
                        c.inner().cast(FloatDType::F32).into_data(),
                        grad(&x),
                        grad(&y),
                    ]
                };
                let (got, want) = (run(&gpu, dtype), run(&cpu, FloatDType::F32));
                for ((got, want), name) in got.iter().zip(&want).zip(["value", "da", "db"]) {
                    // Every case checked, each failure named, before the test fails.
                    let check = std::panic::AssertUnwindSafe(|| {
                        got.assert_approx_eq::<f32>(want, tolerance)
                    });
                    if let Err(e) = std::panic::catch_unwind(check) {
                        let message = e.downcast_ref::<String>().map_or("", String::as_str);
                        failures.push(format!(
                            "{dtype:?} trans_a={trans_a} trans_b={trans_b} {name}: {message}"
                        ));
                    }
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// On a GPU: an operand computed on another thread lies in a buffer of that thread's
    /// stream, and its last use is the product here, which then holds it alone; cuBLAS reads a
    /// copy on this thread's stream (`cublas::operand`), and the product equals Burn's on the
    /// CPU, each of several times (a read of the other stream's buffer is a race).
    #[cfg(feature = "cublas")]
    #[test]
    fn cublas_reads_an_operand_made_on_another_thread() {
        assert!(
            !Device::enumerate(burn::tensor::DeviceType::Cuda).is_empty(),
            "no GPU: this test checks cuBLAS's products and needs one"
        );
        let (cpu, gpu) = (Device::flex(), Device::cuda(0));
        let normal = |dims: [usize; 2]| {
            Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &cpu).into_data()
        };
        let (a, b) = (normal([512, 1024]), normal([1024, 256]));
        let want = Tensor::<2>::from_data(a.clone(), &cpu)
            .matmul(Tensor::from_data(b.clone(), &cpu))
            .into_data();
        for _ in 0..8 {
            let (a, on) = (a.clone(), gpu.clone());
            let made = std::thread::spawn(move || Tensor::<2>::from_data(a, &on) * 2.0)
                .join()
                .expect("the other thread made its operand");
            let got = gemm(made, Tensor::from_data(b.clone(), &gpu), false, false) / 2.0;
            got.into_data()
                .assert_approx_eq::<f32>(&want, Tolerance::rel_abs(1e-4, 1e-4));
        }
    }
}
