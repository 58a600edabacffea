//! The training loop (Fabric-like): ranks (threads, or processes under mpirun), the
//! sharding strategy, gradient accumulation, global-norm clipping, the optimizer and its
//! schedule, per-step metrics, and the closing report.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::sync::Mutex;
use std::time::Instant;

use burn::module::Module;
use burn::prelude::*;
use burnscale_collective::{Buffer, CollectiveBytes, Communicator, Counted, ReduceOp, gather_u64s};
use burnscale_nn::BlockModel;
use burnscale_nn::weights::{KeyMap, Saver, WeightError};
use burnscale_precision::ScalerConfig;
use burnscale_shard::{Sharded, Share, StepOutcome};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::accelerator::Accelerator;
use crate::auto::{self, AutoChoice, Resolved};
use crate::checkpoint::{self, Checkpoint};
use crate::cli::{Offload, ReduceDtype};
use crate::fault;
use crate::optim::{self, LrSchedule, ParamOptimizer};
use crate::plan::{MemoryPlan, Probe, ranks_in_process};
use crate::prepare::Prepare;
use crate::report::{
    CheckpointReport, ModelStateBytes, RankMemory, RunSummary, SaveReport, Throughput,
};
use crate::{StopFlag, TrainArgs, TrainError, memory, speed};

/// A micro-batch: what the model's embeddings read, and what its loss compares against.
pub type Batch<M> = (<M as BlockModel>::Input, <M as BlockModel>::Target);

/// What a validation batch scored, summed over its items.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Score {
    /// The loss summed over the batch's items.
    pub loss: f64,
    /// The items scored: samples, or a language model's tokens.
    pub items: usize,
    /// Right answers, for a classifier.
    pub correct: Option<usize>,
}

impl Score {
    /// A batch's cross-entropy ([`burnscale_nn::cross_entropy`]) over the targets it scores,
    /// those not ignored, without right answers to count: so that a validation set's loss is
    /// per scored item whatever its batches' shares of ignored ones.
    pub fn of_cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Self {
        let items = burnscale_nn::scored_items(targets.clone());
        let mean = burnscale_nn::cross_entropy(logits, targets);
        // One read of both, so that a batch waits for the device once.
        let read: Vec<f64> = Tensor::cat(vec![mean, items], 0)
            .into_data()
            .iter::<f32>()
            .map(f64::from)
            .collect();
        let (mean, items) = (read[0], read[1]);
        Self {
            loss: mean * items,
            items: items as usize,
            correct: None,
        }
    }
}

/// Which slice of every global batch a rank reads (a distributed sampler): all ranks draw
/// the same global batch and keep rows `[rank·b, (rank+1)·b)`, so N ranks with micro-batch
/// b train on the same data as one rank with N·b.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPart {
    pub rank: usize,
    pub world: usize,
}

impl BatchPart {
    /// The whole batch: one rank of one.
    pub const WHOLE: BatchPart = BatchPart { rank: 0, world: 1 };
}

/// What a training example plugs into the runner. Each rank works on its own clone.
pub trait TrainTask: Clone + Send + Sync {
    type Model: BlockModel + Send + Sync;

    /// This rank's part of the next global training micro-batch: `--batch-size` sequences
    /// (fewer for a short last batch; more, or none, is refused). A short batch's loss counts
    /// for its items where the model counts them ([`BlockModel::loss_items`]); else, its
    /// mean counts as a full batch's, as each rank's does under PyTorch's DDP.
    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Self::Model>;
    /// Items (tokens or samples) in a micro-batch, for throughput.
    fn items(&self, input: &<Self::Model as BlockModel>::Input) -> usize;
    /// Whether `items` counts tokens (else samples).
    fn counts_tokens(&self) -> bool;
    /// Validation batches in all (the whole validation set; 0 without one), the same on every
    /// rank: N ranks split them, rank r evaluating batches r, r + N, r + 2N, ...
    fn eval_batches(&self) -> usize;
    /// Validation batch `k` (below [`TrainTask::eval_batches`]), built on `device`.
    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Self::Model>;
    /// The micro-batch (this rank's part) that takes the most memory to train on, which the
    /// memory plan measures: by default the next one, for data whose batches are all alike.
    /// A task that pads a batch to its longest sequence builds one of its longest sequences,
    /// the size of the batch that holds the longest (it comes once an epoch).
    fn largest_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Self::Model> {
        self.next_batch(device, part)
    }
    /// The validation batch that takes the most memory, or one that takes at least as much
    /// (there is one when [`TrainTask::eval_batches`] is above 0), which the memory plan
    /// measures: by default the first, for data whose last batch is the only one smaller.
    fn largest_eval_batch(&mut self, device: &Device) -> Batch<Self::Model> {
        self.eval_batch(0, device)
    }
    /// What a validation batch scores, from the model's logits for it.
    fn score(
        &self,
        logits: <Self::Model as BlockModel>::Logits,
        target: <Self::Model as BlockModel>::Target,
    ) -> Score;
    /// `Ok` if `model` can read every example: run once before training, on the host, so
    /// that a bad example is an error naming it rather than a failure inside a step. Tasks
    /// whose data cannot mismatch the model (fixed-shape images) keep the default.
    fn check(&self, _model: &Self::Model) -> Result<(), TrainError> {
        Ok(())
    }
    /// Moves past the next `micro_batches` micro-batches, as if drawn (a resumed run's data
    /// position). By default draws them on `device` and drops them; tasks whose sampler can
    /// jump ahead override it.
    fn skip(&mut self, micro_batches: usize, device: &Device, part: BatchPart) {
        for _ in 0..micro_batches {
            self.next_batch(device, part);
        }
    }
}

/// Per-step numbers, as written to `--metrics-csv` and handed to [`TrainArgs::on_step`].
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    pub step: usize,
    pub lr: f64,
    pub loss: f64,
    pub grad_norm: f64,
    pub items_per_s: f64,
    /// Seconds since this run's training began (in `--metrics-csv`, a resumed run's rows go
    /// on from the earlier run's).
    pub elapsed_s: f64,
    /// Whether the loss scaler skipped the update (`16-mixed`: the gradients overflowed);
    /// its forward and backward ran.
    pub skipped: bool,
    /// The validation loss after this step, on the steps that evaluate (every
    /// `--eval-interval`-th and the last) of a task with validation data; a step in which a
    /// stop was asked skips its evaluation (the last one's excepted).
    pub val_loss: Option<f64>,
    /// The validation accuracy beside `val_loss`, for tasks that score answers.
    pub accuracy: Option<f64>,
}

