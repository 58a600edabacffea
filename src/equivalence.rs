//! Self-check of the engine against the plain reference ([`crate::reference`]): a strategy
//! on this rank's process group, reading its slice of the same global batch, takes the steps
//! a plain Burn loop takes on one device: the same loss and gradient norm at every step and
//! the same parameters at the end, within a [`Tolerance`]. The tests run it on threads;
//! `examples/shard_check.rs` runs it under mpirun.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use burnscale_collective::{Communicator, DType};
use burnscale_mingpt::{Gpt, GptConfig};
use burnscale_nn::BlockModel;
use burnscale_nn::weights::{self, Weight};
use burnscale_train::freeze::frozen_by;
use burnscale_train::{
    Batch, BatchPart, OptimizerKind, RunSummary, Score, TrainArgs, TrainError, TrainTask,
    eight_bit_paths, train_on,
};

use crate::reference::PlainConfig;
use crate::tasks::NextToken;

/// Samples per optimizer step over all ranks; world sizes 1 to 4 divide it.
pub const GLOBAL_BATCH: usize = 12;
/// Tokens per sample.
const BLOCK: usize = 8;
pub const STEPS: usize = 5;
const SEED: u64 = 11;

/// SGD without momentum or clipping: its update is the gradient times the learning rate, so
/// a gradient of the wrong scale (a sum instead of a mean, a missing `1/accumulate` or
/// unscale) moves every parameter by the wrong amount. A later `--grad-clip` overrides. Its
/// L2 decay on the matrices (torch.optim.SGD's `weight_decay`, added to the gradient after
/// the engine's reduction and clipping) keeps the matrices' update above 16-bit storage's
/// rounding when a clip shrinks the gradient's part.
pub const SGD: &[&str] = &[
    "--optimizer",
    "sgd",
    "--momentum",
    "0",
    "--lr",
    "0.1",
    "--weight-decay",
    "0.1",
    "--grad-clip",
    "0",
];
/// AdamW with weight decay on the matrices, without clipping: blind to a uniform gradient
/// scale (except in the gradient norm), it checks the optimizer state's path through the
/// engine.
pub const ADAMW: &[&str] = &[
    "--optimizer",
    "adamw",
    "--lr",
    "1e-2",
    "--weight-decay",
    "0.1",
    "--grad-clip",
    "0",
];

/// 8-bit AdamW as [`ADAMW`], quantizing every matrix of the tiny model with at least 256
/// elements (the attention and MLP weights; the embeddings keep 32-bit state).
pub const ADAM8BIT: &[&str] = &[
    "--optimizer",
    "adam8bit",
    "--min-8bit-size",
    "256",
    "--lr",
    "1e-2",
    "--weight-decay",
    "0.1",
    "--grad-clip",
    "0",
];

/// An epsilon for [`ADAMW`] and [`ADAM8BIT`] under the 16-bit policies, checked against the
/// f32 loop: above their gradients' rounding. With torch.optim's 1e-8 Adam steps each element
/// by about the learning rate in its gradient's direction however small that gradient is, so
/// an element whose gradient is near zero (tiny-minGPT's `h.1.attn.c_proj.bias`) steps the
/// way bf16's rounding points: 2.7x the bf16 tolerance on one rank, alike under every
/// strategy (measured 2026-11-29; 1e-4: up to 1.5x in f16 and bf16). With 1e-3 an element's
/// step is proportional to a gradient below it, as SGD's, and at most 0.23 of the tolerance
/// is used, for AdamW and 8-bit AdamW under bf16-mixed, bf16-true and 16-mixed, on 1 to 3
/// ranks, with each tensor's most differing element checked apart
/// ([`Tolerance::one_element_apart`]; 0.72 without, 2026-12-02). It also makes Adam see the
/// gradient's scale: a gradient left multiplied by the loss scale steps by its sign again,
/// which the 1e-8 check cannot tell from the right one.
pub const ABOVE_16_BIT_ROUNDING: &[&str] = &["--adam-epsilon", "1e-3"];

