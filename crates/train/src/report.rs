//! The closing report: a human table and the `--summary-json` object.

use std::path::Path;

use serde::Serialize;

use burnscale_collective::CollectiveBytes;
use burnscale_precision::Precision;
use burnscale_shard::Sharding;

use crate::TrainError;
use crate::accelerator::Accelerator;
use crate::auto::AutoChoice;
use crate::cli::{Matmul, OptimizerKind, Strategy, TrainArgs, value_name};
use crate::device_plan::DevicePlan;
use crate::memory::human_bytes;
use crate::plan::{self, MemoryPlan};
use crate::runner::StepMetrics;

/// What one rank holds of the model states, measured by the runner.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ModelStateBytes {
    pub params: usize,
    pub grads: usize,
    /// Optimizer state in memory.
    pub optimizer: usize,
    /// Optimizer state in `--offload-dir` files (not in [`total`](Self::total)).
    pub offloaded: usize,
}

impl ModelStateBytes {
    /// Bytes in memory.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }

    /// The ZeRO paper's per-rank count for a run of `args` on `world` ranks, with the bytes
    /// this engine keeps in memory between steps: W bytes of weights (the precision's weight
    /// dtype: 4, or 2 for `*-true`; the mixed policies' 16-bit copy lives only during a
    /// micro-step) + W of gradients (held in the weight dtype) + the optimizer's state K per
    /// parameter in the weight dtype (Adam/AdamW 2 moments, SGD with momentum 1, plain SGD 0;
    /// 8-bit AdamW 2 bytes, not counting its absmax and the 32-bit state of vectors and small
    /// matrices; Adafactor its first moment's 4 bytes if it keeps one, not counting its
    /// factored moments; none under `--offload-dir`, which keeps it on disk), of which each strategy shards a
    /// part over `world` ranks: DDP none, ZeRO-1 the optimizer state, ZeRO-2 also the
    /// gradients, ZeRO-3 everything. Of `num_params`, only the `trainable` ones (not frozen)
    /// have gradients and state.
    pub fn predicted(
        num_params: usize,
        trainable: usize,
        args: &TrainArgs,
        sharding: Sharding,
        world: usize,
    ) -> usize {
        let weight = burn::tensor::DType::from(args.precision.param_dtype()).size();
        let state = match args.optimizer {
            _ if args.offload_dir.is_some() => 0,
            OptimizerKind::Adamw | OptimizerKind::Adam => 2 * weight,
            OptimizerKind::Adam8bit => 2,
            // The factored moments ((rows + cols) x 4 B per matrix) are not counted.
            OptimizerKind::Adafactor if args.beta1.is_some() => 4,
            OptimizerKind::Sgd if args.sgd_momentum() > 0.0 => weight,
            _ => 0,
        };
        let (mut replicated, mut sharded) = (0, 0);
        for (bytes, is_sharded) in [
            (num_params * weight, sharding.parameters),
            (trainable * weight, sharding.gradients),
            (trainable * state, sharding.optimizer_state),
        ] {
            match is_sharded {
                true => sharded += bytes,
                false => replicated += bytes,
            }
        }
        replicated + sharded.div_ceil(world)
    }
}

/// One rank's measured memory.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub model_state_bytes: usize,
    /// This rank's process peak; ranks that are threads of one process share it. `None`
    /// without a counting allocator ([`crate::memory::is_counting`]).
    pub peak_mem_bytes: Option<usize>,
    /// The peak of this rank's device memory ([`crate::memory::DevicePeak`]: the GPU's reservation
    /// at step ends; on a CPU the process peak again). `None` where it is not read: on
    /// LibTorch, whose allocator burnscale cannot read, and without a counting allocator.
    pub device_peak_mem_bytes: Option<usize>,
    /// The planner's prediction of `peak_mem_bytes`, when a plan was made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_peak_mem_bytes: Option<usize>,
    /// The device plan's prediction of `device_peak_mem_bytes` (`--plan` on a cubecl device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_device_peak_mem_bytes: Option<usize>,
}