/// A function [`train`] calls on rank 0 with each step's numbers once the step is done: its
/// evaluation too, on the steps that evaluate, and its checkpoint saved, when one is due. For
/// a program that reports a run's progress itself (a service's job status, a dashboard). It
/// runs on rank 0's training thread, so the other ranks wait for it at their next collective:
/// one that takes longer than `--collective-timeout` fails the run (hand the numbers to a
/// channel or a thread of your own for slow work). To stop the run from it, raise the run's
/// [`StopFlag`] (the ranks agree on a stop within a step: the run stops after the next one).
#[derive(Clone)]
pub struct OnStep(std::sync::Arc<dyn Fn(&StepMetrics) + Send + Sync>);

impl OnStep {
    pub fn new(f: impl Fn(&StepMetrics) + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }
}

impl std::fmt::Debug for OnStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnStep(..)")
    }
}

/// Trains `model` (built on `device`) on `task` as `args` say: on `--devices` in-process
/// ranks, on the MPI world when started by mpirun, or on this thread; with `--accelerator
/// cuda` rank i runs on GPU i (`device`'s autodiff settings kept). Returns the trained model
/// (see [`train_on`]) and the summary of this process's first rank.
pub fn train<T: TrainTask>(
    model: T::Model,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
) -> Result<(Option<T::Model>, RunSummary), TrainError> {
    check_args(args, device)?;
    args.check_launched_world()?;
    let given = args;
    // Once for every rank of this process (each trains on a copy of `task`), and before the
    // memory plan's probe, which trains a step on the examples.
    task.check(&model)?;
    check_model(&model, args)?;
    let model = crate::freeze::freeze(model, &args.freeze)?;
    // Planned on the model as given (a lazy one stays lazy), before any rank allocates.
    let Resolved {
        args,
        probe,
        choice,
    } = auto::resolve(&model, task, args, device)?;
    let args = &args;
    let prepare = Prepare::new(args);
    let model = prepare.before_ranks(model, args);
    // What this thread queued to build the model runs now: Burn's fusion queues each thread's
    // operations apart, and a rank's plan (a dry run, on cubecl) would drop what it resolves.
    if args.plans_device() {
        device
            .sync()
            .map_err(|e| TrainError::DryRun(format!("{e:?}")))?;
    }
    // The last rank to start takes `model` itself, so that no full copy outlives sharding.
    let shared = Mutex::new((Some(model), args.devices));
    let accelerator = args.runs_on();
    let results = accelerator.run_ranks(args.devices, args.collective_timeout, |comm, local| {
        let model = {
            let mut shared = shared
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            shared.1 -= 1;
            if shared.1 == 0 {
                shared.0.take()
            } else {
                shared.0.clone()
            }
        };
        let model = model.expect("one model per rank of this process");
        let device = accelerator.device(device, local);
        let planned = Planned {
            probe: probe.as_ref(),
            choice: choice.as_ref(),
            prepare: Some(&prepare),
            given: Some(given),
        };
        train_rank(comm, model, &mut task.clone(), args, &device, planned)
    })?;
    let mut outcome = None;
    let mut errors = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(Ok(done)) => outcome = outcome.or(Some(done)),
            Ok(Err(e)) => errors.push(e),
            Err(message) => errors.push(TrainError::RankPanicked { rank, message }),
        }
    }
    // The rank that failed first, not the ones that stopped because of it.
    match errors.into_iter().min_by_key(TrainError::is_peer_failure) {
        Some(e) => Err(e),
        None => Ok(outcome.expect("every rank returned")),
    }
}

/// Trains as one rank of `comm`'s group (for embedding the runner in a program that owns
/// its process group). Every rank calls it with the same model, task and arguments. Returns
/// the trained model when the strategy keeps it whole on every rank, or under zero3 when
/// `args.gather_model` asks for it (`None` otherwise), with this rank's summary.
/// Host memory is not planned here (`--plan`, `--memory-budget` and `--strategy auto` are
/// refused): [`train`]'s probe runs before any rank starts. A cubecl device's pools are
/// planned by each rank's dry run, as under [`train`].
pub fn train_on<T: TrainTask>(
    comm: &dyn Communicator,
    model: T::Model,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
) -> Result<(Option<T::Model>, RunSummary), TrainError> {
    if args.plans_memory() && !args.plans_device() {
        return Err(TrainError::InvalidArgs(
            "--plan, --memory-budget and --strategy auto plan host memory before the ranks start, which train does and train_on (given its ranks) cannot: call train, or drop them".into(),
        ));
    }
    // Each rank checks the examples it was given, before its first collective.
    task.check(&model)?;
    check_model(&model, args)?;
    let model = crate::freeze::freeze(model, &args.freeze)?;
    train_rank(comm, model, task, args, device, Planned::default())
}

/// The flags that name parts of `model` against it: `--freeze`'s paths (and that something is
/// left to train), `--embedding-state-32bit`'s tables, `--checkpoint-blocks`' depth. [`train`]
/// checks them first; a binary calls this on its model (a lazily initialised one costs
/// nothing to build) before a slow set-up, fetching weights or tokenizing a corpus, so that a
/// mistyped flag is named at once.
pub fn check_model<M: BlockModel>(model: &M, args: &TrainArgs) -> Result<(), TrainError> {
    crate::freeze::frozen_ids(model, &args.freeze)?;
    optim::check_trains(model, args)?;
    let depth = model.blocks().len();
    args.checkpointing().blocks(depth).map_err(|_| {
        TrainError::InvalidArgs(format!(
            "--checkpoint-blocks {} is more blocks than the model has ({depth})",
            args.checkpoint_blocks.unwrap_or_default()
        ))
    })?;
    Ok(())
}

