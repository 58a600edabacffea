//! The one CLI every training example shares: techniques switch with flags, never with code.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Serialize;

use burnscale_precision::Precision;

use crate::accelerator::Accelerator;
use crate::{OnStep, StopFlag, TrainError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Single,
    Ddp,
    Zero1,
    Zero2,
    #[value(alias = "fsdp")]
    Zero3,
    /// The fastest configuration the memory planner says fits `--memory-budget` (on a cubecl
    /// device, its memory where no budget is given; chosen by
    /// [`crate::train`] before any rank starts, or on a cubecl device by the ranks before
    /// their engines are built; see [`crate::auto`]).
    Auto,
}

impl Strategy {
    /// The engine's strategy (`single` is DDP on one rank); `auto` has none until it is
    /// chosen.
    pub fn engine(self) -> Result<burnscale_shard::Strategy, TrainError> {
        Ok(match self {
            Strategy::Single | Strategy::Ddp => burnscale_shard::Strategy::Ddp,
            Strategy::Zero1 => burnscale_shard::Strategy::Zero1,
            Strategy::Zero2 => burnscale_shard::Strategy::Zero2,
            Strategy::Zero3 => burnscale_shard::Strategy::Zero3,
            Strategy::Auto => {
                return Err(TrainError::InvalidArgs(
                    "--strategy auto is chosen from --memory-budget by burnscale::train before any rank starts (on a cubecl device, by the ranks' dry runs); train_on on the CPU and the host planner take a chosen strategy".into(),
                ));
            }
        })
    }
}

/// What a checkpointed block keeps for its re-run in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointMode {
    /// Its input alone.
    Full,
    /// Its input and its linear layers' outputs.
    Selective,
}

impl CheckpointMode {
    /// The engine's mode.
    pub fn engine(self) -> burnscale_shard::CheckpointMode {
        match self {
            CheckpointMode::Full => burnscale_shard::CheckpointMode::Full,
            CheckpointMode::Selective => burnscale_shard::CheckpointMode::Selective,
        }
    }
}

/// Whose kernels compute the models' linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Matmul {
    /// The backend's own matmul (cubecl's on a GPU).
    Backend,
    /// cuBLAS's GEMM, on cubecl's stream (`cuda` only; burnscale_nn::gemm).
    Cublas,
}

impl Matmul {
    /// Makes this process's linear layers run these kernels (a process-wide switch).
    pub fn select(self) {
        burnscale_nn::gemm::use_cublas(self == Matmul::Cublas);
    }
}

/// The dtype gradients are reduced in over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    F32,
    Bf16,
    F16,
}

