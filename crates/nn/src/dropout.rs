//! Dropout with a counter-based random stream.
//!
//! Burn's `Dropout` draws from the backend's one random generator, which a recomputed block
//! cannot rewind and thread ranks would share. Here each element's keep/drop is a hash of
//! (call key, element index) ([`crate::counter_random`]), the call key a SplitMix64 hash of
//! (seed, call): reproducible
//! for a given seed and call order on a thread (each thread, so each in-process rank, has
//! its own stream, seeded with [`seed`]), and drawn by tensor ops on the activations' device.

use std::cell::Cell;

use burn::module::{Flag, Param};
use burn::prelude::*;

use crate::counter_random;

thread_local! {
    /// (seed, calls so far) of this thread's dropout stream.
    static STREAM: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// Whether training code runs on a plain device (see [`training_scope`]).
    static TRAINING_WITHOUT_AUTODIFF: Cell<bool> = const { Cell::new(false) };
}

/// Marks code that trains outside autodiff (checkpointed blocks, and ZeRO-3's embeddings when
/// resharded, run forward on the plain device and are recomputed under autodiff in
/// backward): dropout drops there too, as it does in the recomputation. Ends when the guard
/// drops.
pub fn training_scope() -> TrainingScope {
    TrainingScope(TRAINING_WITHOUT_AUTODIFF.with(|t| t.replace(true)))
}

pub struct TrainingScope(bool);

impl Drop for TrainingScope {
    fn drop(&mut self) {
        TRAINING_WITHOUT_AUTODIFF.with(|t| t.set(self.0));
    }
}

/// The next key of this thread's stream, for other training-time randomness (BigBird's
/// random blocks) that a recomputation must redraw identically after [`rewind`].
pub fn next_key() -> u64 {
    next_call_key()
}

/// Restarts this thread's dropout stream from `seed`.
pub fn seed(seed: u64) {
    STREAM.with(|s| s.set((seed, 0)));
}

/// Where this thread's dropout stream stands; [`rewind`] to it to draw the same masks again
/// (a block recomputed in backward must drop what its forward dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPosition(pub u64, pub u64);

pub fn position() -> StreamPosition {
    let (seed, call) = STREAM.with(Cell::get);
    StreamPosition(seed, call)
}

pub fn rewind(to: StreamPosition) {
    STREAM.with(|s| s.set((to.0, to.1)));
}

fn next_call_key() -> u64 {
    STREAM.with(|s| {
        let (seed, call) = s.get();
        s.set((seed, call + 1));
        counter_random::splitmix64(seed ^ counter_random::splitmix64(call))
    })
}

/// Which elements of a tensor of `shape` on `device` drop, each with probability `1 - keep`:
/// its 31-bit hash ([`counter_random::hashed`]) at or above `keep`'s share of its range. Drawn by tensor ops
/// where the activations live, so a GPU draws its own masks and nothing crosses from the host.
fn dropped<const D: usize>(shape: Shape, keep: f64, key: u64, device: &Device) -> Tensor<D, Bool> {
    let threshold = (keep * (1u64 << 31) as f64) as i64;
    counter_random::hashed::<D>(&shape, key, device).greater_equal_elem(threshold)
}

#[derive(Debug, Clone)]
pub struct DropoutConfig {
    pub prob: f64,
}

impl DropoutConfig {
    pub fn new(prob: f64) -> Self {
        Self { prob }
    }

    /// Panics on a probability outside `[0, 1)`: configs validate it before building.
    pub fn init(&self) -> Dropout {
        assert!(
            (0.0..1.0).contains(&self.prob),
            "dropout probability must be in [0, 1), got {}",
            self.prob
        );
        Dropout {
            prob: self.prob,
            training: Param::from_bool(true),
        }
    }
}

/// Zeroes each element with probability `prob` and scales the rest by `1/(1-prob)`, in
/// training on an autodiff device; the identity in eval mode (`model.valid()`).
#[derive(Module, Debug)]
pub struct Dropout {
    pub prob: f64,
    training: Param<Flag>,
}