/// What [`train`] planned before the ranks started.
#[derive(Default, Clone, Copy)]
struct Planned<'a> {
    /// The backend's terms of the memory plan, when one is wanted.
    probe: Option<&'a Probe>,
    /// What `--strategy auto` chose, and why.
    choice: Option<&'a AutoChoice>,
    /// How the model given to [`train`] is made ready on the rank (none for [`train_on`]'s,
    /// which its caller made ready).
    prepare: Option<&'a Prepare>,
    /// The flags as given, before `--strategy auto` chose (the processes of an MPI world
    /// compare these; their choices are compared apart).
    given: Option<&'a TrainArgs>,
}

/// One rank's training, with the memory plan when `planned` has the backend's terms.
///
/// However it ends, what the run left on this thread goes back once its engine is dropped:
/// cubecl's pools keep a finished run's pages for its thread's stream, which no later run
/// uses, so that the next run in this process (a bench's next row, a service's next job)
/// starts from what is live. The layers' cached constants go too: a few KiB, but each pins a
/// page (8 MiB of cubecl-cpu's pools, read), which the next run on this thread would find
/// reserved.
fn train_rank<T: TrainTask>(
    comm: &dyn Communicator,
    model: T::Model,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
    planned: Planned,
) -> Result<(Option<T::Model>, RunSummary), TrainError> {
    let outcome = run_rank(&Counted::new(comm), model, task, args, device, planned);
    burnscale_nn::device_cache::clear();
    release_free_pages(device);
    outcome
}