/// Adafactor with a relative step (capped at 1e-2, scaled by each parameter's RMS) and
/// weight decay on the matrices, without a first moment or clipping: burnscale's Adafactor
/// on one device is the reference (burn-optim's decays a relative step otherwise than HF's;
/// without decay it is burn-optim's own). A relative step keeps the check well-conditioned: the
/// attention key bias's gradient is float noise, which Adafactor (as AdamW) turns into
/// steps of the full step size in a random direction; scaled by the bias's RMS (at least
/// 1e-3) they stay small, while at a fixed `--lr` they move the model by more than f32
/// rounding between two runs whose noise differs. (`lean_optimizers.rs` checks the fixed
/// step's sharded reductions on identical gradients.)
pub const ADAFACTOR: &[&str] = &[
    "--optimizer",
    "adafactor",
    "--adafactor-relative-step",
    "--lr",
    "1e-2",
    "--weight-decay",
    "0.1",
    "--grad-clip",
    "0",
];

/// ZeRO-3 keeping each unit gathered from its forward to the end of its backward (FSDP2's
/// `reshard_after_forward=False`): each block runs once, under autodiff with its gathered
/// parameters, and backward goes through the graphs forward kept.
pub const KEPT_GATHERED: &[&str] = &["--reshard-after-forward", "false"];

/// The relative difference from the plain run allowed an Adafactor-trained `c_attn.bias`'s
/// query and value elements: their update is divided by an RMS over the whole vector and
/// scaled by another, a third of each the key bias's noise (as the parameters' check says;
/// measured: at most 1.8% under every strategy on 1 to 3 ranks, 2026-12-01). A gradient of
/// the wrong sign moves an element's update by 200%; one such element among the 2d query and
/// value elements moves their L2 difference by 2/sqrt(2d) of the update (35% at the tiny
/// model's d = 16).
pub const ADAFACTOR_ATTENTION_BIAS: f64 = 0.125;

/// What a check found.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// What differs beyond the tolerance, one line each (empty: the runs agree).
    pub differences: Vec<String>,
    /// The largest difference seen as a fraction of what [`Tolerance`] allowed for it (at
    /// most 1 when the runs agree): how much of the margin the run used.
    pub worst: f64,
}

impl Comparison {
    pub fn agrees(&self) -> bool {
        self.differences.is_empty()
    }
}

/// Trains a dropout-free tiny minGPT for [`STEPS`] steps under `strategy` on `comm` (this
/// rank reading `GLOBAL_BATCH / world` samples per micro-step) and the plain reference on
/// this thread with the whole global batch; `flags` (an optimizer, precision, clipping,
/// accumulation, offload, checkpointing) go to both, the reference reading only what it
/// models.
pub fn check(
    comm: &dyn Communicator,
    strategy: &str,
    flags: &[&str],
) -> Result<Comparison, TrainError> {
    check_with_dropout(comm, strategy, 0.0, flags)
}

/// [`check`] with dropout in the model. Only rank 0 of a world of one draws the masks the
/// plain loop draws (every rank has its own stream), so only there is this meaningful.
pub fn check_with_dropout(
    comm: &dyn Communicator,
    strategy: &str,
    dropout: f64,
    flags: &[&str],
) -> Result<Comparison, TrainError> {
    check_on(comm, strategy, dropout, flags, |task| task)
}

/// [`check`] on data whose targets below [`PADDING_BELOW`] are ignored (-1), as padding is:
/// the micro-batches score different numbers of tokens on every rank and micro-step, and
/// the step's loss is the mean over all of them (not the mean of the ranks' means).
pub fn check_padded(
    comm: &dyn Communicator,
    strategy: &str,
    flags: &[&str],
) -> Result<Comparison, TrainError> {
    check_on(comm, strategy, 0.0, flags, Padded)
}

