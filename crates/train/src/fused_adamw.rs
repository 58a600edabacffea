//! AdamW in one pass over host memory, as DeepSpeed's CPU Adam steps offloaded parameters.
//! burn-optim's AdamW computes a step as a dozen tensor operations, each a pass over the
//! parameter on one thread of Flex; here each element is updated once, chunks in parallel,
//! with the same f32 operations in the same order, so the result is burn-optim's bit for bit
//! (the equivalence tests train against burn-optim's). The state is burn-optim's
//! [`AdamWState`], so checkpoints and `--offload-dir` files do not change. Tensors elsewhere (a
//! GPU) or in other dtypes take burn-optim's path.

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

/// Elements a task updates: large enough that a task's overhead is amortised, small enough
/// that a layer's parameter spreads over the cores.
pub(crate) const CHUNK: usize = 1 << 15;

#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// burn-optim's, for what is not f32 in host memory.
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

    /// Step `time` (from 1) of `p` with `g`, the moments `m` and `v` updated in place (zeros,
    /// unread, at step 1).
    fn update(
        &self,
        lr: LearningRate,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        time: usize,
    ) {
        let (b1, b2, eps) = (self.beta_1, self.beta_2, self.epsilon);
        let (f1, f2) = (1.0 - b1, 1.0 - b2);
        let (c1, c2) = (1f32 - b1.powi(time as i32), 1f32 - b2.powi(time as i32));
        let decay_rate = lr * self.weight_decay as f64;
        let keep = (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32);
        let lr = lr as f32;
        let first = time == 1;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                // burn-optim's operations, each rounded to f32 as its tensor op rounds; in
                // loops of their own per chunk, which the compiler vectorises.
                let n = p.len();
                let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
                if first {
                    for i in 0..n {
                        m[i] = g[i] * f1;
                        v[i] = (g[i] * g[i]) * f2;
                    }
                } else {
                    for i in 0..n {
                        m[i] = m[i] * b1 + g[i] * f1;
                        v[i] = v[i] * b2 + (g[i] * g[i]) * f2;
                    }
                }
                let delta = |i: usize| (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
                match keep {
                    Some(keep) => (0..n).for_each(|i| p[i] = p[i] * keep - delta(i) * lr),
                    None => (0..n).for_each(|i| p[i] -= delta(i) * lr),
                }
            });
    }
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

/// The values of an f32 tensor's data, read from host memory ([`f32_in_host_memory`]).
pub(crate) fn f32s(data: &TensorData) -> &[f32] {
    data.as_slice::<f32>()
        .expect("f32 host tensors read as f32")
}

/// [`f32s`], to update in place.
pub(crate) fn f32s_mut(data: &mut TensorData) -> &mut [f32] {
    data.as_mut_slice::<f32>()
        .expect("f32 host tensors read as f32")
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
        // Anything else (another device or dtype, shapes that disagree, which burn-optim
        // reports) takes burn-optim's path.
        let fits = |t: &Tensor<D>| f32_in_host_memory(t) && t.shape() == tensor.shape();
        let fused = f32_in_host_memory(&tensor)
            && fits(&grad)
            && state.as_ref().is_none_or(|s| {
                fits(&s.momentum.moment_1)
                    && fits(&s.momentum.moment_2)
                    && s.momentum.max_moment_2.is_none()
            });
        if !fused {
            return self.elsewhere.step(lr, tensor, grad, state);
        }
        let (device, shape) = (tensor.device(), tensor.shape());
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
                let zeros = || TensorData::zeros::<f32, _>(shape.clone());
                (1, zeros(), zeros())
            }
        };
        self.update(
            lr,
            f32s_mut(&mut p),
            f32s(&g),
            f32s_mut(&mut m),
            f32s_mut(&mut v),
            time,
        );
        let tensor = |data| Tensor::<D>::from_data(data, (&device, DType::F32));
        let momentum = AdaptiveMomentumState {
            time,
            moment_1: tensor(m),
            moment_2: tensor(v),
            max_moment_2: None,
        };
        (tensor(p), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Three steps with and without weight decay, on a parameter whose size is not a multiple
    /// of the chunk: every value and moment equals burn-optim's, bit for bit.
    #[test]
    fn steps_as_burn_optim_bit_for_bit() {
        let device = Device::flex();
        for weight_decay in [0.0, 0.1] {
            let fused = FusedAdamW::new(0.9, 0.95, 1e-8, weight_decay);
            let plain = fused.elsewhere.clone();
            let shape = [3, CHUNK / 2 + 7];
            let mut a = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
            let mut b = a.clone();
            let (mut sa, mut sb) = (None, None);
            for step in 1..=3 {
                let grad = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
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
                    let (x, y) = (x.to_data(), y.to_data());
                    let same = x
                        .as_slice::<f32>()
                        .unwrap()
                        .iter()
                        .zip(y.as_slice::<f32>().unwrap())
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{what} differs at step {step} (weight decay {weight_decay})"
                    );
                }
            }
        }
    }
}
