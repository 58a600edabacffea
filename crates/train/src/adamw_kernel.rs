//! AdamW's step of one parameter as one cubecl kernel, for [`FusedAdamW`](crate::fused_adamw)
//! on cubecl's devices (a GPU; cubecl's CPU runtime), as PyTorch's `AdamW(fused=True)` steps
//! on CUDA: the parameter, its gradient and both moments are read once and written once, in
//! place, with every operation in f32 and one rounding to the parameter's dtype at the end.
//! burn-optim's AdamW is a dozen tensor operations that burn-fusion groups into kernels of its
//! own choosing: on an H100 its steps of ViT-L/16's 303M bf16 parameters took 14.5 ms of
//! device time, about ten times what that traffic costs (README, Measured on a GPU). The
//! factor a gradient is still to be multiplied by (unscaling, clipping: `StepGrads`) is read
//! by the kernel too, as PyTorch's fused AdamW takes a `grad_scale`, so that no pass of its own
//! multiplies every gradient first.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, ExtensionType};
use burn::prelude::*;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::prelude::CubeDim;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

pub use kernel::Hyper;
use kernel::{HyperLaunch, adamw_kernel};

/// What a gradient is still to be multiplied by: the extension macro takes enums of tensors,
/// not `Option`s.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub enum Factor<B: Backend> {
    One,
    /// `[1]`, f32, on the gradient's device.
    By(FloatTensor<B>),
}

#[burn::backend::backend_extension(Cube, Fusion)]
pub trait AdamWKernelOps: Backend {
    /// The parameter and its moments after step `first ? 1 : t` with `grad` times `factor`;
    /// all four of one float dtype and shape. At the first step the moments given are not read.
    #[fusion(meta = |param, _grad, _factor, moment_1, moment_2, _hyper, _first| (param.clone(), moment_1.clone(), moment_2.clone()))]
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        #[extension_type] factor: Factor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        hyper: Hyper,
        first: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl AdamWKernelOps for CubeBackend {
    fn adamw_step(
        param: CubeTensor,
        grad: CubeTensor,
        factor: Factor<Self>,
        moment_1: CubeTensor,
        moment_2: CubeTensor,
        hyper: Hyper,
        first: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        // Updated in place, as one run of `num_elems` elements: a buffer something else still
        // reads is copied first, and packed again (on CUDA a copy's rows may be padded,
        // cubecl's pitched layout), as is a strided or padded one.
        let owned = |t: CubeTensor| match (t.is_contiguous(), t.can_mut()) {
            (true, true) => t,
            (true, false) => into_contiguous(t.copy()),
            (false, _) => into_contiguous(t),
        };
        let (param, moment_1, moment_2) = (owned(param), owned(moment_1), owned(moment_2));
        let grad = into_contiguous(grad);
        for t in [&param, &grad, &moment_1, &moment_2] {
            assert!(t.is_contiguous(), "AdamW's kernel reads packed buffers");
        }
        let factor = match factor {
            Factor::One => None,
            Factor::By(factor) => {
                assert_eq!(
                    (factor.dtype, factor.meta.num_elements()),
                    (DType::F32, 1),
                    "AdamW's kernel reads one f32 factor"
                );
                Some(into_contiguous(factor))
            }
        };
        let client = param.client.clone();
        let num_elems = param.meta.num_elements();
        // Packed, the four are one flat run each: vectors of the widest size dividing it.
        let vector_size = client
            .io_optimized_vector_sizes(param.dtype.size())
            .filter(|size| num_elems % size == 0)
            .max()
            .unwrap_or(1);
        let vectors = num_elems / vector_size;
        let cube_dim = CubeDim::new(&client, vectors);
        let cube_count = calculate_cube_count_elemwise(&client, vectors, cube_dim);
        let address = [&param, &grad, &moment_1, &moment_2]
            .iter()
            .map(|t| t.required_address_type())
            .max()
            .unwrap_or_default();
        let dtype = burn::backend::cubecl::dtype_to_storage_type(param.dtype);
        // SAFETY: four packed buffers (asserted above) of `num_elems` elements of `dtype` (one
        // dtype and shape: checked by `FusedAdamW::step`), each vector index below `vectors`.
        unsafe {
            adamw_kernel::launch_unchecked(
                &client,
                cube_count,
                cube_dim,
                address,
                vector_size,
                param.clone().into_buffer_arg(),
                grad.into_buffer_arg(),
                factor.map(|factor| factor.into_buffer_arg()).into(),
                moment_1.clone().into_buffer_arg(),
                moment_2.clone().into_buffer_arg(),
                vectors as u32,
                HyperLaunch::new(
                    hyper.beta_1,
                    hyper.beta_2,
                    hyper.factor_1,
                    hyper.factor_2,
                    hyper.correction_1,
                    hyper.correction_2,
                    hyper.epsilon,
                    hyper.keep,
                    hyper.lr,
                ),
                first,
                dtype,
            );
        }
        (param, moment_1, moment_2)
    }
}

/// The kernel, in cubecl's language (its prelude apart: its `Float` and `Tensor` are not
/// Burn's).
mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// AdamW's scalars for one step, from burn-optim's hyper-parameters; see [`Hyper::new`].
    #[derive(CubeLaunch, CubeType, Clone, Copy, Debug, PartialEq)]
    pub struct Hyper {
        pub beta_1: f32,
        pub beta_2: f32,
        /// `1 - beta_1`, `1 - beta_2`.
        pub factor_1: f32,
        pub factor_2: f32,
        /// The bias corrections `1 - beta^time`.
        pub correction_1: f32,
        pub correction_2: f32,
        pub epsilon: f32,
        /// `1 - lr * weight_decay`: decoupled decay.
        pub keep: f32,
        pub lr: f32,
    }