/// [`check_with_dropout`] on the task `data` makes of the checks' next-token data.
fn check_on<T: TrainTask<Model = Gpt>>(
    comm: &dyn Communicator,
    strategy: &str,
    dropout: f64,
    flags: &[&str],
    data: impl Fn(NextToken) -> T,
) -> Result<Comparison, TrainError> {
    let world = comm.world_size();
    if !GLOBAL_BATCH.is_multiple_of(world) {
        return Err(TrainError::InvalidArgs(format!(
            "the check splits a global batch of {GLOBAL_BATCH}, which {world} ranks do not divide"
        )));
    }
    let batch = (GLOBAL_BATCH / world).to_string();
    let (steps, seed) = (STEPS.to_string(), SEED.to_string());
    let base = [
        "--strategy",
        strategy,
        "--batch-size",
        &batch,
        "--max-steps",
        &steps,
        "--seed",
        &seed,
        "--schedule",
        "constant",
    ];
    let mut args = TrainArgs::from_flags(&[&base[..], flags].concat())
        .map_err(|e| TrainError::InvalidArgs(e.to_string()))?;
    let plain = PlainConfig::from_args(&args).map_err(TrainError::InvalidArgs)?;
    // The trained model is compared whole (under zero3 gathered), and rank 0 also saves it
    // unit by unit, which must give the same values.
    args.gather_model = true;
    let saved = SavedFile::new(comm.rank());
    args.save = Some(saved.path.clone());

    let config = GptConfig::tiny().with_dropout(dropout);
    config
        .validate()
        .map_err(|e| TrainError::InvalidArgs(e.to_string()))?;
    let device = args.device()?;
    let model = || seeded_model_on(SEED, &device, |d| Gpt::new(&config, d).expect("validated"));
    let task = |batch| -> Result<T, TrainError> {
        Ok(data(NextToken::new(tokens(), BLOCK, batch, SEED)?))
    };
    let initial = weights::collect(&model());
    let (engine, summary) = train_on(comm, model(), &mut task(args.batch_size)?, &args, &device)?;
    let engine = engine.expect("asked for the whole model");
    // The dropout stream rank 0 of a run with this seed draws.
    burnscale_nn::dropout::seed(SEED);
    let (expected, plain) = plain.train(model(), &mut task(GLOBAL_BATCH)?, &device);

    let tolerance = Tolerance::of(&args, &model());
    let mut differences = Vec::new();
    let mut worst = 0f64;
    let steps = summary
        .history
        .iter()
        .zip(expected.losses.iter().zip(&expected.grad_norms));
    for (got, (&loss, &grad_norm)) in steps {
        let step = got.step;
        for (what, got, want) in [
            ("loss", got.loss, loss),
            ("gradient norm", got.grad_norm, grad_norm),
        ] {
            let (difference, allowed) = ((got - want).abs(), tolerance.relative * want.abs());
            worst = worse(worst, difference / allowed);
            if difference.is_nan() || difference > allowed {
                differences.push(format!(
                    "step {step}: {what} {got}, plain {want} (relative {:.1e} > {:.1e})",
                    (got - want).abs() / want.abs(),
                    tolerance.relative
                ));
            }
        }
    }
    if summary.history.len() != STEPS {
        differences.push(format!(
            "{} steps recorded, not {STEPS}",
            summary.history.len()
        ));
    }
    let (trained, plain) = (weights::collect(&engine), weights::collect(&plain));
    // A frozen parameter takes no step: the bits it started with (in 16 bits under `*-true`,
    // where the plain loop's are its cast of them).
    let start = match args.precision.param_dtype() {
        FloatDType::F32 => &initial,
        _ => &plain,
    };
    for (path, got) in trained
        .iter()
        .filter(|(path, _)| frozen_by(&args.freeze, path))
    {
        if start.get(path).is_none_or(|want| want.values != got.values) {
            differences.push(format!("{path}: frozen, but changed"));
        }
    }
    let (params, params_worst) = parameter_differences(
        &initial,
        &trained,
        &plain,
        &tolerance,
        args.lr() as f32 * STEPS as f32,
        (config.n_embd, args.optimizer == OptimizerKind::Adafactor),
        |path| !frozen_by(&args.freeze, path) && !path.ends_with(".gamma"),
    );
    differences.extend(params);
    if comm.rank() == 0 {
        differences.extend(saved.differences_from(&engine)?);
    }
    Ok(Comparison {
        differences,
        worst: worse(worst, params_worst),
    })
}