/// [`train_rank`]'s run, its engine and optimizer dropped on return; `comm` counts the bytes
/// of the training steps' collectives.
fn run_rank<T: TrainTask>(
    comm: &Counted,
    model: T::Model,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
    planned: Planned,
) -> Result<(Option<T::Model>, RunSummary), TrainError> {
    check_args(args, device)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    args.check_world(world)?;
    // Thread ranks share their process's files; processes may not.
    if world > 1 && burnscale_collective::launched_by_mpirun() {
        check_flags_alike(comm, planned.given.unwrap_or(args))?;
        if let Some(dir) = &args.checkpoint_dir {
            checkpoint::check_shared(comm, dir)?;
        }
    }
    let part = BatchPart { rank, world };
    // On a cubecl device the plan is a dry run of the steps (each candidate's, under
    // --memory-budget), before the engine is built and before dropout's stream is seeded:
    // the dry run draws from it.
    #[cfg(feature = "cube")]
    let device_resolved = match args.plans_device() {
        true => Some(crate::device_plan::resolve(
            &model, task, args, comm, device, part,
        )?),
        false => None,
    };
    #[cfg(not(feature = "cube"))]
    let device_resolved: Option<crate::device_plan::Resolved> = None;
    let (args, device_plan, choice) = match device_resolved {
        Some(resolved) => (resolved.args, Some(resolved.plan), resolved.choice),
        None => (args.clone(), None, planned.choice.cloned()),
    };
    let args = &args;
    let model = match planned.prepare {
        Some(prepare) => prepare.on_rank(model, args, comm, device)?,
        None => model,
    };
    if let Some(choice) = choice.as_ref().filter(|_| rank == 0) {
        eprintln!("{}", choice.explain());
    }
    let lead = rank == 0;
    let num_params = model.num_params();
    let threads = ranks_in_process(world);
    let plan = planned
        .probe
        .map(|probe| MemoryPlan::new(&model, args, world, threads, probe.clone()))
        .transpose()?;
    if planned.choice.is_some() {
        auto::agree(comm, args)?;
    }
    if let Some(plan) = plan.as_ref().filter(|_| lead && args.plan) {
        eprintln!("memory plan (per rank unless said):\n{}", plan.table());
    }
    let keys = model.checkpoint_keys();
    let mut optim = ParamOptimizer::new(args, rank, &model)?;
    let mut schedule = LrSchedule::new(args);
    for note in [LrSchedule::unreached(args), args.offload_note()] {
        if let Some(note) = note.filter(|_| lead) {
            eprintln!("note: {note}");
        }
    }
    let progress = progress_bar(args.max_steps as u64, lead);
    if let Some(plan) = device_plan.as_ref().filter(|_| lead && args.plan) {
        eprintln!("device memory plan (per rank):\n{}", plan.table());
    }
    // Rank 0 draws the stream a single-device run with this seed draws.
    burnscale_nn::dropout::seed(args.seed.wrapping_add(rank as u64 * 0x9E37_79B9_7F4A_7C15));
    let mut engine = build_engine(model, args, comm, device)?;
    let mut first_step = 1;
    let mut checkpoints = CheckpointReport::default();
    let mut last_checkpoint_failed = None;
    if let Some(dir) = args.checkpoint_dir.as_ref().filter(|_| args.resume) {
        let loading = Instant::now();
        let latest = Checkpoint::latest(dir).map_err(|e| checkpoint::naming_older(dir, e.into()));
        match checkpoint::agree_on_newest(comm, dir, latest, |c| c.meta.step)? {
            Some(ckpt) => {
                let restored = checkpoint::restore(
                    ckpt,
                    comm,
                    &mut engine,
                    &mut optim,
                    &mut schedule,
                    task,
                    args,
                    device,
                )
                .map_err(|e| checkpoint::naming_older(dir, e));
                let resumed = checkpoint::agree_restored(comm, restored)?;
                first_step = resumed.step + 1;
                checkpoints.resumed_from = Some(resumed.step);
                checkpoints.changed_flags = [
                    &resumed.schedule_changes[..],
                    &resumed.optimizer_changes[..],
                ]
                .concat();
                checkpoints.load_s = loading.elapsed().as_secs_f64();
                // Said once every rank has restored its part (they agreed on it).
                if lead {
                    eprintln!(
                        "resuming from {} (step {}): its parameters replace the model's as built or loaded",
                        resumed.dir.display(),
                        resumed.step
                    );
                    if !resumed.schedule_changes.is_empty() {
                        eprintln!(
                            "note: the learning-rate schedule is not the one the checkpoint's run followed ({}): steps from {first_step} follow this run's",
                            resumed.schedule_changes.join(", ")
                        );
                    }
                    if !resumed.optimizer_changes.is_empty() {
                        eprintln!(
                            "note: the optimizer is not set as the checkpoint's run's was ({}): its state steps on under this run's settings (a moment the checkpoint lacks starts afresh; one this run keeps none of is dropped)",
                            resumed.optimizer_changes.join(", ")
                        );
                    }
                }
            }
            None if lead => eprintln!(
                "no complete checkpoint in {}: starting from step 0",
                dir.display()
            ),
            None => {}
        }
    }
    // Opened once the checkpoint is known to fit, so that a refused resume leaves the file
    // as it was.
    let mut csv = match &args.metrics_csv {
        Some(path) if lead => Some(MetricsCsv::open(path, checkpoints.resumed_from)?),
        _ => None,
    };
    peak_then_reset(comm)?;
    // The device's peak counts from what is live: pages an earlier run or a dropped model
    // left in cubecl's pools go back first.
    release_free_pages(device);
    let mut device_peak = memory::DevicePeak::new(device);
    let start = Instant::now();
    let (mut items, mut flops) = (0usize, 0.0);
    // Time, items and model FLOPs of the steady-state training steps (evaluations left out):
    // what the throughput divides.
    let mut train_s = 0.0;
    let mut step_times = Vec::new();
    let mut history = Vec::new();
    // Host transfers and collectives in training steps, without evaluations.
    let mut transferred = 0;
    let mut collective = CollectiveBytes::default();
    // The process peak of training so far, before a checkpoint reset it.
    let mut training_peak = 0;
    // The last step's evaluation, which the training time leaves out.
    let mut final_evaluation_s = 0.0;
    for step in first_step..=args.max_steps {
        let step_start = Instant::now();
        let transferred_before = burnscale_shard::host::transferred_bytes();
        let collective_before = comm.bytes();
        let (step_items, step_flops) =
            micro_steps(&mut engine, task, T::next_batch, args, device, part)?;
        fault::kill_if_asked(fault::Point::Step, step, rank);
        let lr = schedule.lr();
        let outcome = optimizer_step(&mut engine, &mut optim, lr, args)?;
        if !outcome.skipped {
            schedule.advance();
        }
        // The loss is read once the step is queued; with a loss scaler an overflow was a
        // skipped step, without one training on NaN would only waste the run. A non-finite
        // gradient norm (global, the same on every rank; its f32 sum of squares passes
        // f32's range from a norm of ~1.8e19) was applied unclipped: the run stops before
        // this step's checkpoint or `--save` keeps what it made of the weights.
        let asked = args.stop.as_ref().is_some_and(StopFlag::requested);
        let (step_loss, step_items, step_flops, stop) =
            over_ranks(comm, outcome.loss, step_items, step_flops, asked)?;
        let grad_norm = outcome.grad_norm;
        let not_finite = [("loss", step_loss), ("gradient norm", grad_norm)]
            .into_iter()
            .find(|(_, value)| !value.is_finite());
        if let (Some((quantity, value)), None) = (not_finite, engine.loss_scale()) {
            return Err(TrainError::NonFinite {
                quantity,
                parameter: None,
                value,
                step,
                precision: args.precision,
                f16_reduce: args.grad_reduce_dtype == ReduceDtype::F16 && world > 1,
            });
        }
        transferred += burnscale_shard::host::transferred_bytes() - transferred_before;
        collective += comm.bytes() - collective_before;
        device_peak.read();
        let step_s = step_start.elapsed().as_secs_f64();
        // Throughput counts steady-state steps: the first compiles and tunes kernels on a
        // GPU, and is reported apart (`warmup_s`); a one-step run has only that one.
        if step > first_step || first_step == args.max_steps {
            items += step_items;
            flops += step_flops;
            train_s += step_s;
        }
        step_times.push(step_s);
        let mut last = StepMetrics {
            step,
            lr,
            loss: step_loss,
            grad_norm,
            items_per_s: step_items as f64 / step_s,
            elapsed_s: start.elapsed().as_secs_f64(),
            skipped: outcome.skipped,
            val_loss: None,
            accuracy: None,
        };
        // The last step evaluates even when a stop was asked in it (the run ends as it
        // would have); the others skip it then.
        let evaluates = task.eval_batches() > 0
            && (step == args.max_steps
                || (!stop && args.eval_interval > 0 && step.is_multiple_of(args.eval_interval)));
        if evaluates {
            let evaluating = Instant::now();
            let (val_loss, accuracy) = evaluate(comm, &engine, task)?;
            (last.val_loss, last.accuracy) = (Some(val_loss), accuracy);
            if step == args.max_steps {
                final_evaluation_s = evaluating.elapsed().as_secs_f64();
            }
            if lead && step < args.max_steps {
                progress.suspend(|| {
                    eprintln!(
                        "step {step}: train loss {:.4}, val loss {val_loss:.4}{}",
                        last.loss,
                        accuracy
                            .map(|a| format!(", accuracy {:.2}%", 100.0 * a))
                            .unwrap_or_default()
                    )
                });
            }
        }
        // Before the step's checkpoint: a resumed run keeps the rows up to its checkpoint's
        // step, so that row must be written once the checkpoint is. A row that cannot be
        // written (a full disk elsewhere) stops the run after the checkpoint, not before it.
        let csv_written = match csv.as_mut() {
            Some(csv) => csv.write(&last),
            None => Ok(()),
        };
        if let Some(dir) = &args.checkpoint_dir
            && (step == args.max_steps
                || stop
                || (args.checkpoint_every > 0 && step.is_multiple_of(args.checkpoint_every)))
        {
            // Saving's peak is reported on its own, not as training's.
            training_peak = training_peak.max(peak_then_reset(comm)?);
            let saving = Instant::now();
            let bytes = match checkpoint::save(comm, dir, step, &engine, &optim, &*keys, args) {
                Ok(bytes) => bytes,
                // The last step's checkpoint failing (every rank sees it) still lets
                // `--save` write the trained model, elsewhere; the error is returned after.
                Err(error) if step == args.max_steps && !stop && args.save.is_some() => {
                    last_checkpoint_failed = Some(error);
                    0
                }
                Err(error) => return Err(error),
            };
            checkpoints.saves += 1;
            checkpoints.bytes = bytes;
            checkpoints.save_s += saving.elapsed().as_secs_f64();
            let saving_peak = peak_then_reset(comm)?;
            checkpoints.save_peak_mem_bytes = checkpoints
                .save_peak_mem_bytes
                .max(memory::is_counting().then_some(saving_peak));
        }
        csv_written?;
        if let Some(on_step) = args.on_step.as_ref().filter(|_| lead) {
            progress.suspend(|| (on_step.0)(&last));
        }
        // A stop asked in the last step lets the run end as it would have.
        if stop && step < args.max_steps {
            progress.finish_and_clear();
            return Err(TrainError::Stopped {
                step,
                checkpoint: args
                    .checkpoint_dir
                    .as_deref()
                    .map(|dir| checkpoint::step_dir(dir, step)),
            });
        }
        history.push(last);
        progress.set_position(step as u64);
        progress.set_message(format!(
            "loss {:.4}  {:.0} {}/s",
            last.loss,
            last.items_per_s,
            if task.counts_tokens() {
                "tok"
            } else {
                "samples"
            }
        ));
    }
    progress.finish_and_clear();
    let elapsed_s = start.elapsed().as_secs_f64() - final_evaluation_s;
    // The last step's evaluation; a run resumed at its last step takes none, and evaluates
    // the checkpoint's model here (as a task without validation data: NaN).
    let (val_loss, accuracy) = match history.last().and_then(|m| Some((m.val_loss?, m.accuracy))) {
        Some(evaluated) => evaluated,
        None => evaluate(comm, &engine, task)?,
    };
    // The run's peak, its evaluations' among it (one at a larger batch can set it).
    let peak_mem = memory::measured_peak().map(|peak| peak.max(training_peak));
    device_peak.read();
    let model_state = ModelStateBytes {
        params: engine.param_bytes(),
        grads: engine.grad_bytes(),
        optimizer: optim.state_bytes(),
        offloaded: optim.offloaded_bytes(),
    };
    let ranks = every_rank_memory(
        comm,
        [
            model_state.total(),
            // 0: none, as below.
            peak_mem.unwrap_or(0),
            // Without pools to read: on the CPU the device's memory is the host's; LibTorch's
            // allocator (C++, past the counting allocator) is not read (0: none).
            device_peak
                .bytes()
                .or(peak_mem.filter(|_| args.runs_on() == Accelerator::Cpu))
                .unwrap_or(0),
            plan.as_ref().map_or(0, |p| p.process_peak),
            device_plan.as_ref().map_or(0, |p| p.peak),
        ],
    )?;
    let saved = match &args.save {
        Some(path) => Some(save(&engine, comm, path, &*keys, args, lead)?),
        None => None,
    };
    if let (Some(error), Some(saved)) = (last_checkpoint_failed, args.save.clone()) {
        return Err(TrainError::LastCheckpoint {
            error: Box::new(error),
            saved,
        });
    }
    // After the memory figures: the probe's matrices are no part of training's peak.
    let peak_flops = speed::peak_gemm_flops(device, args.precision.compute_dtype(), args.runs_on());
    let items_per_s = items as f64 / train_s;
    let warmup_s = step_times.first().copied().unwrap_or(f64::NAN);
    // The steps the throughput counts: those after the first, or a one-step run's one.
    let timed = match step_times.len() {
        0 | 1 => &mut step_times[..],
        _ => &mut step_times[1..],
    };
    let timed_steps = timed.len();
    let step_s_median = median(timed);
    let throughput = Throughput {
        items_per_s,
        counts_tokens: task.counts_tokens(),
        model_flops_per_s: flops / train_s,
        ranks_per_device: match args.runs_on().on_gpu() {
            true => 1,
            false => ranks_in_process(world),
        },
    };
    let mut summary = RunSummary::new(
        args,
        world,
        first_step,
        history,
        val_loss,
        accuracy,
        elapsed_s,
        step_s_median,
        peak_mem,
        num_params,
        model_state,
        ranks,
        throughput,
        peak_flops,
    );
    summary.set_plan(plan);
    summary.set_device_plan(device_plan);
    summary.auto = choice;
    summary.trainable_params = engine.trainable_params();
    summary.recomputed_blocks = engine.recomputed_blocks();
    summary.model_state_predicted_bytes = ModelStateBytes::predicted(
        num_params,
        summary.trainable_params,
        args,
        engine.sharding(),
        world,
    );
    summary.host_transfer_bytes_per_step = transferred / step_times.len().max(1) as u64;
    summary.collective_bytes_per_step = collective.per(step_times.len() as u64);
    summary.warmup_s = warmup_s;
    summary.timed_steps = timed_steps;
    if let Some((scale, skipped)) = engine.loss_scale() {
        summary.loss_scale = Some(scale);
        summary.skipped_steps = skipped;
    }
    summary.save = saved;
    summary.checkpoints =
        (checkpoints.saves > 0 || checkpoints.resumed_from.is_some()).then_some(checkpoints);
    if let Some(path) = args.summary_json.as_ref().filter(|_| lead) {
        summary.write_json(path)?;
    }
    // The caller's copy, once every figure is taken: under ZeRO-3 only when asked for (the
    // one moment a rank holds the whole model).
    let model = match engine.holds_whole_model() || args.gather_model {
        true => Some(engine.full_model()?),
        false => None,
    };
    Ok((model, summary))
}

