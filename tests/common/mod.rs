//! Helpers the integration tests share. Each test binary uses some of them.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use burn::module::Module;
use burn::prelude::*;
use burnscale::nn::weights::{self, Weight};

/// The memory counters are the process's: a binary's tests that read them take turns.
static MEMORY_TURNS: Mutex<()> = Mutex::new(());

/// Runs `f` in its turn on the memory counters, on a thread of its own: a test's thread-locals
/// (gemm's packing buffer, the cached attention masks) are freed when its thread ends, inside
/// its turn, not while the next test measures (CI saw 0.5 MiB freed so, after a test had given
/// up its turn).
pub fn in_turn<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let _turn = MEMORY_TURNS.lock().unwrap_or_else(|e| e.into_inner());
    std::thread::scope(|s| s.spawn(f).join())
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A parity fixture under `tests/fixtures/<dir>/`: the model's weights, and the `input.*` /
/// `output.*` tensors by name.
pub fn fixture(dir: &str, name: &str) -> (Vec<Weight>, HashMap<String, Weight>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir)
        .join(name);
    let (io, weights): (Vec<Weight>, Vec<Weight>) = weights::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .partition(|w| w.key.starts_with("input.") || w.key.starts_with("output."));
    (
        weights,
        io.into_iter().map(|w| (w.key.clone(), w)).collect(),
    )
}

/// The larger of `m` and `d`, NaN where either is: `f32::max` drops a NaN, and a test that
/// compares NaN results through it would pass.
pub fn nan_max(m: f32, d: f32) -> f32 {
    match m.is_nan() || d.is_nan() {
        true => f32::NAN,
        false => m.max(d),
    }
}

/// Max |a - b| over two equally long slices; NaN where any element is.
pub fn worst_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "the values compared differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, nan_max)
}

/// Max |a - b| over two equally long tensors; NaN where any element is.
pub fn max_abs_diff<const D: usize>(ours: Tensor<D>, reference: &Weight) -> f32 {
    let ours: Vec<f32> = ours.into_data().try_into_vec_as().unwrap();
    assert_eq!(ours.len(), reference.values.len(), "{}", reference.key);
    worst_abs_diff(&ours, &reference.values)
}

#[allow(unused_imports)]
pub use burnscale::equivalence::{hold_generator, seeded_model};

/// Runs [`burnscale::equivalence::check`] of `strategy` on `world` thread ranks with
/// `flags`; panics with every rank's differences from the plain reference.
pub fn assert_matches_plain(strategy: &str, world: usize, flags: &[&str]) {
    assert_check_agrees(burnscale::equivalence::check, strategy, world, flags);
}

/// Runs `check` (one of [`burnscale::equivalence`]'s) of `strategy` on `world` thread ranks
/// with `flags`; panics with every rank's differences from the plain reference.
pub fn assert_check_agrees(
    check: fn(
        &dyn burnscale::collective::Communicator,
        &str,
        &[&str],
    ) -> Result<burnscale::equivalence::Comparison, burnscale::train::TrainError>,
    strategy: &str,
    world: usize,
    flags: &[&str],
) {
    use burnscale::collective::{run_ranks, threads::DEFAULT_TIMEOUT};
    let ranks = run_ranks(world, DEFAULT_TIMEOUT, |comm| check(comm, strategy, flags)).unwrap();
    for (rank, outcome) in ranks.into_iter().enumerate() {
        let found = outcome.unwrap().unwrap();
        if rank == 0 {
            eprintln!(
                "{strategy} x{world} {flags:?}: used {:.1e} of the tolerance",
                found.worst
            );
        }
        assert!(
            found.agrees(),
            "{strategy} x{world} {flags:?} rank {rank}:\n{}",
            found.differences[..found.differences.len().min(12)].join("\n")
        );
    }
}

/// [`assert_matches_plain`] for single, and for ddp, zero1, zero2 and zero3 on each of
/// `worlds` thread ranks.
pub fn assert_every_strategy_matches_plain(
    flags: &[&str],
    worlds: std::ops::RangeInclusive<usize>,
) {
    assert_matches_plain("single", 1, flags);
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for world in worlds.clone() {
            assert_matches_plain(strategy, world, flags);
        }
    }
}

/// Panics naming the first parameter where `a` and `b` differ by more than 1e-5 of its
/// largest value (plus a floor for the attention key bias, which stays at float noise), or
/// is NaN; and where they do not hold the same parameters.
pub fn assert_same<M: Module>(a: &M, b: &M, what: &str) {
    let a = weights::collect(a);
    let b = weights::collect(b);
    assert!(a.keys().eq(b.keys()), "{what}: the parameters differ");
    for ((path, x), (_, y)) in a.iter().zip(&b) {
        let scale = x.values.iter().fold(0f32, |m, v| nan_max(m, v.abs()));
        let diff = worst_abs_diff(&x.values, &y.values);
        assert!(
            diff <= 1e-5 * scale + 1e-9,
            "{what} {path}: differs by {diff} (scale {scale})"
        );
    }
}

/// minGPT's next-token task whose validation batches hold no sequence.
#[derive(Clone)]
pub struct EmptyValidation(pub burnscale::tasks::NextToken);

impl burnscale::train::TrainTask for EmptyValidation {
    type Model = burnscale::mingpt::Gpt;
    fn next_batch(
        &mut self,
        device: &Device,
        part: burnscale::train::BatchPart,
    ) -> burnscale::train::Batch<Self::Model> {
        self.0.next_batch(device, part)
    }
    fn items(&self, input: &Tensor<2, Int>) -> usize {
        self.0.items(input)
    }
    fn counts_tokens(&self) -> bool {
        true
    }
    fn eval_batches(&self) -> usize {
        self.0.eval_batches()
    }
    fn eval_batch(&mut self, k: usize, device: &Device) -> burnscale::train::Batch<Self::Model> {
        let (input, target) = self.0.eval_batch(k, device);
        (input.slice(s![0..0]), target.slice(s![0..0]))
    }
    fn score(&self, logits: Tensor<3>, target: Tensor<2, Int>) -> burnscale::train::Score {
        self.0.score(logits, target)
    }
}

/// Each step of a run's history: its number, loss and gradient norm.
pub fn steps(summary: &burnscale::train::RunSummary) -> Vec<(usize, f64, f64)> {
    summary
        .history
        .iter()
        .map(|m| (m.step, m.loss, m.grad_norm))
        .collect()
}

/// `got` takes the steps `want` took (as [`steps`] gives them), at another world size: the
/// same steps, each loss and gradient norm within 1e-5 relative of the uninterrupted run's.
pub fn assert_steps_close(got: &[(usize, f64, f64)], want: &[(usize, f64, f64)]) {
    assert_eq!(got.len(), want.len());
    for ((step, loss, norm), (want_step, want_loss, want_norm)) in got.iter().zip(want) {
        assert_eq!(step, want_step);
        // Each world size sums the batch in its own order: f32 rounding, not more.
        for (what, got, want) in [("loss", loss, want_loss), ("norm", norm, want_norm)] {
            let relative = (got - want).abs() / want.abs();
            assert!(
                relative < 1e-5,
                "step {step}: {what} {got}, uninterrupted {want}"
            );
        }
    }
}