/// Items a second, as the task counts them (tokens, or samples), and model FLOPs a second
/// ([`burnscale_nn::flops`]): MFU's numerator.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    pub items_per_s: f64,
    pub counts_tokens: bool,
    pub model_flops_per_s: f64,
    /// How many ranks share one device, and so its measured peak: a process's thread ranks
    /// on a CPU (one probe, all the cores); 1 where each rank has a device of its own.
    pub ranks_per_device: usize,
}

/// Everything a run reports; serialised as the `--summary-json` object.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Where the ranks ran.
    pub accelerator: Accelerator,
    pub strategy: Strategy,
    /// How many blocks recomputed their forward in backward (per-block checkpointing; frozen
    /// blocks below the lowest that trains run once, and are not counted).
    pub recomputed_blocks: usize,
    /// zero3: whether gathered units were dropped after forward (FSDP2's
    /// `reshard_after_forward`); absent where nothing is gathered (a rank alone computing
    /// with its shards as they are: [`burnscale_shard::Sharding::acting_on`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reshard_after_forward: Option<bool>,
    pub precision: Precision,
    /// Whose kernels computed the linear layers (`--matmul`).
    pub matmul: Matmul,
    pub world_size: usize,
    pub optimizer: OptimizerKind,
    /// The last step taken.
    pub steps: usize,
    /// The first step this run took: 1, or a resumed run's checkpoint step + 1 (the times,
    /// throughput and transfers count this run's steps only).
    pub first_step: usize,
    /// The steps the throughput and `step_s_median` count: this run's after its first, or a
    /// run of one step its one.
    pub timed_steps: usize,
    pub final_loss: f64,
    pub val_loss: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Seconds of training: from the first step's start to the end of the last step, its
    /// checkpoint and the evaluations on the way included, the final evaluation not.
    pub elapsed_s: f64,
    /// Median optimizer-step time over the `timed_steps` (without evaluations).
    pub step_s_median: f64,
    /// The first optimizer step's time (on a GPU it compiles and tunes the kernels); the
    /// throughput leaves it out when there are later steps.
    pub warmup_s: f64,
    /// Peak live heap bytes of this process during training (counting allocator); `None` in
    /// a program without one ([`crate::memory::is_counting`]).
    pub peak_mem_bytes: Option<usize>,
    pub num_params: usize,
    /// The parameters that train: `num_params` less the frozen ones.
    pub trainable_params: usize,
    pub model_state_bytes_per_rank: usize,
    pub model_state: ModelStateBytes,
    /// Which formula `model_state_predicted_bytes` uses.
    pub model_state_convention: &'static str,
    pub model_state_predicted_bytes: usize,
    /// Every rank's model states and process peak.
    pub ranks: Vec<RankMemory>,
    /// Throughput of the steps after the first (see `warmup_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// The loss scale at the end (`16-mixed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Optimizer steps the loss scaler skipped because gradients overflowed, over the whole
    /// training (a resumed run's include those before its checkpoint). Their forward and
    /// backward ran, so the throughput counts them; `--metrics-csv` marks each.
    pub skipped_steps: usize,
    /// Bytes of model states (parameters, gradients, optimizer state) moved between the
    /// device and host memory per optimizer step on this rank, the mean over the steps
    /// (`burnscale_shard::host::transferred_bytes`): 0 unless `--offload` or `--offload-dir`
    /// put them on the host. Counted the same on every backend, so a CPU run shows what a
    /// GPU run moves.
    pub host_transfer_bytes_per_step: u64,
    /// The bytes of this rank's collectives per optimizer step, by kind (the mean over the
    /// steps, evaluations left out; `burnscale_collective::Counted`): an all-reduce's
    /// buffer, an all-gather's whole output, a reduce-scatter's whole input, in the dtype
    /// they travel in; `volume` counts them as the ZeRO paper does (an all-reduce twice).
    pub collective_bytes_per_step: CollectiveBytes,
    /// Measured GEMM rate of the device in the precision's compute dtype, FLOP/s; `None`
    /// where the probe could not time its work (`speed::peak_gemm_flops`).
    pub peak_flops: Option<f64>,
    /// Model FLOPs a second of one rank (`burnscale_nn::flops`, over the steps the throughput
    /// counts): torchtitan's and nanoGPT's achieved rate, MFU's numerator.
    pub model_flops_per_s: f64,
    /// Every optimizer step's numbers, in order (also written to `--metrics-csv`).
    #[serde(skip)]
    pub history: Vec<StepMetrics>,
    /// The model FLOPs a second of the ranks that share a device (`model_flops_per_s`, times
    /// the thread ranks of a CPU process) over its `peak_flops` (PaLM's and nanoGPT's count:
    /// 6 per non-embedding weight per position plus attention's 12·L·d per query and key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// What `--save` took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save: Option<SaveReport>,
    /// The memory planner's prediction (`--plan`, or with `--summary-json`), made before the
    /// first step: the process peak beside `peak_mem_bytes`, and its terms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_peak_mem_bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<MemoryPlan>,
    /// The device plan (`--plan` on a cubecl device): the dry run's reading, made before the
    /// first step, beside this rank's `device_peak_mem_bytes` in `ranks`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_plan: Option<DevicePlan>,
    /// What `--strategy auto` chose within `--memory-budget`, and the faster candidates it
    /// passed over (each planned above the budget).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto: Option<AutoChoice>,
    /// What checkpointing (`--checkpoint-dir`) took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<CheckpointReport>,
    /// The flags the run trained with (`--strategy auto`'s choice in place of `auto`; the
    /// learning rate, weight decay and schedule as the optimizer's defaults resolved them):
    /// [`TrainArgs::from_json`] of this object trains the same configuration again.
    pub args: TrainArgs,
    /// The model's configuration as the program gave it ([`TrainArgs::model_config`]; with
    /// the data it reads, for the examples).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_config: Option<serde_json::Value>,
}