/// The engine `args` describe over `model` (its strategy, precision, checkpointing,
/// offload), as one rank of `comm`.
pub(crate) fn build_engine<'c, M: BlockModel>(
    model: M,
    args: &TrainArgs,
    comm: &'c dyn Communicator,
    device: &Device,
) -> Result<Sharded<'c, M>, TrainError> {
    let scaler = ScalerConfig {
        max_consecutive_skips: args.max_consecutive_skips,
        ..args
            .initial_loss_scale
            .map_or_else(ScalerConfig::default, ScalerConfig::starting_at)
    };
    let mut engine = Sharded::new(args.strategy.engine()?, model, comm, device)?
        .checkpoint_activations(args.checkpointing(), args.checkpoint_mode.engine())?
        .precision(args.precision, scaler)
        .reduce_dtype(args.grad_reduce_dtype.dtype());
    if args.offload == Offload::Params {
        engine = engine.offload_params(Device::flex())?;
    }
    if let Some(reshard) = args.reshard_after_forward {
        engine = engine.reshard_after_forward(reshard)?;
    }
    Ok(engine)
}

/// How [`micro_steps`] draws a micro-batch from a task: [`TrainTask::next_batch`] to train,
/// [`TrainTask::largest_batch`] to measure a plan.
pub(crate) type Draw<T> = fn(&mut T, &Device, BatchPart) -> Batch<<T as TrainTask>::Model>;