/// Trains a tiny minGPT with dropout for 6 steps under `strategy` on `comm`, checkpointing
/// into `dir` (the same path on every rank) every 3 steps, then again from the step-3
/// checkpoint (`--resume`): the resumed run must take the uninterrupted run's last 3 steps
/// (loss, gradient norm) and end with its parameters, bit for bit. `dir` is removed after.
pub fn check_resume(
    comm: &dyn Communicator,
    strategy: &str,
    dir: &Path,
    flags: &[&str],
) -> Result<Comparison, TrainError> {
    let batch = (GLOBAL_BATCH / comm.world_size()).to_string();
    let seed = SEED.to_string();
    let dir_flag = dir.to_string_lossy();
    let base = [
        "--strategy",
        strategy,
        "--batch-size",
        &batch,
        "--max-steps",
        "6",
        "--warmup-steps",
        "2",
        "--seed",
        &seed,
        "--checkpoint-dir",
        &dir_flag,
        "--checkpoint-every",
        "3",
    ];
    let mut args = TrainArgs::from_flags(&[&base[..], flags].concat())
        .map_err(|e| TrainError::InvalidArgs(e.to_string()))?;
    args.gather_model = true;
    let config = GptConfig::tiny().with_dropout(0.1);
    let device = args.device()?;
    let model = || seeded_model_on(SEED, &device, |d| Gpt::new(&config, d).expect("valid"));
    let task = || NextToken::new(tokens(), BLOCK, args.batch_size, SEED);
    let (whole, uninterrupted) = train_on(comm, model(), &mut task()?, &args, &device)?;
    let io = |e: std::io::Error| TrainError::InvalidData(format!("{}: {e}", dir.display()));
    comm.barrier()?;
    if comm.rank() == 0 {
        std::fs::remove_dir_all(dir.join("step-00000006")).map_err(io)?;
    }
    comm.barrier()?;
    args.resume = true;
    let (resumed_model, resumed) = train_on(comm, model(), &mut task()?, &args, &device)?;
    comm.barrier()?;
    if comm.rank() == 0 {
        std::fs::remove_dir_all(dir).map_err(io)?;
    }
    let steps = |s: &RunSummary| -> Vec<(usize, f64, f64)> {
        s.history
            .iter()
            .map(|m| (m.step, m.loss, m.grad_norm))
            .collect()
    };
    let mut differences = Vec::new();
    let (want, got) = (steps(&uninterrupted), steps(&resumed));
    if got[..] != want[3..] {
        differences.push(format!(
            "resumed steps {got:?}, uninterrupted {:?}",
            &want[3..]
        ));
    }
    let (want, got) = (
        weights::collect(&whole.expect("asked for")),
        weights::collect(&resumed_model.expect("asked for")),
    );
    differences.extend(
        want.iter()
            .filter(|(path, w)| got.get(*path) != Some(w))
            .map(|(path, _)| format!("{path} differs after resuming")),
    );
    Ok(Comparison {
        differences,
        worst: 0.0,
    })
}

/// The targets [`check_padded`] ignores: below this token id (about a third of them, more in
/// some windows than in others).
pub const PADDING_BELOW: i64 = 4;

/// [`NextToken`] with the targets below [`PADDING_BELOW`] ignored.
#[derive(Clone)]
struct Padded(NextToken);

impl TrainTask for Padded {
    type Model = Gpt;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Gpt> {
        let (input, target) = self.0.next_batch(device, part);
        let padding = target.clone().lower_elem(PADDING_BELOW);
        (input, target.mask_fill(padding, -1))
    }

