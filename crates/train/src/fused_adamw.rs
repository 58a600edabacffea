//! AdamW in one pass over host memory, as DeepSpeed's CPU Adam steps offloaded parameters.
//! burn-optim's AdamW computes a step as a dozen tensor operations, each a pass over the
//! parameter on one thread of Flex; here each element is updated once, chunks in parallel,
//! with the same operations in the same order, each rounded to the parameter's dtype as Flex
//! rounds it (f32, or bf16 and f16 for bf16-true and 16-true: computed in f32, the result
//! and every scalar operand rounded to 16 bits), so the result is burn-optim's bit for bit
//! (the equivalence tests train against burn-optim's). The state is burn-optim's
//! [`AdamWState`], in the parameter's dtype, so checkpoints and `--offload-dir` files do not
//! change. On cubecl's devices (a GPU) the step is one kernel (`crate::adamw_kernel`);
//! elsewhere (LibTorch), or in other dtypes, burn-optim's path.

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::prelude::*;
use burn::tensor::{DType, Element, TensorData};
use burnscale_shard::StepGrads;
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements a task updates: large enough that a task's overhead is amortised, small enough
/// that a layer's parameter spreads over the cores.
pub(crate) const CHUNK: usize = 1 << 15;

/// An element type the fused step reads and writes in host memory, computed in f32.
trait HostFloat: Element + Send + Sync {
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
    /// `x` rounded to this type, as an f32: what a Flex op of this dtype gives.
    fn round(x: f32) -> f32 {
        Self::narrow(x).widen()
    }
}

impl HostFloat for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> Self {
        x
    }
}

impl HostFloat for bf16 {
    // bf16 is f32's upper half: widening is a shift, rounding to nearest (ties to even) an
    // add and a shift, as half's conversions compute them, without branches so that the
    // loops vectorise.
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    fn narrow(x: f32) -> Self {
        bf16::from_bits((Self::round(x).to_bits() >> 16) as u16)
    }
    fn round(x: f32) -> f32 {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        let nan = (bits & 0xffff_0000) | 0x0040_0000;
        f32::from_bits(if x.is_nan() { nan } else { rounded })
    }
}

impl HostFloat for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
}

#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// burn-optim's, for what is not f32, bf16 or f16 in host memory.
    elsewhere: AdamW,
}