/// An optimizer step's forward and backward passes: `--accumulate` micro-batches of this
/// rank's `part`, each drawn by `draw`. Returns the items and model FLOPs of this rank's
/// part. Each micro-batch's loss counts for its share of the step's items: alike, or, for a
/// model whose loss ignores some targets, as many as it scores, which takes all of the
/// step's micro-batches drawn first and the ranks' counts added up.
pub(crate) fn micro_steps<T: TrainTask>(
    engine: &mut Sharded<'_, T::Model>,
    task: &mut T,
    draw: Draw<T>,
    args: &TrainArgs,
    device: &Device,
    part: BatchPart,
) -> Result<(usize, f64), TrainError> {
    let accumulate = args.accumulate;
    let draw = |task: &mut T, engine: &Sharded<'_, T::Model>| {
        let batch = draw(task, device, part);
        check_rows(engine.extent(&batch.0)[0], Some(args.batch_size))?;
        Ok::<_, TrainError>(batch)
    };
    let mut drawn = VecDeque::from([draw(task, engine)?]);
    // One micro-batch on one rank is the whole step: its mean is the step's.
    let alone = accumulate == 1 && engine.comm().world_size() == 1;
    let counted = (!alone).then(|| engine.loss_items(&drawn[0].1)).flatten();
    let shares = match counted {
        None => vec![Share::Even(accumulate); accumulate],
        Some(first) => {
            for _ in 1..accumulate {
                drawn.push_back(draw(task, engine)?);
            }
            let rest = drawn
                .iter()
                .skip(1)
                .map(|(_, target)| engine.loss_items(target))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    TrainError::InvalidData(
                        "the model counts the items of some micro-batches' losses only".into(),
                    )
                })?;
            Share::of_items(engine.comm(), first, rest)?
        }
    };
    let (mut items, mut flops) = (0, 0.0);
    for (micro, share) in (1..).zip(&shares) {
        let (input, target) = match drawn.pop_front() {
            Some(batch) => batch,
            None => draw(task, engine)?,
        };
        items += task.items(&input);
        flops += engine.train_flops(&input);
        engine.micro_step(input, target, share, micro == accumulate)?;
    }
    Ok((items, flops))
}

/// The update at learning rate `lr` from the gradients [`micro_steps`] left.
pub(crate) fn optimizer_step<M: BlockModel>(
    engine: &mut Sharded<'_, M>,
    optim: &mut ParamOptimizer,
    lr: f64,
    args: &TrainArgs,
) -> Result<StepOutcome, TrainError> {
    let mut offloaded = Ok(());
    let span = engine.shard_group();
    let outcome = engine.step(args.grad_clip, |model, grads| {
        let (model, result) = optim.step(lr, model, grads, span);
        offloaded = result;
        model
    })?;
    offloaded?;
    Ok(outcome)
}

/// Gives `device`'s empty pool pages back to the driver, once the tensors dropped so far are
/// freed (Burn's fusion queues a drop like any other operation, and its cleanup does not
/// drain the queue). A device that cannot sync keeps its pages.
fn release_free_pages(device: &Device) {
    if device.sync().is_ok() {
        device.memory_cleanup();
    }
}

/// Writes the trained model to `path` under `keys`' names: every rank joins the unit-by-unit
/// gathers, rank 0 (`lead`) writes each parameter as it arrives. Returns what the save took.
fn save<M: BlockModel>(
    engine: &Sharded<'_, M>,
    comm: &dyn Communicator,
    path: &std::path::Path,
    keys: &dyn KeyMap,
    args: &TrainArgs,
    lead: bool,
) -> Result<SaveReport, TrainError> {
    let start = Instant::now();
    // Thread ranks share the process's counter: reset once all are here, by one of them.
    peak_then_reset(comm)?;
    let before = memory::live_bytes();
    let mut saver = match lead {
        true => Some(Saver::create(path, keys, &engine.parameter_shapes())?),
        false => None,
    };
    // A failed write stops the writing, not the gathers the other ranks are in.
    let mut written: Result<(), TrainError> = Ok(());
    engine.for_each_full_parameter(|param, dims, value| {
        if let (Some(saver), Ok(())) = (saver.as_mut(), &written) {
            written = value
                .into_data()
                .try_into_vec::<f32>()
                .map_err(|e| {
                    WeightError::Save {
                        path: path.to_path_buf(),
                        reason: format!("{param}: {e:?}"),
                    }
                    .into()
                })
                .and_then(|values| {
                    TrainError::check_finite_weights(
                        param,
                        values.iter().copied(),
                        args.max_steps,
                        args.precision,
                    )?;
                    Ok(saver.put(param, dims, values)?)
                });
        }
    })?;
    written?;
    if let Some(saver) = saver {
        crate::checkpoint::finish_with_config(path, args.model_config.as_ref(), || saver.finish())?;
    }
    Ok(SaveReport {
        path: path.to_path_buf(),
        seconds: start.elapsed().as_secs_f64(),
        peak_mem_bytes: memory::measured_peak(),
        live_before_bytes: memory::is_counting().then_some(before),
    })
}

/// A batch of `rows` sequences (images), with `batch_size` the run's micro-batch per rank
/// for a training batch: at most that many (fewer for a short last batch, see
/// [`TrainTask::next_batch`]); a task built for more would train on batches the run does not record (a
/// checkpoint's global batch is the world times `--batch-size`), and an empty one cannot run
/// (a product of no rows ends some kernels' processes).
pub(crate) fn check_rows(rows: usize, batch_size: Option<usize>) -> Result<(), TrainError> {
    match batch_size {
        Some(batch_size) if rows == 0 || rows > batch_size => {
            Err(TrainError::InvalidData(format!(
                "the task's training micro-batch holds {rows} sequences, but --batch-size (TrainArgs::batch_size) is {batch_size}: build the task with the run's batch size"
            )))
        }
        None if rows == 0 => Err(TrainError::InvalidData(
            "the task's validation batch holds no sequences".into(),
        )),
        _ => Ok(()),
    }
}