    /// One vector of `N` elements a unit: `param`, `moment_1` and `moment_2` updated in place, as
    /// burn-optim's AdamW computes them (its operations in its order) from `grad` times
    /// `factor`, in f32.
    #[cube(launch_unchecked, address_type = "dynamic")]
    pub fn adamw_kernel<P: Float, N: Size>(
        param: &mut [Vector<P, N>],
        grad: &[Vector<P, N>],
        factor: ComptimeOption<&[f32]>,
        moment_1: &mut [Vector<P, N>],
        moment_2: &mut [Vector<P, N>],
        vectors: u32,
        hyper: &Hyper,
        #[comptime] first: bool,
        #[define(P)] _dtype: ElemType,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors as usize {
            terminate!();
        }
        let mut g = Vector::<f32, N>::cast_from(grad[i]);
        #[comptime]
        if let ComptimeOption::Some(factor) = factor {
            g *= Vector::new(factor[0]);
        }
        let scaled_1 = g * Vector::new(hyper.factor_1);
        let scaled_2 = g * g * Vector::new(hyper.factor_2);
        let mut m = scaled_1;
        let mut v = scaled_2;
        if !first {
            m = Vector::<f32, N>::cast_from(moment_1[i]) * Vector::new(hyper.beta_1) + scaled_1;
            v = Vector::<f32, N>::cast_from(moment_2[i]) * Vector::new(hyper.beta_2) + scaled_2;
        }
        let corrected_1 = m / Vector::new(hyper.correction_1);
        let corrected_2 = v / Vector::new(hyper.correction_2);
        let delta = corrected_1 / (Vector::sqrt(corrected_2) + Vector::new(hyper.epsilon));
        let p = Vector::<f32, N>::cast_from(param[i]) * Vector::new(hyper.keep)
            - delta * Vector::new(hyper.lr);
        param[i] = Vector::cast_from(p);
        moment_1[i] = Vector::cast_from(m);
        moment_2[i] = Vector::cast_from(v);
    }
}

impl Hyper {
    /// Step `time` (from 1) at learning rate `lr`.
    pub fn new(
        (beta_1, beta_2, epsilon, weight_decay): (f32, f32, f32, f32),
        lr: f64,
        time: usize,
    ) -> Self {
        Self {
            beta_1,
            beta_2,
            factor_1: 1.0 - beta_1,
            factor_2: 1.0 - beta_2,
            correction_1: 1.0 - beta_1.powi(time as i32),
            correction_2: 1.0 - beta_2.powi(time as i32),
            epsilon,
            keep: (1.0 - lr * weight_decay as f64) as f32,
            lr: lr as f32,
        }
    }
}

/// Whether [`step`] runs on `param`'s device: one of cubecl's.
pub fn runs_on(device: &Device) -> bool {
    matches!(
        device.clone().without_autodiff().as_dispatch(),
        burn::backend::DispatchDevice::Cube(_)
    )
}