/// Checkpoints saved and loaded in a run, as this rank saw them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckpointReport {
    /// The step the run resumed from (`--resume`), and the seconds loading took.
    pub resumed_from: Option<usize>,
    /// The schedule's and the optimizer's flags this run set otherwise than the checkpoint's
    /// run, as `--lr 0.01, this run 0.02` (this run's are followed from the checkpoint on).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed_flags: Vec<String>,
    pub load_s: f64,
    pub saves: usize,
    /// Bytes of the last checkpoint, over all ranks' files.
    pub bytes: u64,
    /// Seconds spent saving, in all.
    pub save_s: f64,
    /// This process's highest live heap while saving (left out of `peak_mem_bytes`); `None`
    /// without a counting allocator.
    pub save_peak_mem_bytes: Option<usize>,
}

/// The end-of-training save (`--save`), as this rank saw it.
#[derive(Debug, Clone, Serialize)]
pub struct SaveReport {
    pub path: std::path::PathBuf,
    pub seconds: f64,
    /// This process's peak live heap while saving, and what was live when it began: the
    /// difference is what saving added (one unit's full values, and rank 0's one-parameter
    /// write buffer). `None` without a counting allocator.
    pub peak_mem_bytes: Option<usize>,
    pub live_before_bytes: Option<usize>,
}

/// What the report says of a process peak where nothing counted it.
const NOT_COUNTED: &str = "not measured (no counting allocator installed)";
/// What the rows of a step say for a run that took none (resumed at its last step).
const NO_STEP: &str = "none in this run (resumed at --max-steps)";