/// Flag values that cannot run, and a precision `device` cannot honour; then the process's
/// matmul kernels as `--matmul` says.
fn check_args(args: &TrainArgs, device: &Device) -> Result<(), TrainError> {
    args.validate()?;
    args.matmul.select();
    if device.gradient_checkpointing_strategy().is_none() {
        return Err(TrainError::InvalidArgs(format!(
            "the device given to train, {device:?}, does not track gradients: build the model on TrainArgs::device() (or Device::autodiff()) and give train that device"
        )));
    }
    // On the CPU the ranks run on the device given; it must be the CPU's (Burn's devices
    // compare equal on hardware alone, whatever their autodiff).
    if args.runs_on() == Accelerator::Cpu && *device != Device::flex() {
        return Err(TrainError::InvalidArgs(format!(
            "--accelerator cpu runs the ranks on the device the model was built on, but that is {device:?}, not the CPU's (Flex): build it on TrainArgs::device()"
        )));
    }
    args.precision.check_device(device)?;
    if let Some(dir) = &args.checkpoint_dir {
        checkpoint::check_writable(dir)?;
    }
    Ok(())
}

/// Stops every rank, naming the flags, when the processes of an MPI world were given
/// different ones (each parses its own command line): ranks of another precision or batch
/// size would train on without a word. One all-gather of a hash per flag, of the flags as
/// given: what `--strategy auto` chose from them is compared by [`auto::agree`].
fn check_flags_alike(comm: &dyn Communicator, args: &TrainArgs) -> Result<(), TrainError> {
    use std::hash::{Hash, Hasher};
    let flags = args.shared_by_ranks();
    let hashes: Vec<u64> = flags
        .iter()
        .map(|(_, value)| {
            // Fixed keys: every process hashes alike.
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            value.hash(&mut hasher);
            hasher.finish()
        })
        .collect();
    let all = gather_u64s(comm, &hashes)?;
    let differ: Vec<String> = flags
        .iter()
        .enumerate()
        .filter_map(|(i, (flag, value))| {
            let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r][i] != all[0][i]).collect();
            (!ranks.is_empty())
                .then(|| format!("{flag} (this rank: {value}; ranks {ranks:?} differ from rank 0)"))
        })
        .collect();
    match differ.is_empty() {
        true => Ok(()),
        false => Err(TrainError::InvalidArgs(format!(
            "the MPI processes were started with different flags: {}; give every process the same",
            differ.join(", ")
        ))),
    }
}

/// The process's peak heap since it was last reset, read once every rank is there, then reset
/// for what comes next: thread ranks share the counter, and one rank's reset must not wipe a
/// peak another has yet to read, nor another's allocations after it be counted before it.
fn peak_then_reset(comm: &dyn Communicator) -> Result<usize, TrainError> {
    comm.barrier()?;
    let peak = memory::peak_bytes();
    comm.barrier()?;
    if comm
        .rank()
        .is_multiple_of(ranks_in_process(comm.world_size()))
    {
        memory::reset_peak();
    }
    comm.barrier()?;
    Ok(peak)
}

/// The median of `values` (the mean of the middle two of an even count); NaN for none.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The mean of the ranks' losses, the sums of their items and model FLOPs (each rank's part
/// of a padded batch has a length of its own), and whether any rank was asked to stop, in
/// one all-reduce.
fn over_ranks(
    comm: &dyn Communicator,
    loss: f64,
    items: usize,
    flops: f64,
    stop: bool,
) -> Result<(f64, usize, f64, bool), TrainError> {
    if comm.world_size() == 1 {
        return Ok((loss, items, flops, stop));
    }
    let mut buf = Buffer::F32(vec![
        loss as f32,
        items as f32,
        flops as f32,
        stop as u8 as f32,
    ]);
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    let sums = buf.to_f32();
    // As ReduceOp::Mean divides, in f32; items in f32 are exact below 2^24 a step.
    let loss = sums[0] / comm.world_size() as f32;
    Ok((
        loss as f64,
        sums[1].round() as usize,
        sums[2] as f64,
        sums[3] > 0.0,
    ))
}

/// Every rank's model-state bytes, process peak, device peak, planned peak and planned device
/// peak (0: none), in rank order.
fn every_rank_memory(
    comm: &dyn Communicator,
    mine: [usize; 5],
) -> Result<Vec<RankMemory>, TrainError> {
    let all = gather_u64s(comm, &mine.map(|v| v as u64))?;
    Ok(all
        .iter()
        .enumerate()
        .map(|(rank, v)| RankMemory {
            rank,
            model_state_bytes: v[0] as usize,
            peak_mem_bytes: (v[1] > 0).then_some(v[1] as usize),
            device_peak_mem_bytes: (v[2] > 0).then_some(v[2] as usize),
            planned_peak_mem_bytes: (v[3] > 0).then_some(v[3] as usize),
            planned_device_peak_mem_bytes: (v[4] > 0).then_some(v[4] as usize),
        })
        .collect())
}

/// The model's mean validation loss per item and, for a classifier, its accuracy, over
/// the whole validation set (NaN without one). The ranks split it ([`TrainTask::eval_batches`])
/// and add up their scores exactly (as f64 bits, in rank order), so every rank reports
/// the same figures, whatever the number of ranks. Every rank runs as many forwards: one
/// whose share is a batch short joins the last forward's gathers without computing.
fn evaluate<T: TrainTask>(
    comm: &dyn Communicator,
    engine: &Sharded<'_, T::Model>,
    task: &mut T,
) -> Result<(f64, Option<f64>), TrainError> {
    let (rank, world, batches) = (comm.rank(), comm.world_size(), task.eval_batches());
    let device = engine.eval_device();
    let (mut loss, mut counts) = (0.0, [0u64; 3]); // items, right answers, items answered
    for k in (rank..batches.div_ceil(world) * world).step_by(world) {
        let (input, target) = (k < batches).then(|| task.eval_batch(k, &device)).unzip();
        if let Some(input) = &input {
            check_rows(engine.extent(input)[0], None)?;
        }
        if let (Some(logits), Some(target)) = (engine.eval_logits(input)?, target) {
            let score = task.score(logits, target);
            loss += score.loss;
            counts[0] += score.items as u64;
            if let Some(correct) = score.correct {
                counts[1] += correct as u64;
                counts[2] += score.items as u64;
            }
        }
    }
    let all = gather_u64s(comm, &[loss.to_bits(), counts[0], counts[1], counts[2]])?;
    let loss: f64 = all.iter().map(|rank| f64::from_bits(rank[0])).sum();
    let sum = |i: usize| all.iter().map(|rank| rank[i]).sum::<u64>() as f64;
    let accuracy = (sum(3) > 0.0).then(|| sum(2) / sum(3));
    Ok((loss / sum(1), accuracy))
}