    fn items(&self, input: &Tensor<2, Int>) -> usize {
        self.0.items(input)
    }

    fn counts_tokens(&self) -> bool {
        true
    }

    fn eval_batches(&self) -> usize {
        0
    }

    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Gpt> {
        self.0.eval_batch(k, device)
    }

    fn score(&self, logits: Tensor<3>, target: Tensor<2, Int>) -> Score {
        self.0.score(logits, target)
    }
}

/// How far the engine may drift from the plain loop, derived from the dtypes and the
/// optimizer (the checks run [`STEPS`] steps of minGPT-tiny, 96 tokens a step), as a
/// multiple of the unit roundoff `u` of the coarsest dtype the step computes in (f32 2^-24,
/// f16 2^-11, bf16 2^-8: the compute dtype, or the gradient-reduction dtype if coarser).
#[derive(Debug, Clone, PartialEq)]
pub struct Tolerance {
    /// Of a loss or a gradient norm, and of a parameter's update over the run (L2 norm).
    ///
    /// In f32 both runs compute the same sums in another order (the engine splits the batch
    /// over ranks and micro-steps and reduces in its own order):
    /// - SGD `2^10 u` (6.1e-5). Its update is `lr · g`, so a relative gradient error maps one
    ///   to one onto the update; sqrt(96 tokens · 5 steps) ≈ 22 for sums in random order,
    ///   times ~45 for the depth of the network and other kernels' summation orders
    ///   (measured: at most 2.6e-6 = 44 u, besides whole ulps of storage).
    /// - AdamW `2^12 u` (2.4e-4). It divides each gradient by its own running RMS, so an
    ///   element whose gradient is near zero turns a rounding difference into an update
    ///   difference of up to the learning rate; few elements are so, and a tensor's L2 error
    ///   grows by the root of their share (measured: at most 1.7e-6).
    ///
    /// In 16 bits the engine rounds every activation and gradient to 16 bits, where the
    /// loop does not (mixed policies, against the f32 loop) or at other places (`*-true`:
    /// each rank rounds its part of the batch): each operation rounds once, through some
    /// tens of operations, so `2^6 u` (f16 3.1%, bf16 25%; measured 2026-12-02: at most 15 u
    /// for f16, 19 u for bf16). bf16 cannot go looser: a gradient of the wrong scale (2x, the
    /// least a sum-for-mean or a missing `1/accumulate` gives) moves the update by 100%.
    ///
    /// Computed in f32 and only reduced in 16 bits (`--grad-reduce-dtype`), each rank's
    /// gradient is rounded once before the mean: SGD `2^3 u` (bf16 3.1%: a mean over 3 ranks
    /// divided by 4 is 25% off; measured: at most 3.3 u); Adam `2^6 u`, since f16 flushes
    /// gradients below 6e-8 to zero, which Adam's normalisation turns into steps (measured:
    /// 27.5 u for f16, 2.4 u for bf16).
    pub relative: f64,
    /// Of a parameter, besides: one rounding of the stored weight per step in either run,
    /// `2 u_w · steps · ‖θ‖` with `u_w` the weight dtype's unit roundoff (a weight near 1 whose
    /// update is 1e-2 moves by whole ulps of 1). Under `*-true` this is 4% (bf16) of the
    /// weight, more than a layer norm's whole update in 5 steps: such a tensor's update is
    /// below its storage resolution, and only the rounding is checked there (the loss, the
    /// gradient norm and the other tensors still see a wrong gradient).
    pub storage: f64,
    /// Of a parameter with 8-bit state (in `eight_bit`: no other can flip a code), besides:
    /// one element's whole movement over the run, `lr · steps`. A moment within rounding of a
    /// boundary between two codes may be stored as either; that element then moves by up to
    /// one code step of its moment (1.4% to 100% of it), at most the learning rate a step,
    /// for the rest of the run, in whichever run it happens. A tensor of a few hundred
    /// elements moving alike has an update of about `lr · steps · sqrt(n)`, so one such
    /// element is several percent of it (seen: 6.8e-3 of `h.1.attn.c_attn.weight`'s update
    /// at N = 3 once the layer norm's backward rounded differently, 7e-5 before). A wrong
    /// block or shard moves whole rows, far beyond it.
    pub element: f64,
    /// The paths of the parameters `--optimizer adam8bit` keeps 8-bit state for (none under
    /// another optimizer).
    pub eight_bit: HashSet<String>,
    /// Under an adaptive optimizer (AdamW, 8-bit AdamW, Adafactor) computing in 16 bits, one
    /// element of each tensor (the one differing most) is checked apart, within twice the
    /// largest movement of any element of the tensor in the plain run, and the rest against
    /// `relative`. These optimizers divide each gradient by its own running RMS (plus
    /// epsilon): an element whose gradient is near zero steps the way 16-bit rounding points,
    /// by up to a whole step (Adafactor's relative step moves every element of a vector by
    /// about `lr · max(RMS, 1e-3)`, sign-like). Seen: one of `h.1.attn.c_proj.bias`'s 16
    /// elements, zero at the start, under 16-mixed once GELU's backward computed in f32:
    /// Adafactor two steps of 1e-5 from the plain run (15.7% of the tensor's update, the other
    /// 15 within 1e-8; 5.0 of the tolerance), AdamW 0.72 of it (0.2 with the element apart).
    /// A missed or doubled step moves every element, which the rest still shows (an engine
    /// one step short fails in six tensors under bf16-mixed Adafactor).
    pub one_element_apart: bool,
}