impl Dropout {
    /// Whether this module trains on `device`: not in eval mode, and on an autodiff device
    /// or inside a [`training_scope`].
    pub fn is_training(&self, device: &Device) -> bool {
        self.training.is_enabled()
            && (device.is_autodiff() || TRAINING_WITHOUT_AUTODIFF.with(Cell::get))
    }

    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        match self.draw::<D>(input.shape(), &input.device()) {
            // A Bool mask: the backward keeps one byte per element, not a float.
            Some((dropped, scale)) => input.mask_fill(dropped, 0.0) * scale,
            None => input,
        }
    }

    /// The elements of a tensor of `shape` on `device` that [`forward`](Self::forward) would
    /// zero, and the factor it scales the rest by; `None` where it is the identity. Draws from
    /// the stream as `forward` does, for ops that apply the mask themselves (attention).
    pub fn draw<const D: usize>(
        &self,
        shape: Shape,
        device: &Device,
    ) -> Option<(Tensor<D, Bool>, f64)> {
        if self.prob == 0.0 || !self.is_training(device) {
            return None;
        }
        let keep = 1.0 - self.prob;
        Some((
            dropped::<D>(shape, keep, next_call_key(), device),
            1.0 / keep,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;

    fn ones(device: &Device) -> Tensor<2> {
        Tensor::ones([256, 512], device)
    }

    fn values(t: Tensor<2>) -> Vec<f32> {
        t.into_data().try_into_vec().unwrap()
    }

    #[test]
    fn drops_the_right_fraction_and_keeps_the_mean() {
        let device = Device::default().autodiff();
        seed(3);
        let out = values(DropoutConfig::new(0.1).init().forward(ones(&device)));
        let dropped = out.iter().filter(|v| **v == 0.0).count() as f64 / out.len() as f64;
        assert!((dropped - 0.1).abs() < 0.005, "dropped {dropped}");
        let mean = out.iter().map(|v| *v as f64).sum::<f64>() / out.len() as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
        assert!(
            out.iter()
                .all(|v| *v == 0.0 || (*v - 1.0 / 0.9).abs() < 1e-6)
        );
    }

    /// Neighbouring elements, rows and calls drop independently: at p = 0.5 each pair of
    /// them is dropped together a quarter of the time.
    #[test]
    fn masks_are_independent_across_elements_and_calls() {
        let device = Device::default().autodiff();
        let dropout = DropoutConfig::new(0.5).init();
        seed(11);
        let a: Vec<bool> = values(dropout.forward(ones(&device)))
            .iter()
            .map(|v| *v == 0.0)
            .collect();
        let b: Vec<bool> = values(dropout.forward(ones(&device)))
            .iter()
            .map(|v| *v == 0.0)
            .collect();
        let both = |pairs: &mut dyn Iterator<Item = (&bool, &bool)>| {
            let (mut n, mut hits) = (0, 0);
            for (x, y) in pairs {
                n += 1;
                hits += (*x && *y) as usize;
            }
            hits as f64 / n as f64
        };
        let next_element = both(&mut a.iter().zip(&a[1..]));
        let next_row = both(&mut a.iter().zip(&a[512..]));
        let next_call = both(&mut a.iter().zip(&b));
        for (what, p) in [
            ("element", next_element),
            ("row", next_row),
            ("call", next_call),
        ] {
            assert!((p - 0.25).abs() < 0.005, "next {what}: both dropped {p}");
        }
    }

    #[test]
    fn fresh_masks_per_call_reproducible_per_seed() {
        let device = Device::default().autodiff();
        let dropout = DropoutConfig::new(0.5).init();
        seed(9);
        let a = values(dropout.forward(ones(&device)));
        let b = values(dropout.forward(ones(&device)));
        assert_ne!(a, b);
        seed(9);
        assert_eq!(a, values(dropout.forward(ones(&device))));
        let at = position();
        let c = values(dropout.forward(ones(&device)));
        rewind(at);
        assert_eq!(c, values(dropout.forward(ones(&device))));
        assert_eq!(b, c);
    }

    #[test]
    fn identity_in_eval_and_without_autodiff() {
        let device = Device::default().autodiff();
        let eval = DropoutConfig::new(0.5).init().valid();
        assert!(
            values(eval.forward(ones(&device)))
                .iter()
                .all(|v| *v == 1.0)
        );
        let plain = DropoutConfig::new(0.5).init();
        let out = values(plain.forward(ones(&Device::default())));
        assert!(out.iter().all(|v| *v == 1.0));
        let scope = training_scope();
        let out = values(plain.forward(ones(&Device::default())));
        assert!(out.contains(&0.0));
        drop(scope);
        let out = values(plain.forward(ones(&Device::default())));
        assert!(out.iter().all(|v| *v == 1.0));
    }
}