impl RunSummary {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        args: &TrainArgs,
        world_size: usize,
        first_step: usize,
        history: Vec<StepMetrics>,
        val_loss: f64,
        accuracy: Option<f64>,
        elapsed_s: f64,
        step_s_median: f64,
        peak_mem_bytes: Option<usize>,
        num_params: usize,
        model_state: ModelStateBytes,
        ranks: Vec<RankMemory>,
        throughput: Throughput,
        peak_flops: Option<f64>,
    ) -> Self {
        let (tokens_per_s, samples_per_s) = match throughput.counts_tokens {
            true => (Some(throughput.items_per_s), None),
            false => (None, Some(throughput.items_per_s)),
        };
        let model_flops_per_s = throughput.model_flops_per_s / world_size as f64;
        // Against one device's peak, what the ranks on that device achieved together.
        // Oversubscribed processes, each probing its own share of the cores, stay an
        // underestimate.
        let mfu =
            peak_flops.map(|peak| model_flops_per_s * throughput.ranks_per_device as f64 / peak);
        let sharding = args.acting_sharding(world_size).ok();
        Self {
            accelerator: args.runs_on(),
            strategy: args.strategy,
            recomputed_blocks: 0,
            reshard_after_forward: sharding
                .filter(|s| s.parameters)
                .map(|s| s.reshard_after_forward),
            precision: args.precision,
            matmul: args.matmul,
            world_size,
            optimizer: args.optimizer,
            // A run resumed at its last step takes none: its steps are the checkpoint's.
            steps: history.last().map_or(first_step - 1, |m| m.step),
            first_step,
            timed_steps: 0,
            final_loss: history.last().map_or(f64::NAN, |m| m.loss),
            val_loss,
            accuracy,
            elapsed_s,
            step_s_median,
            warmup_s: f64::NAN,
            peak_mem_bytes,
            num_params,
            trainable_params: num_params,
            model_state_bytes_per_rank: model_state.total(),
            model_state,
            model_state_convention: "ZeRO paper: weight-dtype params + weight-dtype grads + optimizer state in the weight dtype (none under --offload-dir) per parameter, the strategy's part divided by the world size",
            model_state_predicted_bytes: 0,
            ranks,
            tokens_per_s,
            samples_per_s,
            loss_scale: None,
            skipped_steps: 0,
            host_transfer_bytes_per_step: 0,
            collective_bytes_per_step: CollectiveBytes::default(),
            peak_flops,
            model_flops_per_s,
            mfu,
            save: None,
            planned_peak_mem_bytes: None,
            plan: None,
            device_plan: None,
            auto: None,
            checkpoints: None,
            // The settings as resolved (a default written out reads back as itself).
            args: TrainArgs {
                stop: None,
                on_step: None,
                model_config: None,
                lr: Some(args.lr()),
                weight_decay: Some(args.weight_decay()),
                schedule: Some(args.schedule()),
                ..args.clone()
            },
            model_config: args.model_config.clone(),
            history,
        }
    }

    /// Puts this process's memory plan (when one was made) beside the measured peak.
    pub(crate) fn set_plan(&mut self, plan: Option<MemoryPlan>) {
        self.planned_peak_mem_bytes = plan.as_ref().map(|p| p.process_peak);
        self.plan = plan;
    }

    pub(crate) fn set_device_plan(&mut self, plan: Option<DevicePlan>) {
        self.device_plan = plan;
    }

    pub fn write_json(&self, path: &Path) -> Result<(), TrainError> {
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        let json = serde_json::to_string_pretty(self).map_err(|e| io(e.into()))?;
        std::fs::write(path, json + "\n").map_err(io)
    }

    /// The Fabric article's closing lines of a finetuning run: time, peak memory, test
    /// accuracy.
    pub fn closing_lines(&self) -> String {
        let accuracy = match self.accuracy {
            Some(acc) => format!("{:.2}%", 100.0 * acc),
            None => "not measured".to_string(),
        };
        let memory = match self.peak_mem_bytes {
            Some(peak) => format!("{:.2} GB (peak heap of this process)", peak as f64 / 1e9),
            None => NOT_COUNTED.to_string(),
        };
        format!(
            "Time elapsed {:.2} min\nMemory used: {memory}\nTest accuracy {accuracy}\n",
            self.elapsed_s / 60.0,
        )
    }

    /// The closing table.
    pub fn table(&self) -> String {
        // A run resumed at its last step takes none: it evaluates and saves.
        let stepped = self.steps >= self.first_step;
        let mut rows: Vec<(&str, String)> = vec![
            ("time elapsed", format!("{:.1} s", self.elapsed_s)),
            (
                "first step",
                match (stepped, self.steps > self.first_step) {
                    (false, _) => NO_STEP.into(),
                    (true, true) => format!("{:.2} s (not in the throughput)", self.warmup_s),
                    (true, false) => format!("{:.2} s (the throughput's only step)", self.warmup_s),
                },
            ),
            (
                "memory used (peak, process)",
                match (self.peak_mem_bytes, self.accelerator) {
                    (None, _) => NOT_COUNTED.into(),
                    // LibTorch allocates in C++, past the counting allocator.
                    (Some(peak), Accelerator::Libtorch) => format!(
                        "{} of Rust's heap; LibTorch's tensors not counted (read nvidia-smi)",
                        human_bytes(peak)
                    ),
                    (Some(peak), _) => human_bytes(peak),
                },
            ),
            (
                "memory planned (peak, process)",
                // A plan is made only where the peak is measured.
                match self.planned_peak_mem_bytes.zip(self.peak_mem_bytes) {
                    Some((planned, measured)) => format!(
                        "{} ({:+.1}% of the measured)",
                        human_bytes(planned),
                        100.0 * plan::off(planned, measured)
                    ),
                    None if self.accelerator == Accelerator::Cpu => "no plan (--plan)".into(),
                    None => format!(
                        "not planned on {} (the host's planner plans CPU runs)",
                        self.accelerator.name()
                    ),
                },
            ),
        ];
        let device_peak = self.ranks.first().and_then(|r| r.device_peak_mem_bytes);
        if let Some(peak) = device_peak.filter(|_| self.accelerator.is_cubecl()) {
            rows.push((
                "device memory (peak, rank 0)",
                format!("{} reserved in cubecl's pools", human_bytes(peak)),
            ));
            rows.push((
                "device memory planned",
                match &self.device_plan {
                    Some(plan) => format!(
                        "{} ({:+.1}% of the measured; a dry run's)",
                        human_bytes(plan.peak),
                        100.0 * plan::off(plan.peak, peak)
                    ),
                    None => "no plan (--plan)".into(),
                },
            ));
        }
        rows.extend([
            (
                "model states per rank",
                format!(
                    "{} (params {} + grads {} + optimizer {}); formula {}",
                    human_bytes(self.model_state.total()),
                    human_bytes(self.model_state.params),
                    human_bytes(self.model_state.grads),
                    human_bytes(self.model_state.optimizer),
                    human_bytes(self.model_state_predicted_bytes),
                ),
            ),
            (
                "parameters",
                match self.num_params - self.trainable_params {
                    0 => format!("{}", self.num_params),
                    frozen => format!("{} ({frozen} frozen)", self.num_params),
                },
            ),
            (
                "ranks",
                format!(
                    "{} ({}{}{})",
                    self.world_size,
                    value_name(self.strategy),
                    match (self.reshard_after_forward, self.strategy == Strategy::Zero3) {
                        (Some(false), _) => ", kept gathered from forward to backward",
                        (Some(true), _) => ", resharded after forward, gathered again for backward",
                        (None, true) => ", alone: its shards are its whole parameters, one graph",
                        _ => "",
                    },
                    match self.recomputed_blocks {
                        0 => String::new(),
                        1 => ", 1 block recomputed".into(),
                        n => format!(", {n} blocks recomputed"),
                    }
                ),
            ),
            (
                "steps",
                match (self.first_step, stepped) {
                    (1, _) => format!("{}", self.steps),
                    (first, true) => format!(
                        "{} (resumed from step {}: {first}-{} in this run)",
                        self.steps,
                        first - 1,
                        self.steps
                    ),
                    (_, false) => format!(
                        "{} (resumed from step {}: none in this run)",
                        self.steps, self.steps
                    ),
                },
            ),
            (
                "final train loss",
                match stepped {
                    true => format!("{:.4}", self.final_loss),
                    false => NO_STEP.into(),
                },
            ),
            ("validation loss", format!("{:.4}", self.val_loss)),
        ]);
        if self.model_state.offloaded > 0 {
            rows.push((
                "optimizer state on disk",
                human_bytes(self.model_state.offloaded),
            ));
        }
        let c = self.collective_bytes_per_step;
        if c.volume() > 0 {
            rows.push((
                "collectives per step",
                format!(
                    "{} volume (all-reduce {}, reduce-scatter {}, all-gather {}, broadcast {})",
                    human_bytes(c.volume() as usize),
                    human_bytes(c.all_reduce as usize),
                    human_bytes(c.reduce_scatter as usize),
                    human_bytes(c.all_gather as usize),
                    human_bytes(c.broadcast as usize)
                ),
            ));
        }
        rows.push((
            "host transfers per step",
            format!(
                "{} (model states moved to or from host memory: offload only)",
                human_bytes(self.host_transfer_bytes_per_step as usize)
            ),
        ));
        if let Some(scale) = self.loss_scale {
            rows.push((
                "loss scale",
                format!(
                    "{scale} ({} steps skipped{}; their forward and backward ran, and count in the throughput)",
                    self.skipped_steps,
                    match self.first_step {
                        1 => String::new(),
                        _ => format!(
                            ", {} in this run",
                            self.history.iter().filter(|m| m.skipped).count()
                        ),
                    }
                ),
            ));
        }
        if let Some(acc) = self.accuracy {
            rows.push(("test accuracy", format!("{:.2}%", 100.0 * acc)));
        }
        if let Some(t) = self.tokens_per_s.filter(|_| stepped) {
            rows.push(("throughput", format!("{t:.0} tokens/s")));
        }
        if let Some(s) = self.samples_per_s.filter(|_| stepped) {
            rows.push(("throughput", format!("{s:.1} samples/s")));
        }
        let dtype = burn::tensor::DType::from(self.precision.compute_dtype()).name();
        let achieved = self.model_flops_per_s / 1e9;
        match (self.mfu, self.peak_flops) {
            _ if !stepped => {}
            (Some(mfu), Some(peak)) => rows.push((
                "MFU",
                format!(
                    "{:.1}%: {achieved:.1} GFLOP/s of model FLOPs a rank, of measured peak GEMM {:.1} GFLOP/s ({dtype})",
                    100.0 * mfu,
                    peak / 1e9,
                ),
            )),
            _ => rows.push((
                "MFU",
                format!(
                    "not measured: the GEMM probe's time ({dtype}) did not grow with its work; {achieved:.1} GFLOP/s of model FLOPs a rank"
                ),
            )),
        }
        if let Some(save) = &self.save {
            let memory = match save.peak_mem_bytes.zip(save.live_before_bytes) {
                Some((peak, before)) => format!(
                    " (peak {} while saving, {} more than before)",
                    human_bytes(peak),
                    human_bytes(peak.saturating_sub(before))
                ),
                None => String::new(),
            };
            rows.push((
                "saved",
                format!("{} in {:.2} s{memory}", save.path.display(), save.seconds),
            ));
        }
        if let Some(c) = &self.checkpoints {
            if let Some(step) = c.resumed_from {
                rows.push((
                    "resumed",
                    format!("from step {step}, loaded in {:.2} s", c.load_s),
                ));
            }
            if c.saves > 0 {
                rows.push((
                    "checkpoints",
                    format!(
                        "{} saved in {:.2} s ({} each, {:.2} GB/s){}",
                        c.saves,
                        c.save_s,
                        human_bytes(c.bytes as usize),
                        (c.saves as f64 * c.bytes as f64) / c.save_s / 1e9,
                        c.save_peak_mem_bytes
                            .map(|peak| format!(", peak {} while saving", human_bytes(peak)))
                            .unwrap_or_default()
                    ),
                ));
            }
        }
        aligned(&rows)
    }
}

/// `key  value` lines with the values in one column.
pub(crate) fn aligned(rows: &[(impl AsRef<str>, String)]) -> String {
    let width = rows
        .iter()
        .map(|(k, _)| k.as_ref().len())
        .max()
        .unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{:<width$}  {v}\n", k.as_ref()))
        .collect()
}