impl ReduceDtype {
    pub fn dtype(self) -> burnscale_collective::DType {
        match self {
            ReduceDtype::F32 => burnscale_collective::DType::F32,
            ReduceDtype::Bf16 => burnscale_collective::DType::Bf16,
            ReduceDtype::F16 => burnscale_collective::DType::F16,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    None,
    Optimizer,
    Params,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Adam,
    Sgd,
    Adafactor,
    Adam8bit,
}

impl OptimizerKind {
    /// Whether this optimizer decays a second moment by `--beta2` (Adafactor's decay follows
    /// the step instead).
    pub fn has_beta2(self) -> bool {
        matches!(
            self,
            OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Cosine,
}

/// Training flags, flattened into each example's own `clap` parser. Serialised, they are the
/// JSON object [`TrainArgs::from_json`] reads back to the same flags (the summary's `args`);
/// what is set by a program rather than by a flag is left out.
#[derive(Debug, Clone, Args, Serialize)]
pub struct TrainArgs {
    /// Where ranks run: cpu, or cuda (rank i on GPU i; under mpirun the node-local rank's
    /// GPU; collectives over NCCL), or cubecl-cpu (a cubecl-cpu build: the GPU backends'
    /// runtime, compiled for the CPU), or libtorch (a tch build: LibTorch's GPU i, or its
    /// CPU). Default: cuda in a cuda build on a machine with a GPU, else cpu.
    #[arg(long, value_enum)]
    pub accelerator: Option<Accelerator>,
    /// Whose kernels compute the models' linear layers: backend (its own matmul), or cublas
    /// (cuBLAS's GEMM; --accelerator cuda only; not the default: its products are checked on
    /// a GPU, but no step has yet been faster with them).
    #[arg(long, value_enum, default_value = "backend")]
    pub matmul: Matmul,
    /// Parallelism: single, ddp, zero1, zero2, zero3 (alias fsdp), or auto: the fastest
    /// strategy and checkpointing (the optimizer state on disk too where --offload-dir is
    /// given; and, only when nothing else fits, bf16) that the memory planner says fits
    /// --memory-budget (on cuda and cubecl-cpu: the device's memory
    /// when no budget is given).
    #[arg(long, value_enum, default_value = "single")]
    pub strategy: Strategy,
    /// In-process ranks (under mpirun the world comes from MPI, one rank per process: more
    /// than 1 there is refused).
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Seconds a rank waits for the others in one collective (the default is PyTorch's for
    /// NCCL process groups, 10 min; a rank that panics inside an NCCL collective leaves the
    /// others waiting that long). Then the run stops with an error naming the ranks that never
    /// came: under mpirun and NCCL the process ends; among thread ranks, a
    /// rank still running as long again (at least 10 s) after the others timed out waiting for
    /// it, stuck outside any collective, ends the process.
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = parse_seconds)]
    #[serde(serialize_with = "seconds")]
    pub collective_timeout: Duration,
    /// Numeric precision: 32-true; 16-mixed and bf16-mixed (f32 master weights, 16-bit
    /// compute, f32 softmax/norm/loss; 16-mixed scales the loss); 16-true and bf16-true
    /// (weights, activations and optimizer state in 16 bits).
    #[arg(long, value_enum, default_value = "32-true")]
    pub precision: Precision,
    /// The dtype gradients are reduced in over the ranks.
    #[arg(long, value_enum, default_value = "f32")]
    pub grad_reduce_dtype: ReduceDtype,
    /// 16-mixed: the loss scale to start from [default: 65536, PyTorch's GradScaler].
    #[arg(long)]
    pub initial_loss_scale: Option<f64>,
    /// 16-mixed: stop after this many consecutive steps skipped for overflowing gradients
    /// [default: once a skip takes the loss scale below 1: 17 skips from 65536].
    #[arg(long)]
    pub max_consecutive_skips: Option<usize>,
    /// Create the model's parameters directly in the precision's weight dtype, one at a
    /// time, never as a full f32 model first (Fabric's init_module).
    #[arg(long)]
    pub init_on_device: bool,
    /// Per-block activation checkpointing: each block keeps only its input in forward and is
    /// recomputed in backward.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Per-block activation checkpointing of the lowest N blocks only (Megatron's
    /// --recompute-method block --recompute-num-layers N; torchtitan's selective layer
    /// checkpointing): the blocks above keep their graphs, so a run holds activations between
    /// none checkpointed and all, and recomputes only N blocks' forward
    #[arg(long, value_name = "N", conflicts_with = "checkpoint_activations")]
    pub checkpoint_blocks: Option<usize>,
    /// What a checkpointed block keeps for its re-run in backward: full (its input alone;
    /// backward runs its whole forward again) or selective (its input and its linear layers'
    /// outputs, selective checkpointing by op: backward runs again all but the linears'
    /// products, for more memory than full and less than none). With --strategy auto, the
    /// mode of the checkpointing it chooses
    #[arg(long, value_enum, default_value = "full")]
    pub checkpoint_mode: CheckpointMode,
    /// zero3: whether each unit's gathered parameters are dropped after its forward and
    /// gathered again for its backward (true, FSDP2's default: a block's graph keeps its
    /// activations, not its weights), or kept gathered with their graph until the unit's
    /// backward ends (false: one all-gather per unit a micro-step, for the whole model's
    /// parameters held during forward and backward; FSDP2's reshard_after_forward=False). A rank alone
    /// whose units compute with its shards as they are (32-true, bf16-true, not offloaded)
    /// has nothing to gather or drop, and runs its whole model as one graph either way.
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub reshard_after_forward: Option<bool>,
    /// Keep optimizer state (optimizer: every strategy) and also ZeRO-3's parameter shards
    /// (params) in host memory, and step the optimizer there.
    #[arg(long, value_enum, default_value = "none")]
    pub offload: Offload,
    /// Keep the optimizer state in files under this directory between steps
    /// (ZeRO-Infinity's disk offload; implies --offload optimizer). Each rank of each run
    /// uses a fresh `rank<N>-XXXXXX` subdirectory, removed at the end.
    #[arg(long)]
    pub offload_dir: Option<PathBuf>,
    /// adamw, adam, sgd, adafactor (factored second moments, no first: HF's Adafactor), or
    /// adam8bit (AdamW with both moments block-wise quantized to 8 bits, as bitsandbytes'
    /// AdamW8bit; 32-bit state for vectors and for tensors of fewer than --min-8bit-size
    /// elements).
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    /// With --optimizer adam8bit, the fewest elements a matrix has for its state to be
    /// quantized (bitsandbytes' min_8bit_size; default 4096).
    #[arg(long)]
    pub min_8bit_size: Option<usize>,
    /// With --optimizer adafactor: steps of min(--lr, 1/sqrt(t)) times each parameter's RMS
    /// (HF's relative_step and scale_parameter) instead of --lr itself. --lr then defaults to
    /// 1e-2 and --schedule to constant, each on its own: HF's step where neither is given and
    /// there is no warm-up (the examples give one: --warmup-steps 0).
    #[arg(long)]
    pub adafactor_relative_step: bool,
    /// With --optimizer adam8bit, keep embedding tables' state in 32 bits (bitsandbytes'
    /// advice for its StableEmbedding).
    #[arg(long)]
    pub embedding_state_32bit: bool,
    /// Parameters that do not train, comma-separated, each a parameter's path or a prefix of
    /// whole path components (`blocks.0` freezes every parameter of block 0, not of block 01):
    /// they get no gradient and no optimizer state and keep their values, as PyTorch's frozen
    /// parameters (`requires_grad_(False)`). A model may also freeze its own with Burn's
    /// `set_require_grad(false)`.
    #[arg(long, value_delimiter = ',')]
    pub freeze: Vec<String>,
    /// Peak learning rate (default 5e-4; mingpt_char's 2e-3, the finetuning examples' 1e-4;
    /// under --adafactor-relative-step the cap on the relative step, default HF's 1e-2).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Weight decay, applied to rank >= 2 parameters only: matrices and embeddings (as
    /// nanoGPT; minGPT also spares embeddings). Decoupled from the gradient for adamw,
    /// adam8bit and adafactor; for adam and sgd an L2 term added to it, as torch.optim's
    /// Adam and SGD do. Default: 0.1 for adamw and adam8bit (nanoGPT's), 0 for the others
    /// (torch.optim's and HF's Adafactor's); the finetuning examples' for every optimizer.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// The first moment's decay: Adam and AdamW's beta1 (default 0.9); Adafactor keeps a
    /// first moment only when it is given.
    #[arg(long)]
    pub beta1: Option<f64>,
    /// The second moment's decay: Adam, AdamW and adam8bit's beta2 (default 0.95; the
    /// finetuning examples' 0.999).
    #[arg(long)]
    pub beta2: Option<f64>,
    /// Adam, AdamW and adam8bit's epsilon, added to the root of the second moment (default
    /// 1e-8, torch.optim's; HF's `adam_epsilon`): an element whose gradient is well below it
    /// steps in proportion to its gradient, not by its sign.
    #[arg(long)]
    pub adam_epsilon: Option<f64>,
    /// SGD's momentum (default 0.9; 0 disables it).
    #[arg(long)]
    pub momentum: Option<f64>,
    /// cosine, or constant (the default under --adafactor-relative-step, whose step decays by
    /// itself).
    #[arg(long, value_enum)]
    pub schedule: Option<Schedule>,
    /// Linear warm-up steps before the schedule.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    /// Final learning rate of the cosine schedule, as a fraction of --lr (default 0.1).
    #[arg(long)]
    pub min_lr_ratio: Option<f64>,
    /// Micro-batch size per rank.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Micro-batches accumulated into one optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1000)]
    pub max_steps: usize,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Clip the global gradient norm to this value (0 disables clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// Evaluate every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub eval_interval: usize,
    /// Print the memory planner's predicted per-rank peak, term by term, before the first step
    /// (and the measured peak beside it at the end; a summary JSON of a CPU run carries both
    /// where the program installs the counting allocator, as the examples do). On --accelerator cuda and cubecl-cpu the plan is the device's, by a dry run of
    /// the steps; not on libtorch.
    #[arg(long)]
    pub plan: bool,
    /// The most memory one rank may take (on a CPU: this process's heap over the ranks it
    /// hosts; on cuda and cubecl-cpu: its device's pools, which cubecl-cpu's thread ranks
    /// share), e.g. 1.5GiB, 800MB, 16G: checked
    /// against the memory planner before the first step (a configuration planned above it
    /// stops there, naming what to change), and what --strategy auto chooses within. On cuda
    /// and cubecl-cpu every plan is also checked against the device's memory, which bounds
    /// the budget and is the budget when none is given.
    #[arg(long, value_parser = crate::memory::parse_bytes)]
    pub memory_budget: Option<usize>,
    /// Write machine-readable results here.
    #[arg(long)]
    pub summary_json: Option<PathBuf>,
    /// Write one CSV row of metrics per optimizer step here (step, lr, loss, grad_norm,
    /// items_per_s, elapsed_s, skipped; val_loss and accuracy on the steps that evaluate).
    #[arg(long)]
    pub metrics_csv: Option<PathBuf>,
    /// Save the trained model here as safetensors, in the layout its loader reads (`--weights`;
    /// HF names). Rank 0 writes it one unit at a time: under zero3 no rank holds the whole model.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write sharded checkpoints (every rank its rows of the parameters and optimizer state,
    /// with the step, schedule, scaler, data and dropout positions) under this directory.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N optimizer steps (0: only at the end of training).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,
    /// Keep only the newest K complete checkpoints (older ones are removed once a new one is
    /// complete).
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Continue from the newest complete checkpoint in --checkpoint-dir (at any world size and
    /// strategy); without one, start from step 0.
    #[arg(long)]
    pub resume: bool,
    /// Hand the trained model back whole from `train` under zero3 too (a gather of the whole
    /// model on every rank, for programs that use it after training). The other strategies
    /// always hand back their replica.
    #[arg(skip)]
    #[serde(skip)]
    pub gather_model: bool,
    /// Stops the run after the step in which it is raised (see [`StopFlag`]); the training
    /// examples raise it on Ctrl-C and SIGTERM.
    #[arg(skip)]
    #[serde(skip)]
    pub stop: Option<StopFlag>,
    /// Called on rank 0 with each step's numbers (see [`OnStep`]).
    #[arg(skip)]
    #[serde(skip)]
    pub on_step: Option<OnStep>,
    /// The model's configuration (any JSON object; the examples give their model's config),
    /// written into each checkpoint's metadata: a run that resumes with another
    /// configuration is stopped with the fields that differ, which the parameter shapes
    /// alone would miss (a head count, a dropout rate).
    #[arg(skip)]
    #[serde(skip)]
    pub model_config: Option<serde_json::Value>,
}

/// `duration` as its number of seconds, as `--collective-timeout` reads it.
fn seconds<S: serde::Serializer>(duration: &Duration, to: S) -> Result<S::Ok, S::Error> {
    to.serialize_f64(duration.as_secs_f64())
}

/// A finite number of seconds, at least a millisecond and at most
/// 1e9 (a timeout's parser: past ~9.2e18 s a deadline overflows).
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("{text:?} is not a number of seconds: {e}"))?;
    match (1e-3..=burnscale_collective::MAX_TIMEOUT.as_secs_f64()).contains(&seconds) {
        true => Ok(Duration::from_secs_f64(seconds)),
        false => Err(format!(
            "{text:?}: give a number of seconds, at least 0.001 and at most {}",
            burnscale_collective::MAX_TIMEOUT.as_secs()
        )),
    }
}

/// The peak learning rate when `--lr` is not given.
pub const LR: f64 = 5e-4;

/// The cap on Adafactor's relative step when `--lr` is not given (HF's).
pub const RELATIVE_STEP_LR: f64 = 1e-2;

/// AdamW's and adam8bit's weight decay when `--weight-decay` is not given (nanoGPT's); the
/// other optimizers' is 0.
pub const ADAMW_WEIGHT_DECAY: f64 = 0.1;

/// Adam's and AdamW's first-moment decay when `--beta1` is not given.
pub const ADAM_BETA1: f64 = 0.9;

/// Adam's and AdamW's second-moment decay when `--beta2` is not given (nanoGPT's).
pub const ADAM_BETA2: f64 = 0.95;

/// Adam's, AdamW's and adam8bit's epsilon when `--adam-epsilon` is not given (torch.optim's).
pub const ADAM_EPSILON: f64 = 1e-8;

/// Adam's, AdamW's and adam8bit's hyperparameters besides the learning rate and weight decay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamSettings {
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
}

/// SGD's momentum when `--momentum` is not given.
pub const SGD_MOMENTUM: f64 = 0.9;

/// The cosine schedule's final learning rate, as a fraction of `--lr`, when `--min-lr-ratio`
/// is not given.
pub const MIN_LR_RATIO: f64 = 0.1;

/// The fewest elements a matrix has for adam8bit's 8-bit state when `--min-8bit-size` is not
/// given (bitsandbytes' default).
pub const MIN_8BIT_SIZE: usize = 4096;

impl TrainArgs {
    /// These arguments with `config` as the model's configuration
    /// ([`TrainArgs::model_config`]).
    pub fn with_model_config(&self, config: &impl Serialize) -> Result<Self, serde_json::Error> {
        Ok(Self {
            model_config: Some(serde_json::to_value(config)?),
            ..self.clone()
        })
    }

    /// [`TrainArgs::with_model_config`] with what the run reads as its data under `data`
    /// (the dataset, its held-out share, a length limit): a run resumed on other data or
    /// another split would train on what it had tested on, so it is stopped too.
    pub fn with_model_and_data(
        &self,
        config: &impl Serialize,
        data: serde_json::Value,
    ) -> Result<Self, serde_json::Error> {
        let mut recorded = serde_json::to_value(config)?;
        if let Some(fields) = recorded.as_object_mut() {
            fields.insert("data".to_string(), data);
        }
        self.with_model_config(&recorded)
    }

    /// Runner flags from a list of arguments (without a program name), as a binary's parser
    /// would read them; a flag given twice takes its last value. For embedding the runner
    /// and for tests.
    pub fn from_flags(flags: &[&str]) -> Result<Self, clap::Error> {
        #[derive(clap::Parser)]
        #[command(args_override_self = true)]
        struct Flags {
            #[command(flatten)]
            train: TrainArgs,
        }
        let argv = std::iter::once("burnscale").chain(flags.iter().copied());
        <Flags as clap::Parser>::try_parse_from(argv).map(|f| f.train)
    }

    /// Runner flags from a JSON object of them, for a service that takes its jobs as JSON:
    /// each key a flag's name (`max_steps` or `max-steps` for `--max-steps`), each value a
    /// string, a number or a boolean (`true` gives a switch such as `--resume`, `false` leaves
    /// it out; `null` leaves any flag out). Read by the same parser as [`Self::from_flags`],
    /// so a key or value it refuses is an error naming it.
    pub fn from_json(flags: &serde_json::Value) -> Result<Self, TrainError> {
        let invalid = |message: String| TrainError::InvalidArgs(message);
        let object = flags
            .as_object()
            .ok_or_else(|| invalid(format!("runner flags must be a JSON object, not {flags}")))?;
        let command = <Self as Args>::augment_args(clap::Command::new("burnscale"));
        let mut argv = Vec::new();
        for (key, value) in object {
            let flag = format!("--{}", key.replace('_', "-"));
            let switch = command
                .get_arguments()
                .find(|arg| arg.get_long() == Some(&flag[2..]))
                .is_some_and(|arg| matches!(arg.get_action(), clap::ArgAction::SetTrue));
            match value {
                serde_json::Value::Null => {}
                serde_json::Value::Bool(true) if switch => argv.push(flag),
                serde_json::Value::Bool(false) if switch => {}
                // `--flag=value`: a value that starts with '-' (-0.1) is not read as a flag.
                serde_json::Value::Bool(b) => argv.push(format!("{flag}={b}")),
                serde_json::Value::Number(n) => argv.push(format!("{flag}={n}")),
                serde_json::Value::String(text) => argv.push(format!("{flag}={text}")),
                // A list flag (`--freeze`): its values comma-separated, none when empty.
                serde_json::Value::Array(items) if items.iter().all(|v| v.is_string()) => {
                    let items: Vec<&str> = items.iter().filter_map(|v| v.as_str()).collect();
                    if !items.is_empty() {
                        argv.push(format!("{flag}={}", items.join(",")));
                    }
                }
                other => {
                    return Err(invalid(format!(
                        "runner flag {key:?}: give a string, a number, a boolean or a list of strings, not {other}"
                    )));
                }
            }
        }
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        Self::from_flags(&argv).map_err(|e| {
            // clap's message without its usage lines, which name a program there is not.
            let message = e.to_string();
            let kept: Vec<&str> = message
                .lines()
                .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more"))
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .collect();
            invalid(kept.join("; ").trim_start_matches("error: ").to_string())
        })
    }

    /// Adam's, AdamW's and adam8bit's settings: the flags, or their defaults.
    pub fn adam(&self) -> AdamSettings {
        AdamSettings {
            beta1: self.beta1.unwrap_or(ADAM_BETA1),
            beta2: self.beta2.unwrap_or(ADAM_BETA2),
            epsilon: self.adam_epsilon.unwrap_or(ADAM_EPSILON),
        }
    }

    /// The peak learning rate: `--lr`, or its default (under a relative step, HF's cap).
    pub fn lr(&self) -> f64 {
        let relative = self.adafactor_relative_step;
        self.lr
            .unwrap_or(if relative { RELATIVE_STEP_LR } else { LR })
    }

    /// The weight decay: `--weight-decay`, or this optimizer's default.
    pub fn weight_decay(&self) -> f64 {
        let adamw = matches!(
            self.optimizer,
            OptimizerKind::Adamw | OptimizerKind::Adam8bit
        );
        self.weight_decay
            .unwrap_or(if adamw { ADAMW_WEIGHT_DECAY } else { 0.0 })
    }

    /// The schedule: `--schedule`, or constant under Adafactor's relative step (as HF's,
    /// whose step decays by itself), cosine otherwise.
    pub fn schedule(&self) -> Schedule {
        let relative = self.adafactor_relative_step;
        self.schedule.unwrap_or(if relative {
            Schedule::Constant
        } else {
            Schedule::Cosine
        })
    }

    /// These arguments with `--lr` defaulting to `lr` where none was given and the step is
    /// not relative (whose cap keeps HF's default): a program's own default.
    pub fn with_default_lr(mut self, lr: f64) -> Self {
        if !self.adafactor_relative_step {
            self.lr = self.lr.or(Some(lr));
        }
        self
    }

    /// SGD's momentum: `--momentum`, or its default.
    pub fn sgd_momentum(&self) -> f64 {
        self.momentum.unwrap_or(SGD_MOMENTUM)
    }

    /// These arguments with `--beta2` defaulting to `beta2` where the optimizer has a second
    /// moment and none was given: a program's own default (the finetuning examples take
    /// 0.999, as HF's Trainer), which an optimizer without a beta2 does not refuse.
    pub fn with_default_beta2(mut self, beta2: f64) -> Self {
        if self.optimizer.has_beta2() {
            self.beta2 = self.beta2.or(Some(beta2));
        }
        self
    }

    /// Refuses an optimizer or schedule setting that this configuration would not read.
    fn check_every_flag_is_read(&self) -> Result<(), TrainError> {
        let optimizer = value_name(self.optimizer);
        let unread = [
            (
                "--beta1",
                self.beta1.is_some() && self.optimizer == OptimizerKind::Sgd,
                format!("--optimizer {optimizer}, which has no moment estimates"),
            ),
            (
                "--beta2",
                self.beta2.is_some() && !self.optimizer.has_beta2(),
                format!("--optimizer {optimizer}, which keeps no second moment by beta2"),
            ),
            (
                "--adam-epsilon",
                self.adam_epsilon.is_some() && !self.optimizer.has_beta2(),
                format!("--optimizer {optimizer}, which is not one of Adam's"),
            ),
            (
                "--momentum",
                self.momentum.is_some() && self.optimizer != OptimizerKind::Sgd,
                format!("--optimizer {optimizer}: it is sgd's (adam's is --beta1)"),
            ),
            (
                "--min-lr-ratio",
                self.min_lr_ratio.is_some() && self.schedule() != Schedule::Cosine,
                format!(
                    "--schedule {}{}, which does not anneal",
                    value_name(self.schedule()),
                    match self.schedule {
                        None => " (--adafactor-relative-step's default)",
                        Some(_) => "",
                    }
                ),
            ),
        ];
        match unread.into_iter().find(|(_, unread, _)| *unread) {
            Some((flag, _, why)) => Err(TrainError::InvalidArgs(format!(
                "{flag} is not read under {why}"
            ))),
            None => Ok(()),
        }
    }

    /// What the chosen strategy shards, with `--reshard-after-forward` applied.
    pub fn sharding(&self) -> Result<burnscale_shard::Sharding, TrainError> {
        let mut sharding = self.strategy.engine()?.sharding();
        if let Some(reshard) = self.reshard_after_forward {
            sharding.reshard_after_forward = reshard;
        }
        Ok(sharding)
    }

    /// The blocks `--checkpoint-activations` or `--checkpoint-blocks` checkpoint.
    pub fn checkpointing(&self) -> burnscale_shard::Checkpointing {
        use burnscale_shard::Checkpointing;
        match (self.checkpoint_activations, self.checkpoint_blocks) {
            (true, _) => Checkpointing::All,
            (false, Some(n)) => Checkpointing::Lowest(n),
            (false, None) => Checkpointing::None,
        }
    }

    /// [`TrainArgs::sharding`] as it acts on each of `world` ranks
    /// ([`burnscale_shard::Sharding::acting_on`]).
    pub fn acting_sharding(&self, world: usize) -> Result<burnscale_shard::Sharding, TrainError> {
        let (cast, offloaded) = (self.precision.is_mixed(), self.offload == Offload::Params);
        Ok(self.sharding()?.acting_on(world, cast, offloaded))
    }

    /// The flags every rank of a run takes alike, each as its name and its value (under mpirun
    /// each process parses its own command line), as given (`--strategy auto`'s choices are
    /// compared apart). Paths are compared as given or not: a node may keep its files
    /// elsewhere; so is the model's configuration, which names them (a data directory), its
    /// shapes being checked by the collectives.
    pub(crate) fn shared_by_ranks(&self) -> Vec<(&'static str, String)> {
        let given = |path: &Option<PathBuf>| path.is_some().to_string();
        vec![
            // cpu against cubecl-cpu; a cuda process is inside NCCL's set-up by then, where
            // the collectives' own call check stops both sides.
            ("--accelerator", self.runs_on().name()),
            ("--matmul", value_name(self.matmul)),
            ("--strategy", value_name(self.strategy)),
            // On a cubecl device the plan is a dry run of collectives.
            ("--plan", self.plan.to_string()),
            ("--memory-budget", format!("{:?}", self.memory_budget)),
            ("--precision", self.precision.to_string()),
            ("--grad-reduce-dtype", value_name(self.grad_reduce_dtype)),
            (
                "--initial-loss-scale",
                format!("{:?}", self.initial_loss_scale),
            ),
            (
                "--max-consecutive-skips",
                format!("{:?}", self.max_consecutive_skips),
            ),
            ("--init-on-device", self.init_on_device.to_string()),
            (
                "--checkpoint-activations",
                self.checkpoint_activations.to_string(),
            ),
            (
                "--checkpoint-blocks",
                format!("{:?}", self.checkpoint_blocks),
            ),
            ("--checkpoint-mode", value_name(self.checkpoint_mode)),
            (
                "--reshard-after-forward",
                format!("{:?}", self.reshard_after_forward),
            ),
            ("--offload", value_name(self.offload)),
            ("--offload-dir (given or not)", given(&self.offload_dir)),
            ("--optimizer", value_name(self.optimizer)),
            (
                "--adafactor-relative-step",
                self.adafactor_relative_step.to_string(),
            ),
            ("--lr", format!("{:?}", self.lr())),
            ("--weight-decay", format!("{:?}", self.weight_decay())),
            ("--beta1", format!("{:?}", self.beta1)),
            ("--beta2", format!("{:?}", self.beta2)),
            ("--adam-epsilon", format!("{:?}", self.adam_epsilon)),
            ("--momentum", format!("{:?}", self.momentum)),
            ("--schedule", value_name(self.schedule())),
            ("--warmup-steps", self.warmup_steps.to_string()),
            ("--min-lr-ratio", format!("{:?}", self.min_lr_ratio)),
            ("--batch-size", self.batch_size.to_string()),
            ("--accumulate", self.accumulate.to_string()),
            ("--max-steps", self.max_steps.to_string()),
            ("--seed", self.seed.to_string()),
            ("--grad-clip", format!("{:?}", self.grad_clip)),
            ("--eval-interval", self.eval_interval.to_string()),
            ("--checkpoint-every", self.checkpoint_every.to_string()),
            ("--resume", self.resume.to_string()),
            ("--min-8bit-size", format!("{:?}", self.min_8bit_size)),
            (
                "--embedding-state-32bit",
                self.embedding_state_32bit.to_string(),
            ),
            ("--freeze", self.freeze.join(",")),
            (
                "--checkpoint-dir (given or not)",
                given(&self.checkpoint_dir),
            ),
            ("--save (given or not)", given(&self.save)),
            (
                "the whole model kept at the end",
                self.gather_model.to_string(),
            ),
        ]
    }

    /// Whether the run's memory is planned before it starts: `--plan`, `--memory-budget`, or
    /// `--strategy auto` (which chooses by the plans).
    pub fn plans_memory(&self) -> bool {
        self.plan || self.memory_budget.is_some() || self.strategy == Strategy::Auto
    }

    /// Whether the plan is of a cubecl device's pools, by a dry run of the steps
    /// ([`crate::device_plan`]), rather than of host memory.
    pub fn plans_device(&self) -> bool {
        self.plans_memory() && self.runs_on().is_cubecl()
    }

    /// The steps that reach this run's peak: the first, and unless the run is that step alone
    /// (not resumed: a resumed run holds its optimizer's state from the start), the second,
    /// whose forward and backward run beside the state the optimizer made in the first, as
    /// every later step's do.
    pub fn steps_to_peak(&self) -> usize {
        match self.max_steps > 1 || self.resume {
            true => 2,
            false => 1,
        }
    }

    /// Why this run's memory cannot be planned (`--plan`, `--memory-budget`, `auto`), if it cannot:
    /// LibTorch's allocator is out of the planner's sight, and a dry run on a cubecl device
    /// cannot follow a loss scaler.
    pub fn unplannable(&self) -> Option<String> {
        let accelerator = self.runs_on();
        if accelerator == Accelerator::Libtorch {
            return Some(
                "--plan, --memory-budget and --strategy auto: LibTorch allocates in C++, where the planner cannot read; plan on --accelerator cpu, cuda or cubecl-cpu".into(),
            );
        }
        (accelerator.is_cubecl() && self.precision.scales_loss()).then(|| format!(
            "--plan, --memory-budget and --strategy auto on --accelerator {}: --precision {} decides each step from its gradients' values (the loss scaler skips overflowing steps), which the plan's dry run does not compute; plan bf16-mixed or 32-true instead",
            accelerator.name(),
            self.precision
        ))
    }

    /// Where the ranks run: `--accelerator`, or its default on this machine.
    pub fn runs_on(&self) -> Accelerator {
        Accelerator::or_default(self.accelerator)
    }

    /// What `--offload` cannot do where the ranks' device is the host (a CPU run): save
    /// device memory. The moves are still made and counted, as on a GPU; `--offload-dir`
    /// still moves the state to disk.
    pub fn offload_note(&self) -> Option<String> {
        let on = self.runs_on();
        (self.offload != Offload::None && self.offload_dir.is_none() && !on.on_gpu()).then(|| {
            format!(
                "--offload {} on --accelerator {}: the ranks' device is the host, so moving to it saves no memory; the moves are made and counted (host_transfer_bytes_per_step) as on a GPU",
                value_name(self.offload),
                on.name()
            )
        })
    }

    /// Where the model is built: `--accelerator`'s first device, with autodiff.
    pub fn device(&self) -> Result<burn::prelude::Device, TrainError> {
        self.runs_on().first_device()
    }

    /// Refuses `--init-on-device` for a model whose weights `source` (a flag and its value)
    /// loads from a file: they are read whole in f32 before the run casts them, the full f32
    /// model the flag exists to avoid, so it would do nothing.
    pub fn check_loaded_weights(&self, source: &str) -> Result<(), TrainError> {
        match self.init_on_device {
            true => Err(TrainError::InvalidArgs(format!(
                "--init-on-device creates the model's parameters from its initialisers in 16 bits, but {source} loads them whole in f32 first: drop --init-on-device, or train from scratch"
            ))),
            false => Ok(()),
        }
    }

    /// [`TrainArgs::validate`], and the flags against the world this process was launched
    /// into (`--devices`, or mpirun's): what [`crate::train`] checks first, for a binary to
    /// call before its slow set-up (fetching weights, tokenizing a corpus).
    pub fn validate_launch(&self) -> Result<(), TrainError> {
        self.validate()?;
        self.check_launched_world()
    }

    /// [`TrainArgs::check_world`] against the world this process was launched into, where it
    /// is known.
    pub(crate) fn check_launched_world(&self) -> Result<(), TrainError> {
        burnscale_collective::check_devices(self.devices)?;
        match crate::auto::launched_world(self) {
            Some(world) => self.check_world(world),
            None => Ok(()),
        }
    }

    /// The flags that need more than one rank, or exactly one, against a `world` of ranks.
    pub(crate) fn check_world(&self, world: usize) -> Result<(), TrainError> {
        if self.strategy == Strategy::Single && world > 1 {
            return Err(TrainError::InvalidArgs(format!(
                "--strategy single trains on one rank, but the world has {world}: choose ddp, zero1, zero2 or zero3"
            )));
        }
        if self.grad_reduce_dtype != ReduceDtype::F32 && world == 1 {
            return Err(TrainError::InvalidArgs(format!(
                "--grad-reduce-dtype {} is the dtype gradients are reduced in over the ranks, but the world has one rank: nothing is reduced (drop the flag)",
                value_name(self.grad_reduce_dtype)
            )));
        }
        if self.reshard_after_forward.is_some()
            && self.strategy == Strategy::Zero3
            && !self.acting_sharding(world)?.parameters
        {
            return Err(TrainError::InvalidArgs(format!(
                "--reshard-after-forward chooses when zero3 drops the parameters it gathered, but a rank alone computing in its weights' dtype (--precision {}, not offloaded) gathers nothing: its whole model runs as one graph either way (drop the flag)",
                self.precision
            )));
        }
        Ok(())
    }

    /// Rejects flag values that cannot run, and those whose technique has not landed yet,
    /// instead of silently ignoring them.
    pub fn validate(&self) -> Result<(), TrainError> {
        let accelerator = self.runs_on();
        let invalid = |msg: String| Err(TrainError::InvalidArgs(msg));
        if self.plans_memory()
            && let Some(why) = self.unplannable()
        {
            return invalid(why);
        }
        if self.matmul == Matmul::Cublas
            && (accelerator != Accelerator::Cuda || !burnscale_nn::gemm::HAS_CUBLAS)
        {
            return invalid(format!(
                "--matmul cublas runs cuBLAS on a GPU: it needs --accelerator cuda in a `cuda` build (--accelerator is {})",
                accelerator.name()
            ));
        }
        accelerator.check(self.devices)?;
        if self.matmul == Matmul::Cublas && !burnscale_nn::gemm::cublas_library_found() {
            return invalid(
                "--matmul cublas: cuBLAS's library (libcublas.so) was not found: install CUDA's cuBLAS (or PyPI's nvidia-cublas wheel) and put its directory on LD_LIBRARY_PATH".into(),
            );
        }
        if self.checkpoint_blocks == Some(0) {
            return invalid(
                "--checkpoint-blocks 0 checkpoints nothing: leave it out, or give at least 1"
                    .into(),
            );
        }
        if self.checkpoint_mode != CheckpointMode::Full
            && self.checkpointing() == burnscale_shard::Checkpointing::None
            && self.strategy != Strategy::Auto
        {
            return invalid(format!(
                "--checkpoint-mode {} says what checkpointed blocks keep: give --checkpoint-activations or --checkpoint-blocks N",
                value_name(self.checkpoint_mode)
            ));
        }
        if self.adafactor_relative_step && self.optimizer != OptimizerKind::Adafactor {
            return invalid(format!(
                "--adafactor-relative-step sets Adafactor's step size; --optimizer is {}",
                value_name(self.optimizer)
            ));
        }
        if (self.embedding_state_32bit || self.min_8bit_size.is_some())
            && self.optimizer != OptimizerKind::Adam8bit
        {
            return invalid(format!(
                "--embedding-state-32bit and --min-8bit-size choose which state adam8bit keeps in 8 bits; --optimizer {} has no 8-bit state",
                value_name(self.optimizer)
            ));
        }
        if self.strategy == Strategy::Auto
            && self.memory_budget.is_none()
            && !accelerator.is_cubecl()
        {
            return invalid(format!(
                "--strategy auto chooses what fits a memory budget: give --memory-budget (e.g. 8GiB per rank; on --accelerator cuda or cubecl-cpu it defaults to the device's memory, here it is {})",
                accelerator.name()
            ));
        }
        // Under auto the choice may be 16-bit weights; the other runs' weights are f32 as
        // built.
        if self.init_on_device
            && self.strategy != Strategy::Auto
            && !self.precision.has_16bit_weights()
        {
            return invalid(format!(
                "--init-on-device creates the parameters in the weights' dtype, but --precision {} keeps f32 weights, as they are built: drop the flag, or train in bf16-true or 16-true",
                self.precision
            ));
        }
        if self.offload == Offload::Params
            && !matches!(self.strategy, Strategy::Zero3 | Strategy::Auto)
        {
            return invalid(format!(
                "--offload params keeps ZeRO-3's parameter shards in host memory between uses, so it needs --strategy zero3 (got {}); --offload optimizer works with every strategy",
                value_name(self.strategy)
            ));
        }
        if (self.offload == Offload::Optimizer || self.offload_dir.is_some())
            && self.optimizer == OptimizerKind::Sgd
            && self.sgd_momentum() == 0.0
        {
            return invalid(format!(
                "{} keeps the optimizer's state off the device, but SGD without momentum keeps none: drop the flag (or give SGD a --momentum)",
                match self.offload_dir.is_some() {
                    true => "--offload-dir",
                    false => "--offload optimizer",
                }
            ));
        }
        if self.reshard_after_forward.is_some()
            && !matches!(self.strategy, Strategy::Zero3 | Strategy::Auto)
        {
            return invalid(format!(
                "--reshard-after-forward chooses when zero3 drops the parameters it gathered, but --strategy {} keeps whole parameters",
                value_name(self.strategy)
            ));
        }
        if self.batch_size == 0 || self.accumulate == 0 || self.max_steps == 0 || self.devices == 0
        {
            return invalid(format!(
                "--batch-size, --accumulate, --max-steps and --devices must be at least 1 (got {}, {}, {}, {})",
                self.batch_size, self.accumulate, self.max_steps, self.devices
            ));
        }
        // What the flag's parser refuses, for arguments built in code.
        if !(Duration::from_millis(1)..=burnscale_collective::MAX_TIMEOUT)
            .contains(&self.collective_timeout)
        {
            return invalid(format!(
                "--collective-timeout must be at least 0.001 s and at most {} s, got {:?}",
                burnscale_collective::MAX_TIMEOUT.as_secs(),
                self.collective_timeout
            ));
        }
        let lr = self.lr();
        if !(lr > 0.0 && lr <= 1.0) {
            return invalid(format!("--lr must be in (0, 1], got {lr}"));
        }
        if lr as f32 == 0.0 {
            return invalid(format!(
                "--lr {lr:e} is 0 in f32, the optimizers' dtype: nothing would train"
            ));
        }
        if let Some(ratio) = self.min_lr_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
            return invalid(format!("--min-lr-ratio must be in [0, 1], got {ratio}"));
        }
        self.check_every_flag_is_read()?;
        for (flag, given) in [
            ("--initial-loss-scale", self.initial_loss_scale.is_some()),
            (
                "--max-consecutive-skips",
                self.max_consecutive_skips.is_some(),
            ),
        ] {
            if given && self.precision != Precision::F16Mixed {
                return invalid(format!(
                    "{flag} applies to the loss scaler of --precision 16-mixed, not {}",
                    self.precision
                ));
            }
        }
        if self.max_consecutive_skips == Some(0) {
            return invalid("--max-consecutive-skips must be at least 1".into());
        }
        // Below 1 a scale shrinks the f16 gradients it exists to keep from underflowing (at
        // 1e-8 every one was 0, and nothing trained).
        if let Some(scale) = self
            .initial_loss_scale
            .filter(|s| !(s.is_finite() && *s >= 1.0))
        {
            return invalid(format!(
                "--initial-loss-scale must be at least 1 and finite, got {scale:e}"
            ));
        }
        // NaN fails this too: a comparison with it is false.
        let usable = |v: f64| v >= 0.0 && v.is_finite();
        if !(usable(self.grad_clip) && usable(self.weight_decay())) {
            return invalid(format!(
                "--grad-clip and --weight-decay must be finite and not negative (got {} and {})",
                self.grad_clip,
                self.weight_decay()
            ));
        }
        // As torch.optim refuses them: a beta of 1 divides Adam's bias correction by 0.
        for (flag, value) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            if let Some(value) = value.filter(|v| !(0.0..1.0).contains(v)) {
                return invalid(format!("{flag} must be in [0, 1), got {value}"));
            }
        }
        // A zero epsilon divides a zero second moment (a parameter no gradient reached) by 0;
        // the optimizers step in f32, where 1e-50 is 0 and 1e39 infinite (every step 0).
        let in_f32 = |e: f64| (e as f32).is_finite() && e as f32 > 0.0;
        if let Some(epsilon) = self.adam_epsilon.filter(|&e| !in_f32(e)) {
            return invalid(format!(
                "--adam-epsilon must be above 0 and finite in f32, got {epsilon}"
            ));
        }
        if let Some(momentum) = self.momentum.filter(|&m| !usable(m)) {
            return invalid(format!(
                "--momentum must be finite and not negative (0 disables it), got {momentum}"
            ));
        }
        if self.checkpoint_dir.is_none()
            && (self.resume || self.checkpoint_every > 0 || self.keep_checkpoints.is_some())
        {
            return invalid(
                "--resume, --checkpoint-every and --keep-checkpoints need --checkpoint-dir".into(),
            );
        }
        if self.keep_checkpoints == Some(0) {
            return invalid("--keep-checkpoints must be at least 1".into());
        }
        // The directory may not exist yet, but what exists of its path must be directories.
        if let Some(dir) = &self.checkpoint_dir
            && let Some(existing) = dir.ancestors().find(|a| a.exists())
            && !existing.is_dir()
        {
            return invalid(format!(
                "--checkpoint-dir {}: {} is not a directory",
                dir.display(),
                existing.display()
            ));
        }
        // A checkpoint holds none: `--resume` would find none in it and start again there.
        if let Some(dir) = &self.checkpoint_dir
            && crate::checkpoint::is_checkpoint(dir)
        {
            // `step-N` is held by `.`, and `.` (or `dir/.`) by its parent.
            let holder = dir
                .canonicalize()
                .ok()
                .and_then(|d| d.parent().map(std::path::Path::to_path_buf));
            let holder = holder.unwrap_or_else(|| dir.join(".."));
            return invalid(format!(
                "--checkpoint-dir {} is a checkpoint, not a directory of them: give the one that holds it, {} (--resume goes on from the newest there)",
                dir.display(),
                holder.display()
            ));
        }
        // A new run beside an earlier run's checkpoints would mix with them: `--resume` would
        // take the newest of either, and `--keep-checkpoints` prunes by step, its own first.
        if let Some(dir) = self.checkpoint_dir.as_ref().filter(|_| !self.resume)
            && let Ok(Some((step, _))) = crate::checkpoint::newest(dir)
        {
            return invalid(format!(
                "--checkpoint-dir {} holds an earlier run's checkpoint (step {step}): give --resume to continue it, or a new directory",
                dir.display()
            ));
        }
        // Checked before training, not found out after it; where they are written (rank 0's
        // process: another node need not have the directory).
        let written_here = burnscale_collective::launcher_rank() == 0;
        // The checkpoint directory, created at the start: a file given its path could not be
        // written at the end, and one inside it may be written where it does not exist yet.
        let checkpoints = self
            .checkpoint_dir
            .as_deref()
            .filter(|_| written_here)
            .map(resolved_path);
        let mut outputs: Vec<(&str, PathBuf)> = checkpoints
            .iter()
            .map(|dir| ("--checkpoint-dir", dir.clone()))
            .collect();
        for (flag, path) in [
            ("--save", &self.save),
            ("--summary-json", &self.summary_json),
            ("--metrics-csv", &self.metrics_csv),
        ] {
            let Some(path) = path.as_ref().filter(|_| written_here) else {
                continue;
            };
            let dir = parent_dir(path);
            if path.is_dir() {
                return invalid(format!(
                    "{flag} {}: a directory, where a file is to be written",
                    path.display()
                ));
            }
            // Made, and its writability checked, when the run starts.
            let in_checkpoints = !dir.exists() && checkpoints.as_ref() == Some(&resolved_path(dir));
            if !in_checkpoints && !dir.is_dir() {
                return invalid(format!(
                    "{flag} {}: {} is not a directory",
                    path.display(),
                    dir.display()
                ));
            }
            // The summary is written in place (an existing file, `/dev/stdout`, is opened);
            // the others are written beside their place and renamed into it.
            let (probed, writable) = match flag == "--summary-json" && path.exists() {
                true => (
                    path.as_path(),
                    std::fs::OpenOptions::new()
                        .append(true)
                        .open(path)
                        .map(drop),
                ),
                false if in_checkpoints => (dir, Ok(())),
                false => (dir, crate::checkpoint::probe_writable(dir)),
            };
            if let Err(e) = writable {
                return invalid(format!(
                    "{flag} {}: {} cannot be written ({e})",
                    path.display(),
                    probed.display()
                ));
            }
            // One path for two outputs: the later would overwrite the earlier (the weights).
            let file = resolved_path(path);
            let mut written = vec![(flag, file.clone())];
            if flag == "--save" {
                // The configuration written beside the weights.
                let config = crate::checkpoint::config_path(&file);
                written.push(("--save's configuration", config));
            }
            for (flag, file) in written {
                if let Some((other, _)) = outputs.iter().find(|(_, f)| *f == file) {
                    return invalid(format!(
                        "{other} and {flag} name the same path, {}: give each its own",
                        file.display()
                    ));
                }
                outputs.push((flag, file));
            }
        }
        Ok(())
    }
}