/// AdamW's step `time` (from 1) of `param` (on a device [`runs_on`] takes) with `grad` times
/// `factor` (`[1]`, f32, on that device; `None`: 1) and the moments (absent at step 1), all of
/// one float dtype and shape: the parameter and moments after it.
pub fn step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    factor: Option<Tensor<1>>,
    moments: Option<(Tensor<D>, Tensor<D>)>,
    hyper: Hyper,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    let first = moments.is_none();
    // At step 1 the moments are written, not read: the kernel is given buffers to fill.
    let (moment_1, moment_2) = moments.unwrap_or_else(|| (param.empty_like(), param.empty_like()));
    let factor = match factor {
        Some(factor) => Factor::By(factor.into_dispatch()),
        None => Factor::One,
    };
    let (p, m, v) = <burn::backend::Dispatch as AdamWKernelOps>::adamw_step(
        param.into_dispatch(),
        grad.into_dispatch(),
        factor,
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        hyper,
        first,
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_adamw::adamw_state;
    use burn::optim::{AdamWConfig, Optimizer};
    use burn::tensor::{Distribution, FloatDType, Tolerance};

    /// The cubecl devices of this build: cubecl's CPU runtime, GPU 0 where there is one.
    fn devices() -> Vec<Device> {
        [cubecl_cpu(), gpu()].into_iter().flatten().collect()
    }

    fn cubecl_cpu() -> Option<Device> {
        #[cfg(feature = "cubecl-cpu")]
        return Some(Device::cpu());
        #[cfg(not(feature = "cubecl-cpu"))]
        None
    }

    fn gpu() -> Option<Device> {
        #[cfg(feature = "cuda")]
        if !Device::enumerate(burn::tensor::DeviceType::Cuda).is_empty() {
            return Some(Device::cuda(0));
        }
        eprintln!("no GPU: AdamW's kernel not checked on a CUDA device");
        None
    }

    /// On every cubecl device of the build, three steps in f32, bf16 and f16, with and without
    /// weight decay, of a parameter whose size is no multiple of a vector (one element a unit)
    /// and of one that is (vectors; on CUDA a copy of either pads its rows): each step's
    /// parameter and moments equal burn-optim's AdamW on Flex, in f32, from the kernel's
    /// previous values, to the rounding of their dtype (the kernel computes in f32 and rounds
    /// once). Steps 1 and 3 multiply the gradient by a factor (unscaling, clipping), in f32.
    /// The parameter is held elsewhere at step 2, so that step updates a copy.
    #[test]
    fn steps_as_burn_optim_to_the_dtypes_rounding() {
        let host = Device::flex();
        // Copies: cubecl's CPU runtime reads out its buffers' own memory, which an in-place
        // step then changes.
        let wide = |t: &Tensor<2>| {
            let data = t.clone().cast(FloatDType::F32).into_data();
            let values = data.try_to_vec::<f32>().expect("f32 values");
            Tensor::<2>::from_data(
                burn::tensor::TensorData::new(values, data.shape().clone()),
                &host,
            )
        };
        let (b1, b2) = (0.9, 0.95);
        let devices = devices();
        assert!(
            !devices.is_empty(),
            "no cubecl device to check AdamW's kernel on: a cuda build without a GPU here (add --features cubecl-cpu, or run it on a GPU)"
        );
        for device in devices {
            for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
                // One rounding of a value of the dtype, against f32 operations in another order.
                let tolerance = match dtype {
                    FloatDType::F32 => Tolerance::rel_abs(1e-5, 1e-7),
                    FloatDType::BF16 => Tolerance::rel_abs(2f32.powi(-8), 2f32.powi(-14)),
                    _ => Tolerance::rel_abs(2f32.powi(-10), 2f32.powi(-16)),
                };
                // An epsilon of 1e-2 is 2% of these gradients' root mean square: a kernel
                // that read another would be off by more than the dtype's rounding.
                for (dims, weight_decay, eps) in [
                    ([3, 37], 0.0, 1e-8),
                    ([3, 37], 0.1, 1e-8),
                    ([4, 64], 0.1, 1e-2),
                ] {
                    let plain = AdamWConfig::new()
                        .with_beta_1(b1)
                        .with_beta_2(b2)
                        .with_epsilon(eps)
                        .with_weight_decay(weight_decay)
                        .build();
                    let normal = |std: f64| {
                        let data = Tensor::<2>::random(dims, Distribution::Normal(0.0, std), &host)
                            .into_data();
                        Tensor::<2>::from_data(data, &device).cast(dtype)
                    };
                    let mut param = normal(1.0);
                    let mut moments: Option<(Tensor<2>, Tensor<2>)> = None;
                    for time in 1..=3 {
                        let grad = normal(0.5);
                        let lr = 1e-2 * time as f64;
                        let factor = (time != 2).then_some(0.3 * time as f32);
                        let before = (wide(&param), wide(&grad) * factor.unwrap_or(1.0));
                        let factor = factor.map(|f| Tensor::<1>::from_floats([f], &device));
                        let state = moments
                            .as_ref()
                            .map(|(m, v)| adamw_state(time - 1, wide(m), wide(v)));
                        let held = (time == 2).then(|| param.clone());
                        let hyper = Hyper::new((b1, b2, eps, weight_decay), lr, time);
                        let (p, m, v) = step(param, grad, factor, moments, hyper);
                        if let Some(held) = held {
                            held.into_data()
                                .assert_eq(&before.0.clone().cast(dtype).into_data(), true);
                        }
                        let (want_p, want_state) = plain.step(lr, before.0, before.1, state);
                        let want = want_state.expect("a state").momentum;
                        for (got, want, what) in [
                            (&p, want_p, "parameter"),
                            (&m, want.moment_1, "first moment"),
                            (&v, want.moment_2, "second moment"),
                        ] {
                            let (got, want) = (wide(got).into_data(), want.into_data());
                            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                got.assert_approx_eq::<f32>(&want, tolerance)
                            }));
                            assert!(
                                ok.is_ok(),
                                "{device:?} {dtype:?} {dims:?}: {what} at step {time} (weight decay {weight_decay}, epsilon {eps})"
                            );
                        }
                        param = p;
                        moments = Some((m, v));
                    }
                }
            }
        }
    }
}