fn progress_bar(len: u64, show: bool) -> ProgressBar {
    let target = if show && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta}] {msg}")
    {
        bar.set_style(style);
    }
    bar
}

struct MetricsCsv {
    out: BufWriter<File>,
    path: std::path::PathBuf,
    /// The last kept row's `elapsed_s`, which a resumed run's rows go on from.
    elapsed_before: f64,
}

impl MetricsCsv {
    const HEADER: &str = "step,lr,loss,grad_norm,items_per_s,elapsed_s,skipped,val_loss,accuracy";
    /// The header until the validation columns came (2026-11-30).
    const HEADER_BEFORE_VALIDATION: &str = "step,lr,loss,grad_norm,items_per_s,elapsed_s,skipped";

    /// The file at `path`, new; or for a run resumed after step `resumed`, the rows an earlier
    /// run wrote there up to that step (those after it are retrained), continued. The kept
    /// rows go to a file beside it that then replaces it, so that a run killed meanwhile
    /// leaves the earlier file whole.
    fn open(path: &std::path::Path, resumed: Option<usize>) -> Result<Self, TrainError> {
        let earlier = match resumed {
            Some(step) if path.exists() => Self::rows_up_to(path, step)?,
            _ => Vec::new(),
        };
        let partial = burnscale_nn::weights::partial_path(path);
        let io = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| TrainError::Io { path, source }
        };
        let mut out = BufWriter::new(File::create(&partial).map_err(io(&partial))?);
        writeln!(out, "{}", Self::HEADER).map_err(io(&partial))?;
        for row in &earlier {
            writeln!(out, "{row}").map_err(io(&partial))?;
        }
        out.flush().map_err(io(&partial))?;
        std::fs::rename(&partial, path).map_err(io(path))?;
        let elapsed_before = earlier
            .last()
            .and_then(|row| row.split(',').nth(5))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0);
        Ok(Self {
            out,
            path: path.to_path_buf(),
            elapsed_before,
        })
    }

    /// The rows of the metrics file at `path` for steps up to `step`; an error for a file that
    /// is not one (it is left as it is).
    fn rows_up_to(path: &std::path::Path, step: usize) -> Result<Vec<String>, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut lines = text.split_inclusive('\n');
        // A file of a run started before the validation columns: its rows get empty ones.
        let padding = match lines.next().map(|line| line.trim_end_matches(['\n', '\r'])) {
            None | Some(Self::HEADER) => "",
            Some(Self::HEADER_BEFORE_VALIDATION) => ",,",
            Some(_) => {
                return Err(TrainError::InvalidArgs(format!(
                    "--metrics-csv {}: not a metrics file (its first line is not `{}`), which a resumed run continues: give another path",
                    path.display(),
                    Self::HEADER
                )));
            }
        };
        // Every row was written with its newline: a last one without it was cut short (a
        // full disk, a file size limit, a kill mid-write), and its numbers cannot be trusted.
        let complete = lines.filter(|row| row.ends_with('\n'));
        let rows: Vec<String> = complete
            .map(|row| row.trim_end_matches(['\n', '\r']))
            .filter(|row| {
                row.split(',')
                    .next()
                    .and_then(|s| s.parse::<usize>().ok())
                    .is_some_and(|s| s <= step)
            })
            .map(|row| format!("{row}{padding}"))
            .collect();
        if !text.is_empty() && !text.ends_with('\n') {
            eprintln!(
                "note: --metrics-csv {}: its last row was cut short when written, and is left out",
                path.display()
            );
        }
        Ok(rows)
    }

    fn write(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        writeln!(
            self.out,
            "{},{:e},{},{},{:.1},{:.3},{},{},{}",
            m.step,
            m.lr,
            m.loss,
            m.grad_norm,
            m.items_per_s,
            self.elapsed_before + m.elapsed_s,
            u8::from(m.skipped),
            // Empty on the steps that do not evaluate.
            m.val_loss.map(|v| v.to_string()).unwrap_or_default(),
            m.accuracy.map(|a| a.to_string()).unwrap_or_default(),
        )
        .and_then(|_| self.out.flush())
        .map_err(|source| TrainError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use burnscale_collective::threads::{DEFAULT_TIMEOUT, ThreadComm};

    use super::*;

    /// Processes given different flags (rank 2's precision, learning rate and `--plan`, which
    /// on a cubecl device runs collectives of its own) all stop,
    /// naming those flags and the ranks that differ; alike, they go on.
    #[test]
    fn ranks_given_different_flags_stop_naming_them() {
        let args = |flags: &[&str]| TrainArgs::from_flags(flags).unwrap();
        let ranks = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
            let flags: &[&str] = match comm.rank() {
                2 => &["--precision", "bf16-mixed", "--lr", "1e-3", "--plan"],
                _ => &[],
            };
            check_flags_alike(&comm, &args(flags)).map_err(|e| e.to_string())
        });
        for rank in ranks {
            let err = rank.unwrap().unwrap_err();
            assert!(
                err.contains("--precision")
                    && err.contains("--lr")
                    && err.contains("--plan")
                    && err.contains("ranks [2]"),
                "{err}"
            );
            assert!(!err.contains("--seed"), "{err}");
        }
        let ranks = ThreadComm::run(2, DEFAULT_TIMEOUT, |comm| {
            check_flags_alike(&comm, &args(&[])).is_ok()
        });
        assert!(ranks.into_iter().all(|r| r == Ok(true)));
    }

    /// A stop asked on one rank only (each process's own signal under mpirun) stops every
    /// rank after the same step.
    #[test]
    fn a_stop_asked_on_any_rank_stops_them_all() {
        let ranks = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
            over_ranks(&comm, 1.0, 4, 8.0, comm.rank() == 1).map(|(.., stop)| stop)
        });
        let stops: Vec<bool> = ranks.into_iter().map(|r| r.unwrap().unwrap()).collect();
        assert_eq!(stops, [true; 3]);
    }
}