/// The directory `path` is in (`.` for a bare name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// `path` with its directory resolved (links, `..`), where that directory exists: two paths
/// to one place compare equal.
fn resolved_path(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default();
    parent_dir(path)
        .canonicalize()
        .map(|dir| dir.join(name))
        .unwrap_or_else(|_| {
            path.components()
                .filter(|c| *c != std::path::Component::CurDir)
                .collect()
        })
}

/// The name a value has on the command line.
pub fn value_name<T: ValueEnum>(value: T) -> String {
    value
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<TrainArgs, String> {
        TrainArgs::from_flags(flags).map_err(|e| e.to_string())
    }

    /// Why `flags`, which parse, are refused.
    fn refused(flags: &[&str]) -> String {
        parse(flags).unwrap().validate().unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_valid() {
        parse(&[]).unwrap().validate().unwrap();
    }

    /// A JSON job reads as its flags would: keys in either spelling, switches by booleans,
    /// a boolean that takes a value as its value; what the parser refuses is an error naming
    /// the key or the value, without clap's usage lines.
    #[test]
    fn json_flags_read_as_the_command_line_does() {
        let json = serde_json::json!({
            "strategy": "zero3",
            "precision": "bf16-mixed",
            "max_steps": 7,
            "lr": 0.002,
            "checkpoint-activations": true,
            "resume": false,
            "reshard_after_forward": false,
            "memory_budget": null,
        });
        let from_json = TrainArgs::from_json(&json).unwrap();
        let from_flags = parse(&[
            "--strategy",
            "zero3",
            "--precision",
            "bf16-mixed",
            "--max-steps",
            "7",
            "--lr",
            "0.002",
            "--checkpoint-activations",
            "--reshard-after-forward",
            "false",
        ])
        .unwrap();
        assert_eq!(format!("{from_json:?}"), format!("{from_flags:?}"));
        // A negative number is a value, not a flag (that validation then names).
        let negative = TrainArgs::from_json(&serde_json::json!({"weight_decay": -0.1})).unwrap();
        assert_eq!(negative.weight_decay, Some(-0.1));
        for (json, says) in [
            (
                serde_json::json!({"max_step": 7}),
                "unexpected argument '--max-step'",
            ),
            (
                serde_json::json!({"strategy": "zero4"}),
                "invalid value 'zero4' for '--strategy",
            ),
            (
                serde_json::json!({"devices": [1, 2]}),
                "\"devices\": give a string",
            ),
            (serde_json::json!(["--resume"]), "must be a JSON object"),
        ] {
            let err = TrainArgs::from_json(&json).unwrap_err().to_string();
            assert!(
                err.contains(says) && !err.contains("Usage"),
                "{json}: {err}"
            );
        }
    }

    /// Serialised arguments (the summary's `args`) read back to the same arguments: every
    /// flag given (two that exclude each other in two runs), none at its default, so a flag
    /// left out of the object or written in a form the parser reads otherwise shows.
    #[test]
    fn arguments_written_as_json_read_back_the_same() {
        let flags = "--accelerator cpu --matmul cublas --strategy zero3 --devices 3 \
             --collective-timeout 2.5 --precision bf16-mixed --grad-reduce-dtype bf16 \
             --initial-loss-scale 1024 --max-consecutive-skips 9 --init-on-device \
             --checkpoint-activations --checkpoint-mode selective --reshard-after-forward false \
             --offload optimizer \
             --offload-dir /tmp/off --optimizer adam8bit --min-8bit-size 77 \
             --adafactor-relative-step --embedding-state-32bit --freeze wte,h.0 --lr 0.00123 --weight-decay \
             0.05 --beta1 0.8 --beta2 0.99 --adam-epsilon 1e-6 --momentum 0.5 --schedule \
             constant --warmup-steps 4 --min-lr-ratio 0.2 --batch-size 5 --accumulate 2 \
             --max-steps 11 --seed 7 --grad-clip 0.5 --eval-interval 3 --plan --memory-budget \
             1.5GiB --summary-json s.json --metrics-csv m.csv --save w.safetensors \
             --checkpoint-dir ck --checkpoint-every 2 --keep-checkpoints 3 --resume";
        let blocks = flags.replace("--checkpoint-activations", "--checkpoint-blocks 3");
        let defaults = format!("{:?}", parse(&[]).unwrap());
        let command = <TrainArgs as Args>::augment_args(clap::Command::new("burnscale"));
        let mut at_default: Option<Vec<String>> = None;
        for flags in [flags, blocks.as_str()] {
            let args = parse(&flags.split_whitespace().collect::<Vec<_>>()).unwrap();
            let json = serde_json::to_value(&args).unwrap();
            let read = TrainArgs::from_json(&json).unwrap();
            assert_eq!(format!("{read:?}"), format!("{args:?}"), "{json}");
            let fields = json.as_object().unwrap();
            assert_eq!(
                fields.len(),
                command.get_arguments().count(),
                "a flag is missing from the JSON"
            );
            let here: Vec<String> = fields
                .iter()
                .filter(|(key, value)| {
                    let alone = serde_json::json!({ key.as_str(): value });
                    format!("{:?}", TrainArgs::from_json(&alone).unwrap()) == defaults
                })
                .map(|(key, _)| key.clone())
                .collect();
            at_default = Some(match at_default {
                None => here,
                Some(before) => before.into_iter().filter(|k| here.contains(k)).collect(),
            });
        }
        assert_eq!(at_default, Some(Vec::new()), "at their defaults in both");
    }

    #[test]
    fn a_collective_timeout_is_a_positive_number_of_seconds() {
        let args = parse(&["--collective-timeout", "2.5"]).unwrap();
        assert_eq!(args.collective_timeout, Duration::from_millis(2500));
        for (given, says) in [
            ("0", "at least 0.001"),
            ("1e-12", "at least 0.001"),
            ("-3", "at least 0.001"),
            ("inf", "at least 0.001"),
            ("ten", "is not a number of seconds"),
            ("1e19", "at most 1000000000"),
        ] {
            let err = parse(&[&format!("--collective-timeout={given}")]).unwrap_err();
            assert!(err.contains(says), "{given}: {err}");
        }
        let mut args = parse(&[]).unwrap();
        for refused in [Duration::ZERO, Duration::from_secs(10_000_000_000)] {
            args.collective_timeout = refused;
            let err = args.validate().unwrap_err().to_string();
            assert!(err.contains("--collective-timeout"), "{err}");
        }
    }

    #[test]
    fn optimizer_flags_need_their_optimizer() {
        let err = refused(&["--adafactor-relative-step"]);
        assert!(err.contains("adafactor"), "{err}");
        for flags in [
            &["--embedding-state-32bit"][..],
            &["--min-8bit-size", "256"],
        ] {
            let err = refused(flags);
            assert!(err.contains("adam8bit"), "{err}");
        }
    }

    #[test]
    fn values_an_optimizer_cannot_step_with_are_refused() {
        for (flags, says) in [
            (&["--beta1", "1"][..], "--beta1 must be in [0, 1), got 1"),
            (&["--beta2", "1.5"], "--beta2 must be in [0, 1), got 1.5"),
            (&["--beta2=-0.1"], "--beta2 must be in [0, 1)"),
            (&["--adam-epsilon", "0"], "--adam-epsilon must be above 0"),
            (
                &["--adam-epsilon", "1e-50"],
                "--adam-epsilon must be above 0",
            ),
            (
                &["--adam-epsilon", "1e39"],
                "--adam-epsilon must be above 0",
            ),
            (
                &["--optimizer", "sgd", "--momentum=-0.5"],
                "--momentum must be finite and not negative",
            ),
            (&["--grad-clip", "NaN"], "--grad-clip and --weight-decay"),
            (&["--weight-decay", "inf"], "--grad-clip and --weight-decay"),
            (&["--lr", "1e-300"], "--lr 1e-300 is 0 in f32"),
        ] {
            let err = refused(flags);
            assert!(err.contains(says), "{flags:?}: {err}");
        }
        for flags in [
            &["--beta1", "0", "--beta2", "0.999"][..],
            &["--optimizer", "sgd", "--momentum", "0"],
            &["--grad-clip", "0"],
        ] {
            parse(flags).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn offloading_a_stateless_optimizer_is_refused() {
        for flags in [
            &["--offload", "optimizer"][..],
            &["--offload-dir", "/tmp/x"],
        ] {
            let sgd = [&["--optimizer", "sgd", "--momentum", "0"][..], flags].concat();
            let err = TrainArgs::from_flags(&sgd).unwrap().validate().unwrap_err();
            assert!(
                err.to_string().contains("SGD without momentum keeps none"),
                "{err}"
            );
            let momentum = [&["--optimizer", "sgd"][..], flags].concat();
            TrainArgs::from_flags(&momentum)
                .unwrap()
                .validate()
                .unwrap();
        }
    }

    #[test]
    fn init_on_device_needs_16_bit_weights() {
        for precision in ["32-true", "bf16-mixed", "16-mixed"] {
            let err = refused(&["--init-on-device", "--precision", precision]);
            assert!(
                err.contains(&format!("--precision {precision} keeps f32")),
                "{err}"
            );
        }
        for flags in [
            &["--init-on-device", "--precision", "bf16-true"][..],
            &["--init-on-device", "--precision", "16-true"],
            &[
                "--init-on-device",
                "--strategy",
                "auto",
                "--memory-budget",
                "1GiB",
            ],
        ] {
            parse(flags).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn cublas_needs_a_cuda_run() {
        let err = refused(&["--accelerator", "cpu", "--matmul", "cublas"]);
        assert!(
            err.contains("--matmul cublas") && err.contains("cpu"),
            "{err}"
        );
    }

    #[test]
    fn offloading_to_the_host_a_cpu_run_is_on_is_noted() {
        let cpu = ["--accelerator", "cpu"];
        let note = parse(&[&cpu[..], &["--offload", "optimizer"]].concat())
            .unwrap()
            .offload_note()
            .unwrap();
        assert!(
            note.starts_with(
                "--offload optimizer on --accelerator cpu: the ranks' device is the host"
            ),
            "{note}"
        );
        for quiet in [
            &[][..],
            &["--offload", "optimizer", "--offload-dir", "/tmp/x"],
        ] {
            assert_eq!(
                parse(&[&cpu[..], quiet].concat()).unwrap().offload_note(),
                None
            );
        }
    }

    #[test]
    fn offloading_parameters_needs_zero3() {
        let err = refused(&["--offload", "params", "--strategy", "zero2"]);
        assert!(err.contains("needs --strategy zero3"), "{err}");
        parse(&["--offload", "params", "--strategy", "fsdp"])
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn resharding_is_zero3s() {
        let err = refused(&["--reshard-after-forward", "false", "--strategy", "zero2"]);
        assert!(err.contains("zero2 keeps whole parameters"), "{err}");
        let args = parse(&["--reshard-after-forward", "false", "--strategy", "fsdp"]).unwrap();
        args.validate().unwrap();
        let sharding = args.sharding().unwrap();
        assert!(sharding.keeps_gathered() && !sharding.reshards());
        let err = parse(&["--reshard-after-forward", "no"]).unwrap_err();
        assert!(err.contains("no") && err.contains("true"), "{err}");
        let default = parse(&["--strategy", "zero3"]).unwrap().sharding().unwrap();
        assert!(default.reshards() && !default.keeps_gathered());
    }

    #[test]
    fn a_rank_alone_gathers_only_what_it_copies_to_compute() {
        let acting = |flags: &[&str], world: usize| {
            let args = parse(&[&["--strategy", "zero3"], flags].concat()).unwrap();
            args.acting_sharding(world).unwrap()
        };
        // Alone, computing with its shards as they are: a replica of whole parameters.
        for flags in [&[][..], &["--precision", "bf16-true"]] {
            let alone = acting(flags, 1);
            assert!(!alone.parameters && !alone.reshards(), "{flags:?}");
            assert!(alone.gradients && alone.optimizer_state, "{flags:?}");
        }
        for (flags, world) in [
            (&[][..], 2),
            (&["--precision", "bf16-mixed"], 1),
            (&["--offload", "params"], 1),
        ] {
            let copying = acting(flags, world);
            assert!(
                copying.parameters && copying.reshards(),
                "{flags:?} x {world}"
            );
        }
        assert!(!acting(&["--reshard-after-forward", "false"], 2).reshards());
    }

    #[test]
    fn the_planner_plans_what_it_can_read() {
        for (flags, says) in [
            (
                &["--accelerator", "libtorch", "--plan"][..],
                "LibTorch allocates in C++",
            ),
            (
                &[
                    "--accelerator",
                    "cubecl-cpu",
                    "--memory-budget",
                    "1G",
                    "--precision",
                    "16-mixed",
                ],
                "dry run does not compute",
            ),
            (
                &[
                    "--accelerator",
                    "cubecl-cpu",
                    "--plan",
                    "--precision",
                    "16-mixed",
                ],
                "dry run does not compute",
            ),
        ] {
            let err = refused(flags);
            assert!(err.contains(says), "{flags:?}: {err}");
        }
        parse(&["--accelerator", "cpu", "--plan"])
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn skip_limit_needs_the_loss_scaler() {
        let err = refused(&["--max-consecutive-skips", "3"]);
        assert!(err.contains("16-mixed"), "{err}");
        let err = refused(&["--initial-loss-scale", "1024", "--precision", "bf16-mixed"]);
        assert!(
            err.contains("--initial-loss-scale") && err.contains("bf16-mixed"),
            "{err}"
        );
        let scaled = ["--precision", "16-mixed", "--max-consecutive-skips", "3"];
        parse(&[&scaled[..], &["--initial-loss-scale", "1024"]].concat())
            .unwrap()
            .validate()
            .unwrap();
        for scale in ["0", "1e-8", "inf"] {
            let err = refused(&[&scaled[..], &["--initial-loss-scale", scale]].concat());
            assert!(err.contains("at least 1"), "{scale}: {err}");
        }
    }

    #[test]
    fn auto_needs_a_budget() {
        let err = refused(&["--strategy", "auto", "--accelerator", "cpu"]);
        assert!(err.contains("--memory-budget"), "{err}");
        // On a cubecl device the device's memory is the budget (`Budget::on_device`).
        let cube = parse(&["--strategy", "auto", "--accelerator", "cubecl-cpu"]).unwrap();
        assert!(cube.plans_device());
        if cfg!(feature = "cubecl-cpu") {
            cube.validate().unwrap();
        }
        let args = parse(&["--strategy", "auto", "--memory-budget", "1.5GiB"]).unwrap();
        assert_eq!(args.memory_budget, Some(3 << 29));
        args.validate().unwrap();
        let err = parse(&["--memory-budget", "lots"]).unwrap_err();
        assert!(err.contains("lots") && err.contains("GiB"), "{err}");
    }

    #[test]
    fn an_optimizer_setting_the_run_would_not_read_is_refused() {
        for (flags, flag) in [
            (&["--optimizer", "sgd", "--beta1", "0.8"][..], "--beta1"),
            (&["--optimizer", "sgd", "--beta2", "0.99"][..], "--beta2"),
            (
                &["--optimizer", "adafactor", "--adam-epsilon", "1e-6"][..],
                "--adam-epsilon",
            ),
            (
                &["--optimizer", "adafactor", "--beta2", "0.99"][..],
                "--beta2",
            ),
            (&["--momentum", "0.5"][..], "--momentum"),
            (
                &["--optimizer", "adam", "--momentum", "0"][..],
                "--momentum",
            ),
            (
                &["--schedule", "constant", "--min-lr-ratio", "0.5"][..],
                "--min-lr-ratio",
            ),
        ] {
            let err = refused(flags);
            assert!(
                err.contains(&format!("{flag} is not read")),
                "{flags:?}: {err}"
            );
        }
        for read in [
            &["--optimizer", "sgd", "--momentum", "0"][..],
            &["--optimizer", "adafactor", "--beta1", "0.9"][..],
            &[
                "--optimizer",
                "adam8bit",
                "--beta1",
                "0.8",
                "--beta2",
                "0.99",
            ][..],
            &["--min-lr-ratio", "0.5"][..],
        ] {
            parse(read).unwrap().validate().unwrap();
        }
        // A program's default beta2 lands only where the optimizer has one.
        let sgd = parse(&["--optimizer", "sgd"])
            .unwrap()
            .with_default_beta2(0.999);
        sgd.validate().unwrap();
        let adamw = parse(&[]).unwrap().with_default_beta2(0.999);
        let defaults = AdamSettings {
            beta1: ADAM_BETA1,
            beta2: 0.999,
            epsilon: ADAM_EPSILON,
        };
        assert_eq!(adamw.adam(), defaults);
        let epsilon = parse(&["--adam-epsilon", "1e-6"]).unwrap();
        assert_eq!(epsilon.adam().epsilon, 1e-6);
        let given = parse(&["--beta2", "0.9"])
            .unwrap()
            .with_default_beta2(0.999);
        assert_eq!(given.adam().beta2, 0.9);
    }

    /// Defaults as the optimizer's own library has them: nanoGPT's decay for AdamW and 8-bit
    /// AdamW only (torch.optim's SGD and Adam and HF's Adafactor decay nothing unless asked),
    /// and HF's Adafactor step (a cap of 1e-2, constant) for a relative step.
    #[test]
    fn unset_optimizer_settings_take_the_optimizers_defaults() {
        let decay = |flags: &[&str]| parse(flags).unwrap().weight_decay();
        assert_eq!(decay(&[]), ADAMW_WEIGHT_DECAY);
        assert_eq!(decay(&["--optimizer", "adam8bit"]), ADAMW_WEIGHT_DECAY);
        for optimizer in ["sgd", "adam", "adafactor"] {
            assert_eq!(decay(&["--optimizer", optimizer]), 0.0, "{optimizer}");
            let given = ["--optimizer", optimizer, "--weight-decay", "0.01"];
            assert_eq!(decay(&given), 0.01, "{optimizer}");
        }
        assert_eq!(decay(&["--weight-decay", "0"]), 0.0);

        let absolute = parse(&["--optimizer", "adafactor"]).unwrap();
        assert_eq!((absolute.lr(), absolute.schedule()), (LR, Schedule::Cosine));
        let relative = ["--optimizer", "adafactor", "--adafactor-relative-step"];
        let hf = parse(&relative).unwrap();
        assert_eq!(
            (hf.lr(), hf.schedule()),
            (RELATIVE_STEP_LR, Schedule::Constant)
        );
        // A program's own rate is an absolute step's, not the relative step's cap.
        assert_eq!(hf.clone().with_default_lr(1e-4).lr(), RELATIVE_STEP_LR);
        assert_eq!(absolute.with_default_lr(1e-4).lr(), 1e-4);
        let given = parse(&[&relative[..], &["--lr", "1e-3", "--schedule", "cosine"]].concat());
        let given = given.unwrap().with_default_lr(1e-4);
        assert_eq!((given.lr(), given.schedule()), (1e-3, Schedule::Cosine));
        // Annealing is not read where the schedule defaults to constant, and says why.
        let ratio = parse(&[&relative[..], &["--min-lr-ratio", "0.5"]].concat()).unwrap();
        let refused = ratio.validate().unwrap_err().to_string();
        assert!(
            refused.contains("--schedule constant (--adafactor-relative-step's default)"),
            "{refused}"
        );
    }

    #[test]
    fn files_written_at_the_end_are_checked_before_the_start() {
        for flag in ["--save", "--summary-json", "--metrics-csv"] {
            let err = refused(&[flag, "/no/such/dir/out.json"]);
            assert!(err.contains("/no/such/dir is not a directory"), "{err}");
            let err = refused(&[flag, "/tmp"]);
            assert!(err.contains("a directory, where a file"), "{err}");
            // A directory no one can create files in, root included.
            let err = refused(&[flag, "/proc/out.json"]);
            assert!(err.contains("/proc cannot be written"), "{err}");
            parse(&[flag, "out.json"]).unwrap().validate().unwrap();
        }
        // The summary is written in place: an existing file that can be written will do
        // where no file can be made (`/dev/stdout` for a user; here a file of /proc's that
        // a process may write, its name).
        parse(&["--summary-json", "/proc/self/comm"])
            .unwrap()
            .validate()
            .unwrap();
        let err = refused(&["--save", "w.safetensors", "--summary-json", "w.config.json"]);
        assert!(
            err.contains("--save's configuration and --summary-json"),
            "{err}"
        );
        let err = refused(&["--save", "out.x", "--metrics-csv", "./out.x"]);
        assert!(
            err.contains("--save and --metrics-csv name the same path"),
            "{err}"
        );
        let err = refused(&[
            "--summary-json",
            "/tmp/o.json",
            "--metrics-csv",
            "/tmp/../tmp/o.json",
        ]);
        assert!(err.contains("--summary-json and --metrics-csv"), "{err}");
        parse(&["--save", "a", "--summary-json", "b", "--metrics-csv", "c"])
            .unwrap()
            .validate()
            .unwrap();
        let err = refused(&["--keep-checkpoints", "2"]);
        assert!(err.contains("need --checkpoint-dir"), "{err}");
        // The checkpoint directory is the run's too: not a file's path, and a file may go
        // into it before the run has made it.
        let err = refused(&["--checkpoint-dir", "out", "--save", "./out"]);
        assert!(
            err.contains("--checkpoint-dir and --save name the same path"),
            "{err}"
        );
        let temp = tempfile::tempdir().unwrap();
        let run = temp.path().join("run");
        let inside = run.join("ckpt");
        let weights = inside.join("model.safetensors");
        let flags = |save: &Path| {
            parse(&[
                "--checkpoint-dir",
                inside.to_str().unwrap(),
                "--save",
                save.to_str().unwrap(),
            ])
            .unwrap()
            .validate()
        };
        // The run creates the directory with its parents.
        flags(&weights).unwrap();
        std::fs::create_dir(&run).unwrap();
        flags(&weights).unwrap();
        let elsewhere = run.join("other").join("model.safetensors");
        let err = flags(&elsewhere).unwrap_err().to_string();
        assert!(err.contains("is not a directory"), "{err}");
        // A directory two levels from being made, given with `./`, is the same path.
        parse(&["--checkpoint-dir", "a/b", "--save", "./a/b/m.safetensors"])
            .unwrap()
            .validate()
            .unwrap();
        let err = refused(&[
            "--checkpoint-dir",
            "m.config.json",
            "--save",
            "m.safetensors",
        ]);
        assert!(
            err.contains("--checkpoint-dir and --save's configuration name the same path"),
            "{err}"
        );
    }

    #[test]
    fn a_new_run_does_not_mix_with_an_earlier_runs_checkpoints() {
        let dir = std::env::temp_dir().join(format!("burnscale-cli-{}", std::process::id()));
        let step = dir.join("step-00000007");
        std::fs::create_dir_all(&step).unwrap();
        let flags = ["--checkpoint-dir", dir.to_str().unwrap()];
        // An interrupted save (no meta.json) is no checkpoint.
        parse(&flags).unwrap().validate().unwrap();
        std::fs::write(step.join("meta.json"), "{}").unwrap();
        let err = refused(&flags);
        assert!(err.contains("(step 7): give --resume"), "{err}");
        parse(&[&flags[..], &["--resume"]].concat())
            .unwrap()
            .validate()
            .unwrap();
        // The checkpoint itself, given for the directory: refused, naming that directory.
        let inside = ["--checkpoint-dir", step.to_str().unwrap(), "--resume"];
        let err = refused(&inside);
        let holder = dir.canonicalize().unwrap();
        let named = format!(
            "is a checkpoint, not a directory of them: give the one that holds it, {}",
            holder.display()
        );
        assert!(err.contains(&named), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fsdp_is_zero3() {
        let args = parse(&["--strategy", "fsdp", "--devices", "2"]).unwrap();
        assert_eq!(args.strategy, Strategy::Zero3);
        args.validate().unwrap();
    }

    #[test]
    fn unknown_values_are_named() {
        let err = parse(&["--strategy", "zero4"]).unwrap_err();
        assert!(err.contains("zero4") && err.contains("zero3"), "{err}");
        let err = refused(&["--batch-size", "0"]);
        assert!(err.contains("--batch-size"), "{err}");
    }
}