impl Tolerance {
    pub fn of<M: Module>(args: &TrainArgs, model: &M) -> Self {
        let roundoff = |dtype: FloatDType| match dtype {
            FloatDType::F16 => 2f64.powi(-11),
            FloatDType::BF16 => 2f64.powi(-8),
            _ => 2f64.powi(-24),
        };
        let reduce = match args.grad_reduce_dtype.dtype() {
            DType::F16 => FloatDType::F16,
            DType::Bf16 => FloatDType::BF16,
            DType::F32 => FloatDType::F32,
        };
        let computed = args.precision.compute_dtype();
        let u = roundoff(computed).max(roundoff(reduce));
        let multiple = match args.optimizer {
            OptimizerKind::Sgd if roundoff(computed) < u => 2f64.powi(3),
            _ if u > roundoff(FloatDType::F32) => 2f64.powi(6),
            OptimizerKind::Sgd => 2f64.powi(10),
            _ => 2f64.powi(12),
        };
        let eight_bit = args.optimizer == OptimizerKind::Adam8bit;
        Self {
            // The element flips below reach the loss and the other tensors too, a little.
            relative: if eight_bit {
                (multiple * u).max(2f64.powi(-8))
            } else {
                multiple * u
            },
            storage: 2.0 * roundoff(args.precision.param_dtype()) * STEPS as f64,
            element: args.lr() * STEPS as f64,
            eight_bit: eight_bit_paths(model, args),
            one_element_apart: args.optimizer != OptimizerKind::Sgd
                && roundoff(computed) > roundoff(FloatDType::F32),
        }
    }
}