impl FusedAdamW {
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        let elsewhere = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_epsilon(epsilon)
            .with_weight_decay(weight_decay)
            .build();
        Self {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            elsewhere,
        }
    }

    /// [`Optimizer::step`] with `grad` still to be multiplied by `factor` (`[1]`, f32; `None`:
    /// 1), as [`StepGrads::remove_with_factor`] gives them: AdamW's kernel multiplies each
    /// element as it reads it, in f32; every other path multiplies first
    /// ([`StepGrads::multiply`]).
    pub fn step_scaled<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        factor: Option<Tensor<1>>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, Option<AdamWState<D>>) {
        // Anything else (another device or dtype, shapes that disagree, which burn-optim
        // reports) takes burn-optim's path.
        let (device, dtype) = (tensor.device().without_autodiff(), tensor.dtype());
        let fits = |t: &Tensor<D>| {
            t.device().without_autodiff() == device
                && t.dtype() == dtype
                && t.shape() == tensor.shape()
        };
        let fused = matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
            && fits(&grad)
            && state.as_ref().is_none_or(|s| {
                fits(&s.momentum.moment_1)
                    && fits(&s.momentum.moment_2)
                    && s.momentum.max_moment_2.is_none()
            });
        #[cfg(feature = "cube")]
        if fused
            && crate::adamw_kernel::runs_on(&device)
            && factor.as_ref().is_none_or(|f| {
                f.device().without_autodiff() == device
                    && f.dtype() == DType::F32
                    && f.shape().num_elements() == 1
            })
        {
            return self.step_on_device(lr, tensor, grad, factor, state);
        }
        let grad = StepGrads::multiply(grad, factor.as_ref());
        match dtype {
            _ if !fused || !in_host_memory(&device) => self.elsewhere.step(lr, tensor, grad, state),
            DType::F32 => self.step_in_host::<f32, D>(lr, tensor, grad, state),
            DType::BF16 => self.step_in_host::<bf16, D>(lr, tensor, grad, state),
            _ => self.step_in_host::<f16, D>(lr, tensor, grad, state),
        }
    }

    /// Step `time` (from 1) of `p` with `g`, the moments `m` and `v` updated in place (zeros,
    /// unread, at step 1).
    fn update<T: HostFloat>(
        &self,
        lr: LearningRate,
        p: &mut [T],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
        time: usize,
    ) {
        // burn-optim's operations in its order, each result rounded to `T` (`r`), as are the
        // scalars (Flex rounds a scalar operand to the tensor's dtype): the identity in f32.
        let r = T::round;
        let (b1, b2) = (self.beta_1, self.beta_2);
        let (f1, f2) = (r(1.0 - b1), r(1.0 - b2));
        let (c1, c2) = (
            r(1f32 - b1.powi(time as i32)),
            r(1f32 - b2.powi(time as i32)),
        );
        let (b1, b2, eps) = (r(b1), r(b2), r(self.epsilon));
        // Without decay `p * 1 - u` is `p - u` exactly: one formula for both.
        let keep = r((1.0 - lr * self.weight_decay as f64) as f32);
        let lr = r(lr as f32);
        let first = time == 1;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                // In loops of their own per chunk, which the compiler vectorises.
                let n = p.len();
                let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
                if first {
                    for i in 0..n {
                        let g = g[i].widen();
                        m[i] = T::narrow(g * f1);
                        v[i] = T::narrow(r(g * g) * f2);
                    }
                } else {
                    for i in 0..n {
                        let g = g[i].widen();
                        m[i] = T::narrow(r(m[i].widen() * b1) + r(g * f1));
                        v[i] = T::narrow(r(v[i].widen() * b2) + r(r(g * g) * f2));
                    }
                }
                for i in 0..n {
                    let (mi, vi) = (m[i].widen(), v[i].widen());
                    let delta = r(r(mi / c1) / r(r(r(vi / c2).sqrt()) + eps));
                    p[i] = T::narrow(r(p[i].widen() * keep) - r(delta * lr));
                }
            });
    }

    /// [`Optimizer::step`] on host tensors of `T`, the state (if any) of the same type and shape.
    fn step_in_host<T: HostFloat, const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, Option<AdamWState<D>>) {
        let (device, shape, dtype) = (tensor.device(), tensor.shape(), tensor.dtype());
        // Flex hands over the buffer of a tensor nothing else shares (and copies a shared one),
        // so the update is in place.
        let mut p = tensor.into_data();
        let g = grad.into_data();
        let (time, mut m, mut v) = match state {
            Some(s) => (
                s.momentum.time + 1,
                s.momentum.moment_1.into_data(),
                s.momentum.moment_2.into_data(),
            ),
            None => {
                let zeros = || TensorData::zeros::<T, _>(shape.clone());
                (1, zeros(), zeros())
            }
        };
        self.update::<T>(
            lr,
            host_slice_mut(&mut p),
            host_slice(&g),
            host_slice_mut(&mut m),
            host_slice_mut(&mut v),
            time,
        );
        let tensor = |data| Tensor::<D>::from_data(data, (&device, dtype));
        (tensor(p), Some(adamw_state(time, tensor(m), tensor(v))))
    }

    /// [`FusedAdamW::step_scaled`] by one kernel on a cubecl device ([`crate::adamw_kernel`]).
    #[cfg(feature = "cube")]
    fn step_on_device<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        factor: Option<Tensor<1>>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, Option<AdamWState<D>>) {
        use crate::adamw_kernel::{Hyper, step};
        let (time, moments) = match state {
            Some(s) => (
                s.momentum.time + 1,
                Some((s.momentum.moment_1, s.momentum.moment_2)),
            ),
            None => (1, None),
        };
        let betas = (self.beta_1, self.beta_2, self.epsilon, self.weight_decay);
        let hyper = Hyper::new(betas, lr, time);
        let (tensor, moment_1, moment_2) = step(tensor, grad, factor, moments, hyper);
        (tensor, Some(adamw_state(time, moment_1, moment_2)))
    }
}