/// Parameters (by path) whose L2 difference from the plain run exceeds `tolerance`. The
/// attention key bias (elements `[d, 2d)` of `c_attn.bias`) is checked apart: softmax is
/// shift-invariant per query, so its exact gradient is zero and both runs move it by float
/// noise, which AdamW normalises into steps of up to the learning rate: those elements must
/// stay within `drift` (`lr · steps`) of each other.
///
/// Under Adafactor (`adafactor`) a vector's update is divided by the RMS of all its
/// elements' normalised updates and scaled by its own RMS (relative step), both of which take
/// in the key bias's noise steps: the query and value biases (the rest of `c_attn.bias`) are
/// checked against their update at [`ADAFACTOR_ATTENTION_BIAS`] at least. The key bias's
/// steps are normalised noise as AdamW's, of at most `t^0.4` at step `t` (`β̂2 = 1 - t^-0.8`)
/// where a steady gradient's are about 1: 1.5x over five steps the largest step of a query or
/// value element, in either direction in each run, so within 3x that element's movement of
/// each other (a fixed `lr · steps` would allow a thousand times it under a relative step).
///
/// Under an adaptive optimizer in 16 bits one element of each tensor is checked apart
/// ([`Tolerance::one_element_apart`]).
///
/// A tensor that `must_see` names is also a difference when what it is allowed is at least
/// its update: a step it missed, or took twice, would pass (its 16-bit storage's rounding or
/// 8-bit codes cover the whole update; a check with a larger `--lr` sees it). The check exempts
/// layer-norm gains: their gradients are small, so their five steps stay within a few ulps
/// of 1 at any rate the tiny model trains at (none in bf16 for `h.0.ln_1` even at lr 1), and
/// frozen parameters, compared bit for bit apart.
///
/// Also returns the largest difference as a fraction of what was allowed.
fn parameter_differences(
    initial: &BTreeMap<String, Weight>,
    got: &BTreeMap<String, Weight>,
    want: &BTreeMap<String, Weight>,
    tolerance: &Tolerance,
    drift: f32,
    (d, adafactor): (usize, bool),
    must_see: impl Fn(&str) -> bool,
) -> (Vec<String>, f64) {
    let mut differences = Vec::new();
    let mut worst = 0f64;
    for (path, init) in initial {
        let (Some(got), Some(want)) = (got.get(path), want.get(path)) else {
            differences.push(format!("{path}: missing from a trained model"));
            continue;
        };
        let attention_bias = path.ends_with("c_attn.bias");
        let key_bias = |i: usize| attention_bias && (d..2 * d).contains(&i);
        // The most any element (besides the key bias) moved in the plain run.
        let moved = (want.values.iter().zip(&init.values).enumerate())
            .filter(|&(i, _)| !key_bias(i))
            .map(|(_, (&y, &y0))| (y - y0).abs())
            .fold(0f32, f32::max);
        let (relative, drift) = match attention_bias && adafactor {
            true => (
                tolerance.relative.max(ADAFACTOR_ATTENTION_BIAS),
                3.0 * moved,
            ),
            false => (tolerance.relative, drift),
        };
        // The element differing most, checked apart.
        let apart = tolerance
            .one_element_apart
            .then(|| {
                (got.values.iter().zip(&want.values).enumerate())
                    .filter(|&(i, _)| !key_bias(i))
                    .max_by(|(_, (x, y)), (_, (a, b))| (*x - *y).abs().total_cmp(&(*a - *b).abs()))
                    .map(|(i, _)| i)
            })
            .flatten();
        let (mut error, mut update, mut norm) = (0f64, 0f64, 0f64);
        let values = got.values.iter().zip(&want.values).zip(&init.values);
        for (i, ((&x, &y), &x0)) in values.enumerate() {
            if key_bias(i) {
                if (x - y).abs() > drift {
                    differences.push(format!("{path}[{i}] (key bias) is {x}, plain {y}"));
                }
                continue;
            }
            if apart == Some(i) {
                let allowed = 2.0 * moved;
                if allowed > 0.0 || x != y {
                    worst = worse(worst, f64::from((x - y).abs() / allowed));
                }
                if (x - y).abs().is_nan() || (x - y).abs() > allowed {
                    differences.push(format!(
                        "{path}[{i}] is {x}, plain {y}: more than twice the most an element moved ({moved:.3e})"
                    ));
                }
            } else {
                error += ((x - y) as f64).powi(2);
            }
            update += ((y - x0) as f64).powi(2);
            norm += (y as f64).powi(2);
        }
        let (error, update) = (error.sqrt(), update.sqrt());
        let element = match tolerance.eight_bit.contains(path) {
            true => tolerance.element,
            false => 0.0,
        };
        let allowed = relative * update + tolerance.storage * norm.sqrt() + element;
        if allowed == 0.0 && error == 0.0 {
            continue; // every element was checked apart
        }
        if allowed >= update && must_see(path) {
            differences.push(format!(
                "{path}: its update {update:.3e} is within what it is allowed ({allowed:.3e}): the check cannot see it"
            ));
        }
        worst = worse(worst, error / allowed);
        if error.is_nan() || error > allowed {
            differences.push(format!(
                "{path}: differs from the plain run by {error:.3e}, {:.2e} of its update {update:.3e} (allowed {allowed:.3e})",
                error / update
            ));
        }
    }
    (differences, worst)
}

/// Where rank 0 of a check saves the trained model (`--save`): a file of its own in the
/// temporary directory, removed when the check ends.
struct SavedFile {
    path: PathBuf,
}

impl SavedFile {
    fn new(rank: usize) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "burnscale-check-{}-{}-{rank}.safetensors",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            path: std::env::temp_dir().join(name),
        }
    }

    /// What differs between the file and `model` saved under its own keys: the streamed
    /// save must hold exactly the trained values.
    fn differences_from(&self, model: &Gpt) -> Result<Vec<String>, TrainError> {
        let file = weights::read_safetensors(&self.path).map_err(TrainError::Save)?;
        let mut file: BTreeMap<String, Weight> =
            file.into_iter().map(|w| (w.key.clone(), w)).collect();
        let keys = model.checkpoint_keys();
        let mut differences = Vec::new();
        for (path, weight) in weights::collect(model) {
            for saved in keys.saved_as(&path, &weight.shape) {
                let want = match saved.transposed {
                    true => weight.clone().transposed(),
                    false => weight.clone(),
                };
                match file.remove(&saved.key) {
                    Some(got) if got.shape == want.shape && got.values == want.values => {}
                    Some(_) => differences.push(format!(
                        "saved {}: `{}` differs from the trained model's",
                        self.path.display(),
                        saved.key
                    )),
                    None => differences.push(format!(
                        "saved {}: `{}` is missing",
                        self.path.display(),
                        saved.key
                    )),
                }
            }
        }
        differences.extend(
            file.keys()
                .map(|key| format!("saved {}: unexpected `{key}`", self.path.display())),
        );
        Ok(differences)
    }
}

impl Drop for SavedFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The larger of two fractions of the tolerance, NaN counting as the worst.
fn worse(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// The token stream the checks train on: a periodic pattern the model can learn.
fn tokens() -> Vec<i64> {
    (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect()
}

/// [`seeded_model_on`] the default device, with autodiff.
pub fn seeded_model<M: Module>(seed: u64, build: impl FnOnce(&Device) -> M) -> M {
    seeded_model_on(seed, &Device::default().autodiff(), build)
}

/// Flex's random generator, held. Flex seeds one process-wide generator, and ranks that are
/// threads (or tests running in parallel) draw from it at once: a draw on one thread between
/// another's seed and its build changes that build. Whatever draws in a process that also
/// builds seeded models (an unseeded build, a lazy parameter's first read) holds this while it
/// draws, as [`seeded_model_on`] does. Not reentrant: a seeded build under it waits forever.
pub fn hold_generator() -> MutexGuard<'static, ()> {
    static GENERATOR: Mutex<()> = Mutex::new(());
    GENERATOR
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Builds a model on `device` with its generator seeded, holding the generator
/// ([`hold_generator`]) from the seed until every parameter is drawn.
pub fn seeded_model_on<M: Module>(
    seed: u64,
    device: &Device,
    build: impl FnOnce(&Device) -> M,
) -> M {
    let _generator = hold_generator();
    device.seed(seed);
    let model = build(device);
    burnscale_shard::params::materialize(&model);
    model
}