/// burn-optim's AdamW state after step `time`.
pub(crate) fn adamw_state<const D: usize>(
    time: usize,
    moment_1: Tensor<D>,
    moment_2: Tensor<D>,
) -> AdamWState<D> {
    AdamWState::new(AdaptiveMomentumState {
        time,
        moment_1,
        moment_2,
        max_moment_2: None,
    })
}

/// Whether `device` is host memory (Flex), where the host-memory steps run (this one, 8-bit
/// AdamW's and Adafactor's).
pub(crate) fn in_host_memory(device: &Device) -> bool {
    device.clone().without_autodiff() == Device::flex()
}

/// Whether `tensor` is f32 in host memory, where the host-memory steps take it.
pub(crate) fn f32_in_host_memory<const D: usize>(tensor: &Tensor<D>) -> bool {
    tensor.dtype() == DType::F32 && in_host_memory(&tensor.device())
}

/// The values of a host tensor's data of element type `E` (its dtype, checked before).
fn host_slice<E: Element>(data: &TensorData) -> &[E] {
    data.as_slice::<E>()
        .expect("host tensors read as their dtype")
}

/// [`host_slice`], to update in place.
fn host_slice_mut<E: Element>(data: &mut TensorData) -> &mut [E] {
    data.as_mut_slice::<E>()
        .expect("host tensors read as their dtype")
}

/// The values of an f32 tensor's data, read from host memory ([`f32_in_host_memory`]).
pub(crate) fn f32s(data: &TensorData) -> &[f32] {
    host_slice(data)
}

/// [`f32s`], to update in place.
pub(crate) fn f32s_mut(data: &mut TensorData) -> &mut [f32] {
    host_slice_mut(data)
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        self.step_scaled(lr, tensor, grad, None, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Whether `x` and `y` hold the same values bit for bit (any NaN equal to any NaN: f16's
    /// epsilon, 1e-8, rounds to 0, so a zero second moment divides by zero there).
    fn same_bits(x: &Tensor<2>, y: &Tensor<2>) -> bool {
        assert_eq!(x.dtype(), y.dtype());
        let wide = |t: &Tensor<2>| t.clone().cast(DType::F32).into_data();
        let (x, y) = (wide(x), wide(y));
        let (x, y) = (f32s(&x), f32s(&y));
        x.len() == y.len()
            && x.iter()
                .zip(y)
                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
    }

    /// Three steps in f32, bf16 and f16, with and without weight decay, and with an epsilon a
    /// step reads (1e-2 of gradients of 1), on a parameter whose size is not a multiple of the
    /// chunk: every value and moment equals burn-optim's, bit for bit.
    #[test]
    fn steps_as_burn_optim_bit_for_bit() {
        let device = Device::flex();
        let normal = |shape: [usize; 2], dtype| {
            Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device).cast(dtype)
        };
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (weight_decay, epsilon) in [(0.0, 1e-8), (0.1, 1e-8), (0.1, 1e-2)] {
                let fused = FusedAdamW::new(0.9, 0.95, epsilon, weight_decay);
                let plain = fused.elsewhere.clone();
                let shape = [3, CHUNK / 2 + 7];
                let mut a = normal(shape, dtype);
                let mut b = a.clone();
                let (mut sa, mut sb) = (None, None);
                for step in 1..=3 {
                    let grad = normal(shape, dtype);
                    let lr = 1e-3 * step as f64;
                    (a, sa) = fused.step(lr, a, grad.clone(), sa);
                    (b, sb) = plain.step(lr, b, grad, sb);
                    let (ma, mb) = (
                        &sa.as_ref().unwrap().momentum,
                        &sb.as_ref().unwrap().momentum,
                    );
                    assert_eq!(ma.time, mb.time);
                    for (x, y, what) in [
                        (&a, &b, "parameter"),
                        (&ma.moment_1, &mb.moment_1, "first moment"),
                        (&ma.moment_2, &mb.moment_2, "second moment"),
                    ] {
                        assert!(
                            same_bits(x, y),
                            "{dtype:?} {what} differs at step {step} (weight decay {weight_decay}, epsilon {epsilon})"
                        );
                    }
                }
            }
        }
    }
}
