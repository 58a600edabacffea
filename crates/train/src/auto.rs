//! `--memory-budget` and `--strategy auto`: the memory planner asked before launch. A run's
//! configuration is planned against the budget before any rank starts; under `auto` the
//! candidates are planned in a fixed order, fastest first, and the first that fits is run,
//! with the reason (every faster candidate's plan) printed and put in the summary. On a
//! cubecl device the ranks weigh the same candidates, each by a dry run of its steps
//! ([`crate::device_plan`]), once they have started.
//!
//! The order is the techniques' usual cost on GPUs: DDP, then ZeRO-1 and ZeRO-2 (the same
//! bytes on the wire as DDP's all-reduce: `collective_bytes_per_step`), then ZeRO-3 keeping each unit gathered from its
//! forward to its backward (`--reshard-after-forward false`: ZeRO-2's bytes at
//! `--accumulate 1`, its all-gather every micro-step where ZeRO-2's is once a step), then
//! ZeRO-3 resharded after forward (each block gathered again for its backward), then the five
//! with activation checkpointing (a second forward per block), then all of them again with
//! the optimizer state on disk when `--offload-dir` names a place for it. The
//! precision given stays unless nothing fits in it: it changes what the model learns, so
//! bf16-mixed, then bf16-true, are tried only after every other candidate. A run resumed
//! from a checkpoint weighs the checkpoint's precision alone, which it must continue in.

use burn::prelude::*;
use burnscale_collective::{Communicator, gather_u64s, launched_by_mpirun, launcher_world_size};
use burnscale_shard::Checkpointing;
use clap::ValueEnum;
use serde::Serialize;

use crate::accelerator::Accelerator;
use crate::checkpoint::Checkpoint;
use crate::cli::{CheckpointMode, Offload, Strategy, TrainArgs, value_name};
use crate::memory::{self, human_bytes};
use crate::plan::{MemoryPlan, Probe, ranks_in_process};
use crate::runner::TrainTask;
use crate::{Precision, TrainError};

/// One configuration weighed, and what the planner said of it.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// The flags that differ from the run's own, as a user would type them.
    pub flags: String,
    /// The planned peak of one rank ([`MemoryPlan::rank_share`]; on cuda and cubecl-cpu the
    /// largest of the ranks' dry runs, of their device's pools).
    pub planned_bytes: usize,
}

impl Candidate {
    /// `args`, one of auto's candidates, as it is named, planned at `planned_bytes` a rank.
    fn weighed(args: &TrainArgs, planned_bytes: usize) -> Self {
        Candidate {
            flags: flags_of(args),
            planned_bytes,
        }
    }
}

/// The share of a device's memory `auto` leaves unplanned when it chooses without
/// `--memory-budget`: the CUDA context, cuBLAS's and NCCL's workspaces and other processes
/// take device memory outside cubecl's pools, which the plan reads.
pub const DEVICE_HEADROOM: f64 = 0.1;

/// The memory one rank may take, and where the figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub bytes: usize,
    /// Whether `bytes` is the rank's device's memory, not `--memory-budget` (none given, or
    /// one above what the device has).
    pub device_memory: bool,
}

impl Budget {
    /// `--memory-budget`, as given.
    pub fn given(bytes: usize) -> Self {
        Budget {
            bytes,
            device_memory: false,
        }
    }

    /// The budget of ranks whose smallest device holds `capacity` bytes (when the runtime
    /// says): the given one; with none given, or one above the device's memory (no plan
    /// above it can run), the device's memory, less [`DEVICE_HEADROOM`] where `auto`
    /// chooses (a budget within the headroom is lowered to it too: auto would otherwise
    /// plan into the memory the headroom keeps). None where nothing bounds the plan; an error
    /// where `auto` would have nothing to choose within.
    pub fn on_device(
        args: &TrainArgs,
        capacity: Option<usize>,
    ) -> Result<Option<Self>, TrainError> {
        let device = |bytes| Budget {
            bytes,
            device_memory: true,
        };
        let usable = |capacity: usize| match args.strategy {
            Strategy::Auto => (capacity as f64 * (1.0 - DEVICE_HEADROOM)) as usize,
            _ => capacity,
        };
        match (args.memory_budget, capacity) {
            (Some(given), Some(capacity)) if given > usable(capacity) => {
                Ok(Some(device(usable(capacity))))
            }
            (Some(given), _) => Ok(Some(Budget::given(given))),
            (None, Some(capacity)) => Ok(Some(device(usable(capacity)))),
            (None, None) if args.strategy == Strategy::Auto => Err(TrainError::InvalidArgs(
                "--strategy auto without --memory-budget plans within the device's memory, but this device's runtime does not say how much it has: give --memory-budget".into(),
            )),
            (None, None) => Ok(None),
        }
    }

    /// The budget as the messages name it.
    fn describe(&self) -> String {
        match self.device_memory {
            true => format!("the device's memory, {} usable", human_bytes(self.bytes)),
            false => format!("--memory-budget {}", human_bytes(self.bytes)),
        }
    }

    /// Why the budget is not `args`' `--memory-budget`, when one was given (the choice and
    /// the error name the budget they weigh against).
    pub fn note(&self, args: &TrainArgs) -> Option<String> {
        args.memory_budget
            .filter(|_| self.device_memory)
            .map(|given| {
                format!(
                    "memory plan: --memory-budget {} is above {}, which bounds the plans instead",
                    human_bytes(given),
                    self.describe()
                )
            })
    }
}

/// What `--strategy auto` chose within its budget, and what it passed over.
#[derive(Debug, Clone, Serialize)]
pub struct AutoChoice {
    pub budget: Budget,
    pub chosen: Candidate,
    /// The faster candidates, in order, each planned above the budget.
    pub over_budget: Vec<Candidate>,
    /// Flags given that only slower candidates would have used, each with why the choice
    /// does not.
    pub unused: Vec<String>,
}

impl AutoChoice {
    /// Why this configuration: the faster ones' plans, then the chosen one's.
    pub fn explain(&self) -> String {
        let mut lines = vec![format!(
            "--strategy auto: {} (planned {} per rank, within {})",
            self.chosen.flags,
            human_bytes(self.chosen.planned_bytes),
            self.budget.describe()
        )];
        for c in &self.over_budget {
            lines.push(format!(
                "  faster, but over the budget: {} (planned {})",
                c.flags,
                human_bytes(c.planned_bytes)
            ));
        }
        for flag in &self.unused {
            lines.push(format!("  given, not used by this choice: {flag}"));
        }
        lines.join("\n")
    }
}

/// The run as it will go: `args` with `auto` chosen, the probe its plan is made from (when a
/// plan is wanted: `--plan`, `--summary-json` or `--memory-budget`), and the choice.
pub struct Resolved {
    pub args: TrainArgs,
    pub probe: Option<Probe>,
    pub choice: Option<AutoChoice>,
}

/// Plans `args` (every candidate under `auto`) for `model` on `task` against
/// `--memory-budget`. Run it on one thread before any rank starts: the probe reads the
/// process-wide counting allocator.
pub fn resolve<T: TrainTask>(
    model: &T::Model,
    task: &T,
    args: &TrainArgs,
    device: &Device,
) -> Result<Resolved, TrainError> {
    // The probe reads the counting allocator, which sees a device's memory on the CPU only
    // (validation refuses LibTorch; a cubecl device's ranks plan it themselves, by a dry run:
    // `crate::device_plan::resolve`).
    let on_cpu = args.runs_on() == Accelerator::Cpu;
    let counting = memory::is_counting();
    if on_cpu && !counting && (args.plan || args.memory_budget.is_some()) {
        return Err(TrainError::InvalidArgs(
            "--plan and --memory-budget measure the model's terms with burnscale's counting allocator, which this program did not install (every term would read 0): add `#[global_allocator] static ALLOC: burnscale_train::memory::CountingAllocator = burnscale_train::memory::CountingAllocator;` to the binary".into(),
        ));
    }
    let Some(budget) = args.memory_budget.filter(|_| on_cpu) else {
        let probe = match on_cpu && counting && (args.plan || args.summary_json.is_some()) {
            true => Some(Probe::measure(model, task, args, device)?),
            false => None,
        };
        return Ok(Resolved {
            args: args.clone(),
            probe,
            choice: None,
        });
    };
    let world = world_size(args)?;
    let threads = ranks_in_process(world);
    // A probe measures the precision's dtypes and, with the optimizer state on disk, the
    // step's reading it in and writing it back: the candidates' other flags are planned
    // from its terms.
    let mut probes: Vec<((Precision, bool), Probe)> = Vec::new();
    let depth = burnscale_nn::BlockModel::blocks(model).len();
    let (args, probe, choice) = search(
        args,
        world,
        device,
        Budget::given(budget),
        depth,
        |candidate| {
            let measures = (candidate.precision, candidate.offload_dir.is_some());
            let probe = match probes.iter().find(|(m, _)| *m == measures) {
                Some((_, probe)) => probe.clone(),
                None => {
                    let probe = Probe::measure(model, task, candidate, device)?;
                    probes.push((measures, probe.clone()));
                    probe
                }
            };
            let planned =
                MemoryPlan::new(model, candidate, world, threads, probe.clone())?.rank_share();
            Ok((planned, probe))
        },
    )?;
    Ok(Resolved {
        args,
        probe: Some(probe),
        choice,
    })
}

/// The first of `args`' candidates on `world` ranks that `plan` (a candidate's planned bytes
/// per rank, and what its plan was made of) puts within `budget`, with what `plan` gave for
/// it and, under `auto`, the choice; an error naming every plan when none fits. Where `auto`
/// chooses to checkpoint every block of the model's `depth`, the fewest of its lowest blocks
/// that fit are checkpointed instead ([`fewest_checkpointed`]).
pub(crate) fn search<P>(
    args: &TrainArgs,
    world: usize,
    device: &Device,
    budget: Budget,
    depth: usize,
    mut plan: impl FnMut(&TrainArgs) -> Result<(usize, P), TrainError>,
) -> Result<(TrainArgs, P, Option<AutoChoice>), TrainError> {
    if args.strategy == Strategy::Auto && world == 1 {
        let zero3_only = [
            (
                "--reshard-after-forward",
                args.reshard_after_forward.is_some(),
            ),
            ("--offload params", args.offload == Offload::Params),
        ];
        if let Some((flag, _)) = zero3_only.iter().find(|(_, given)| *given) {
            return Err(TrainError::InvalidArgs(format!(
                "{flag} applies to zero3, which --strategy auto weighs on more than one rank only (this world has one)"
            )));
        }
    }
    let weighed = candidates(args, world, device);
    if weighed.is_empty() {
        let on = args.runs_on().name();
        // The precision --resume keeps, where the planner cannot follow it.
        let unplannable = resumed_precision(args).filter(|&precision| {
            TrainArgs {
                precision,
                ..args.clone()
            }
            .unplannable()
            .is_some()
        });
        return Err(TrainError::InvalidArgs(match unplannable {
            Some(precision) => format!(
                "--strategy auto cannot plan the run --resume continues on --accelerator {on}: its checkpoint trains in --precision {precision}, whose steps a dry run cannot follow (the loss scaler reads the gradients' values); give --strategy without --memory-budget or --plan"
            ),
            None => format!(
                "--strategy auto has no configuration it can weigh on --accelerator {on}: give --strategy and --precision explicitly"
            ),
        }));
    }
    let mut over_budget = Vec::new();
    for candidate in weighed {
        let (planned, made_of) = plan(&candidate)?;
        if planned <= budget.bytes {
            let refine = args.strategy == Strategy::Auto
                && args.checkpointing() == Checkpointing::None
                && candidate.checkpoint_activations;
            let (candidate, planned, made_of) = match refine {
                true => fewest_checkpointed(
                    (candidate, planned, made_of),
                    depth,
                    budget.bytes,
                    &mut plan,
                    &mut over_budget,
                )?,
                false => (candidate, planned, made_of),
            };
            let weighed = Candidate::weighed(&candidate, planned);
            let choice = (args.strategy == Strategy::Auto).then(|| AutoChoice {
                budget,
                chosen: weighed,
                over_budget,
                unused: unused_by(&candidate, args),
            });
            return Ok((candidate, made_of, choice));
        }
        over_budget.push(Candidate::weighed(&candidate, planned));
    }
    Err(TrainError::OverBudget {
        budget: budget.describe(),
        planned: over_budget
            .iter()
            .map(|c| format!("\n  {}: {}", c.flags, human_bytes(c.planned_bytes)))
            .collect(),
        hint: match (args.strategy, budget.device_memory) {
            (Strategy::Auto, false) => {
                "raise --memory-budget, lower --batch-size (and --accumulate more), or give --offload-dir for the optimizer state"
            }
            (Strategy::Auto, true) => {
                "lower --batch-size (and --accumulate more), train on more ranks, or give --offload-dir for the optimizer state"
            }
            (_, false) => "try --strategy auto, raise --memory-budget, or lower --batch-size",
            (_, true) => {
                "try --strategy auto, --checkpoint-activations, more ranks, or a lower --batch-size"
            }
        },
    })
}

/// `chosen`, a candidate within `budget` with every one of the model's `depth` blocks
/// checkpointed (the same without checkpointing came before it, over the budget), with the
/// fewest of its lowest blocks checkpointed that `plan` still puts within the budget: fewer
/// recompute less. Bisected, as a plan's activations fall block by block; the tries over the
/// budget join `over_budget`.
fn fewest_checkpointed<P>(
    chosen: (TrainArgs, usize, P),
    depth: usize,
    budget: usize,
    plan: &mut impl FnMut(&TrainArgs) -> Result<(usize, P), TrainError>,
    over_budget: &mut Vec<Candidate>,
) -> Result<(TrainArgs, usize, P), TrainError> {
    let (mut over, mut best) = (0, chosen);
    let mut within = depth;
    while within - over > 1 {
        let n = over + (within - over) / 2;
        let trial = TrainArgs {
            checkpoint_activations: false,
            checkpoint_blocks: Some(n),
            ..best.0.clone()
        };
        let (planned, made_of) = plan(&trial)?;
        match planned <= budget {
            true => (within, best) = (n, (trial, planned, made_of)),
            false => {
                over = n;
                over_budget.push(Candidate::weighed(&trial, planned));
            }
        }
    }
    Ok(best)
}

/// The flags in `given` that `chosen` (one of its candidates) does not use, each with why.
fn unused_by(chosen: &TrainArgs, given: &TrainArgs) -> Vec<String> {
    [
        (
            "--offload-dir (the plan fits with the optimizer state in memory)",
            given.offload_dir.is_some() && chosen.offload_dir.is_none(),
        ),
        (
            "--reshard-after-forward (it applies to zero3)",
            given.reshard_after_forward.is_some() && chosen.strategy != Strategy::Zero3,
        ),
        (
            "--checkpoint-blocks (the plan fits only with every block checkpointed)",
            given.checkpoint_blocks.is_some() && chosen.checkpoint_blocks.is_none(),
        ),
        (
            "--checkpoint-mode (the plan fits without checkpointing)",
            given.checkpoint_mode != CheckpointMode::Full
                && chosen.checkpointing() == Checkpointing::None,
        ),
        (
            "--init-on-device (the weights stay f32, as built)",
            given.init_on_device && !chosen.init_on_device,
        ),
        (
            "--initial-loss-scale (the chosen precision has no loss scaler)",
            given.initial_loss_scale.is_some() && chosen.initial_loss_scale.is_none(),
        ),
        (
            "--max-consecutive-skips (the chosen precision has no loss scaler)",
            given.max_consecutive_skips.is_some() && chosen.max_consecutive_skips.is_none(),
        ),
    ]
    .into_iter()
    .filter(|&(_, unused)| unused)
    .map(|(flag, _)| flag.to_string())
    .chain(
        resumed_precision(given)
            .filter(|&saved| saved == chosen.precision && saved != given.precision)
            .map(|saved| {
                format!(
                    "--precision {} (the checkpoint --resume continues is {saved})",
                    given.precision
                )
            }),
    )
    .collect()
}

/// The configurations `args` allows on `world` ranks, fastest first: `args` itself unless
/// its strategy is `auto`. Flags the user gave (checkpointing, `--offload`) stay; each
/// candidate is one `validate` accepts and `device` can run.
fn candidates(args: &TrainArgs, world: usize, device: &Device) -> Vec<TrainArgs> {
    if args.strategy != Strategy::Auto {
        return vec![args.clone()];
    }
    let strategies: &[Strategy] = match world {
        1 => &[Strategy::Single],
        _ => &[
            Strategy::Ddp,
            Strategy::Zero1,
            Strategy::Zero2,
            Strategy::Zero3,
        ],
    };
    let precisions = match resumed_precision(args) {
        Some(saved) => vec![saved],
        None => {
            let mut precisions = vec![args.precision];
            for fallback in [Precision::Bf16Mixed, Precision::Bf16True] {
                if !precisions.contains(&fallback) {
                    precisions.push(fallback);
                }
            }
            precisions
        }
    };
    let disks = match &args.offload_dir {
        Some(dir) => vec![None, Some(dir.clone())],
        None => vec![None],
    };
    let mut out = Vec::new();
    for precision in precisions {
        for offload_dir in &disks {
            for checkpoint in [args.checkpoint_activations, true] {
                for &strategy in strategies {
                    let resharding = resharding(strategy, args.reshard_after_forward);
                    for reshard_after_forward in resharding {
                        let mut candidate = TrainArgs {
                            strategy,
                            precision,
                            // Weights that stay f32 are built so: nothing to create in place.
                            init_on_device: args.init_on_device && precision.has_16bit_weights(),
                            checkpoint_activations: checkpoint,
                            // Every block checkpointed, or as given.
                            checkpoint_blocks: args.checkpoint_blocks.filter(|_| !checkpoint),
                            reshard_after_forward,
                            offload_dir: offload_dir.clone(),
                            // A precision without a loss scaler is weighed without its flags
                            // (which `validate` refuses there).
                            initial_loss_scale: args
                                .initial_loss_scale
                                .filter(|_| precision.scales_loss()),
                            max_consecutive_skips: args
                                .max_consecutive_skips
                                .filter(|_| precision.scales_loss()),
                            ..args.clone()
                        };
                        // The mode given is for the blocks checkpointed (`validate` refuses
                        // one other than full where none are).
                        if candidate.checkpointing() == Checkpointing::None {
                            candidate.checkpoint_mode = CheckpointMode::Full;
                        }
                        // A concrete candidate's `validate` asks for a plannable precision
                        // only when it plans; `auto` plans every candidate it weighs.
                        let runs = candidate.validate().is_ok()
                            && candidate.unplannable().is_none()
                            && precision.check_device(device).is_ok()
                            && !out
                                .iter()
                                .any(|c| choice_code(c) == choice_code(&candidate));
                        if runs {
                            out.push(candidate);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The precision of the checkpoint `args` resumes from, if any: a resumed run continues in
/// it ([`crate::checkpoint::restore`] refuses another), so `auto` weighs that precision's
/// candidates alone. A checkpoint that cannot be read is left to `restore` to report.
fn resumed_precision(args: &TrainArgs) -> Option<Precision> {
    let dir = args.checkpoint_dir.as_ref().filter(|_| args.resume)?;
    let saved = Checkpoint::latest(dir).ok()??.meta.precision;
    Precision::from_str(&saved, false).ok()
}

/// The `--reshard-after-forward` values a candidate of `strategy` takes, in order, when the
/// user gave `given`: ZeRO-3 keeps its gathered units (one all-gather per unit), then
/// reshards, unless the user said which. Other strategies take none.
fn resharding(strategy: Strategy, given: Option<bool>) -> Vec<Option<bool>> {
    match (strategy, given) {
        (Strategy::Zero3, None) => vec![Some(false), None],
        (Strategy::Zero3, given) => vec![given],
        _ => vec![None],
    }
}

/// What `auto` chooses, as one number: candidates with the same code run the same way
/// (a candidate's `--offload-dir` is none or the one given).
fn choice_code(args: &TrainArgs) -> u64 {
    let (checkpointing, lowest) = match args.checkpointing() {
        Checkpointing::None => (0, 0),
        Checkpointing::All => (1, 0),
        Checkpointing::Lowest(n) => (2, n as u64),
    };
    // The first part may take any value, the others are below 16: no two choices share a
    // code (ranks that bisected to different block counts must not pass for agreeing).
    [
        lowest,
        args.strategy as u64,
        args.precision as u64,
        checkpointing,
        u64::from(args.offload_dir.is_some()),
        args.reshard_after_forward.map_or(0, |on| 1 + u64::from(on)),
    ]
    .iter()
    .fold(0, |code, part| code * 16 + part)
}

/// Stops every rank with a message when the processes of an MPI world chose differently
/// (each plans on its own; they must run one configuration).
pub(crate) fn agree(comm: &dyn Communicator, chosen: &TrainArgs) -> Result<(), TrainError> {
    same_on_every_rank(
        comm,
        choice_code(chosen),
        "the ranks' plans chose different configurations",
    )
}

/// Stops every rank with a message when their devices allow different candidates (a
/// precision one rank's device cannot run): ranks that plan by a dry run weigh every
/// candidate together, through collectives, so they must walk one list.
#[cfg(feature = "cube")]
pub(crate) fn agree_on_candidates(
    comm: &dyn Communicator,
    args: &TrainArgs,
    device: &Device,
) -> Result<(), TrainError> {
    let list = candidates(args, comm.world_size(), device)
        .iter()
        .fold(0u64, |code, c| {
            code.wrapping_mul(0x0100_0000_01b3) ^ choice_code(c)
        });
    same_on_every_rank(
        comm,
        list,
        "the ranks' devices allow different configurations",
    )
}

fn same_on_every_rank(comm: &dyn Communicator, code: u64, what: &str) -> Result<(), TrainError> {
    let codes = gather_u64s(comm, &[code])?;
    match codes.iter().all(|c| *c == codes[0]) {
        true => Ok(()),
        false => Err(TrainError::InvalidArgs(format!(
            "--memory-budget: {what} (codes {codes:?}): give --strategy and --precision explicitly"
        ))),
    }
}

/// A candidate as the flags that set it.
fn flags_of(args: &TrainArgs) -> String {
    let mut flags = vec![
        format!("--strategy {}", value_name(args.strategy)),
        format!("--precision {}", args.precision),
    ];
    match args.checkpointing() {
        Checkpointing::None => {}
        Checkpointing::All => flags.push("--checkpoint-activations".into()),
        Checkpointing::Lowest(n) => flags.push(format!("--checkpoint-blocks {n}")),
    }
    if args.checkpointing() != Checkpointing::None && args.checkpoint_mode != CheckpointMode::Full {
        flags.push(format!(
            "--checkpoint-mode {}",
            value_name(args.checkpoint_mode)
        ));
    }
    if let Some(on) = args.reshard_after_forward {
        flags.push(format!("--reshard-after-forward {on}"));
    }
    if let Some(dir) = &args.offload_dir {
        flags.push(format!("--offload-dir {}", dir.display()));
    }
    flags.join(" ")
}

/// The ranks the run will have: `--devices` threads, or the world mpirun started (`None`
/// when the launcher did not say its size).
pub(crate) fn launched_world(args: &TrainArgs) -> Option<usize> {
    match launched_by_mpirun() {
        false => Some(args.devices),
        true => launcher_world_size(),
    }
}

/// [`launched_world`], which the budget's plan needs.
fn world_size(args: &TrainArgs) -> Result<usize, TrainError> {
    launched_world(args).ok_or_else(|| {
        TrainError::InvalidArgs(
            "--memory-budget under mpirun plans for the world size, but the launcher did not say it (no OMPI_COMM_WORLD_SIZE or PMI_SIZE)".into(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `flags` on the CPU.
    fn on_cpu(flags: &[&str]) -> TrainArgs {
        TrainArgs::from_flags(&[flags, &["--accelerator", "cpu"]].concat()).unwrap()
    }

    fn order(flags: &[&str], world: usize) -> Vec<String> {
        candidates(&on_cpu(flags), world, &Device::flex())
            .iter()
            .map(flags_of)
            .collect()
    }

    #[test]
    fn choices_differ_by_how_many_blocks_they_checkpoint() {
        let blocks = |n: &str| choice_code(&on_cpu(&["--checkpoint-blocks", n]));
        assert_ne!(blocks("3"), blocks("4"));
        assert_ne!(
            blocks("1"),
            choice_code(&on_cpu(&["--checkpoint-activations"]))
        );
        assert_eq!(blocks("3"), blocks("3"));
    }

    /// `--checkpoint-mode` goes to the candidates that checkpoint, and those that do not are
    /// weighed too, in full mode (`validate` refuses another mode without checkpointing: they
    /// were left out, and auto checkpointed where nothing needed it).
    #[test]
    fn the_checkpoint_mode_given_goes_to_the_candidates_that_checkpoint() {
        let auto = ["--strategy", "auto", "--memory-budget", "1G"];
        let full = order(&auto, 4);
        let selective = order(
            &[&auto[..], &["--checkpoint-mode", "selective"]].concat(),
            4,
        );
        let checkpointing = "--checkpoint-activations";
        let expected: Vec<String> = full
            .iter()
            .map(|c| {
                c.replace(
                    checkpointing,
                    &format!("{checkpointing} --checkpoint-mode selective"),
                )
            })
            .collect();
        assert_eq!(selective, expected);
        assert!(selective.iter().any(|c| !c.contains(checkpointing)));
    }

    #[test]
    fn candidates_go_fastest_first_and_keep_the_precision_until_nothing_else_fits() {
        let four = order(&["--strategy", "auto", "--memory-budget", "1G"], 4);
        let f32: Vec<&str> = four[..10].iter().map(String::as_str).collect();
        assert_eq!(
            f32,
            [
                "--strategy ddp --precision 32-true",
                "--strategy zero1 --precision 32-true",
                "--strategy zero2 --precision 32-true",
                "--strategy zero3 --precision 32-true --reshard-after-forward false",
                "--strategy zero3 --precision 32-true",
                "--strategy ddp --precision 32-true --checkpoint-activations",
                "--strategy zero1 --precision 32-true --checkpoint-activations",
                "--strategy zero2 --precision 32-true --checkpoint-activations",
                "--strategy zero3 --precision 32-true --checkpoint-activations --reshard-after-forward false",
                "--strategy zero3 --precision 32-true --checkpoint-activations",
            ]
        );
        assert_eq!(four.len(), 3 * 10);
        assert!(four[10..20].iter().all(|c| c.contains("bf16-mixed")));
        assert!(four[20..].iter().all(|c| c.contains("bf16-true")));
        // `--init-on-device` acts only where the weights are 16-bit; the f32 candidates stay.
        let created = order(
            &[
                "--strategy",
                "auto",
                "--memory-budget",
                "1G",
                "--init-on-device",
            ],
            4,
        );
        assert_eq!(created, four);
        let resharded = order(
            &[
                "--strategy",
                "auto",
                "--memory-budget",
                "1G",
                "--reshard-after-forward",
                "true",
            ],
            4,
        );
        assert_eq!(resharded.len(), 3 * 8);
        assert_eq!(
            resharded[3],
            "--strategy zero3 --precision 32-true --reshard-after-forward true"
        );

        let one = order(&["--strategy", "auto", "--memory-budget", "1G"], 1);
        assert_eq!(
            one[..2],
            [
                "--strategy single --precision 32-true",
                "--strategy single --precision 32-true --checkpoint-activations",
            ]
        );
        assert_eq!(one.len(), 3 * 2);
    }

    #[test]
    fn the_device_memory_bounds_the_budget_and_is_it_when_none_is_given() {
        let args = |flags: &[&str]| TrainArgs::from_flags(flags).unwrap();
        let (gib, mib) = (1 << 30, 1 << 20);
        let device = |bytes| Budget {
            bytes,
            device_memory: true,
        };
        let given = args(&["--memory-budget", "1GiB"]);
        assert_eq!(
            Budget::on_device(&given, Some(2 * gib)).unwrap(),
            Some(Budget::given(gib))
        );
        assert_eq!(
            Budget::on_device(&given, None).unwrap(),
            Some(Budget::given(gib))
        );
        assert_eq!(Budget::given(gib).note(&given), None);
        let capped = Budget::on_device(&given, Some(512 * mib)).unwrap();
        assert_eq!(capped, Some(device(512 * mib)));
        let note = capped.unwrap().note(&given).unwrap();
        assert!(
            note.contains("1.00 GiB is above the device's memory, 512.00 MiB usable"),
            "{note}"
        );
        let plan = args(&["--plan"]);
        assert_eq!(
            Budget::on_device(&plan, Some(gib)).unwrap(),
            Some(device(gib))
        );
        assert_eq!(Budget::on_device(&plan, None).unwrap(), None);
        let auto = args(&["--strategy", "auto"]);
        assert_eq!(
            Budget::on_device(&auto, Some(1000)).unwrap(),
            Some(device(900)),
            "auto leaves the headroom"
        );
        let above = args(&["--strategy", "auto", "--memory-budget", "1TiB"]);
        assert_eq!(
            Budget::on_device(&above, Some(1000)).unwrap(),
            Some(device(900)),
            "a budget above the device's memory is bounded as none is"
        );
        let within_headroom = args(&["--strategy", "auto", "--memory-budget", "999B"]);
        assert_eq!(
            Budget::on_device(&within_headroom, Some(1000)).unwrap(),
            Some(device(900)),
            "a budget in the headroom is lowered out of it"
        );
        let below = args(&["--strategy", "auto", "--memory-budget", "800B"]);
        assert_eq!(
            Budget::on_device(&below, Some(1000)).unwrap(),
            Some(Budget::given(800))
        );
        let err = Budget::on_device(&auto, None).unwrap_err().to_string();
        assert!(err.contains("give --memory-budget"), "{err}");
    }

    #[test]
    fn zero3_flags_under_auto_on_one_rank_are_refused_before_any_plan() {
        for flags in [["--reshard-after-forward", "true"], ["--offload", "params"]] {
            let auto = ["--strategy", "auto", "--memory-budget", "1G"];
            let args = TrainArgs::from_flags(&[&auto[..], &flags[..]].concat()).unwrap();
            let budget = Budget::given(1 << 30);
            let err = search(&args, 1, &Device::flex(), budget, 4, |_| {
                Ok::<_, TrainError>((0, ()))
            })
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(flags[0]) && err.contains("more than one rank"),
                "{err}"
            );
        }
    }

    #[test]
    fn flags_given_stay_and_disk_comes_after_memory() {
        let ckpt = order(
            &[
                "--strategy",
                "auto",
                "--memory-budget",
                "1G",
                "--checkpoint-activations",
            ],
            2,
        );
        assert!(ckpt.iter().all(|c| c.contains("--checkpoint-activations")));
        assert_eq!(ckpt.len(), 3 * 5);
        let params = order(
            &[
                "--strategy",
                "auto",
                "--memory-budget",
                "1G",
                "--offload",
                "params",
            ],
            2,
        );
        assert!(
            params.iter().all(|c| c.starts_with("--strategy zero3")),
            "{params:?}"
        );
        let disk = order(
            &[
                "--strategy",
                "auto",
                "--memory-budget",
                "1G",
                "--offload-dir",
                "/tmp/o",
            ],
            2,
        );
        assert_eq!(disk.len(), 3 * 2 * 10);
        assert!(disk[..10].iter().all(|c| !c.contains("offload")));
        assert!(
            disk[10..20]
                .iter()
                .all(|c| c.contains("--offload-dir /tmp/o"))
        );
        let fixed = order(&["--strategy", "zero1", "--memory-budget", "1G"], 2);
        assert_eq!(fixed, ["--strategy zero1 --precision 32-true"]);
    }

    /// Flags given for slower candidates are named when the choice does not use them: none
    /// is dropped silently.
    #[test]
    fn the_choice_names_the_flags_it_does_not_use() {
        let flags = [
            "--strategy",
            "auto",
            "--memory-budget",
            "1G",
            "--offload-dir",
            "/tmp/o",
            "--reshard-after-forward",
            "false",
            "--init-on-device",
        ];
        let args = on_cpu(&flags);
        let plan = |c: &TrainArgs| Ok::<_, TrainError>((0, c.clone()));
        let (first, _, choice) =
            search(&args, 2, &Device::flex(), Budget::given(1), 4, plan).unwrap();
        assert_eq!(first.strategy, Strategy::Ddp);
        let said = choice.unwrap().explain();
        for flag in [
            "--offload-dir",
            "--reshard-after-forward",
            "--init-on-device",
        ] {
            assert!(
                said.contains(&format!("not used by this choice: {flag}")),
                "{said}"
            );
        }
        // Only what fits a zero3 on disk in bf16: every flag used.
        let plan = |c: &TrainArgs| {
            let fits = c.strategy == Strategy::Zero3 && c.offload_dir.is_some() && c.init_on_device;
            Ok::<_, TrainError>((if fits { 0 } else { 2 }, ()))
        };
        let (_, _, choice) = search(&args, 2, &Device::flex(), Budget::given(1), 4, plan).unwrap();
        let said = choice.unwrap().explain();
        assert!(!said.contains("not used"), "{said}");
    }

    /// Where only checkpointing fits, auto checkpoints the fewest of the lowest blocks that
    /// fit (bisected); every block where the user asked for that.
    #[test]
    fn auto_checkpoints_the_fewest_blocks_that_fit() {
        // 8 blocks, each checkpointed one saving 10 of 100.
        let plan = |c: &TrainArgs| {
            let planned = 100 - 10 * c.checkpointing().blocks(8).unwrap();
            Ok::<_, TrainError>((planned, ()))
        };
        let budget = Budget::given(55);
        let args = on_cpu(&["--strategy", "auto", "--memory-budget", "1G"]);
        let (chosen, _, choice) = search(&args, 2, &Device::flex(), budget, 8, plan).unwrap();
        assert_eq!(chosen.strategy, Strategy::Ddp);
        assert_eq!(chosen.checkpointing(), Checkpointing::Lowest(5));
        let said = choice.unwrap().explain();
        assert!(
            said.contains("--checkpoint-blocks 5 (planned 50 B"),
            "{said}"
        );
        assert!(
            said.contains("faster, but over the budget: --strategy ddp --precision 32-true --checkpoint-blocks 4 (planned 60 B)"),
            "{said}"
        );
        let given = on_cpu(&[
            "--strategy",
            "auto",
            "--memory-budget",
            "1G",
            "--checkpoint-activations",
        ]);
        let (chosen, _, _) = search(&given, 2, &Device::flex(), budget, 8, plan).unwrap();
        assert_eq!(chosen.checkpointing(), Checkpointing::All);
    }

    /// The loss scaler's flags go with 16-mixed's candidates only: the bf16 ones, which
    /// `validate` refuses them for, are weighed without them (not passed over), and a bf16
    /// choice names them as not used.
    #[test]
    fn loss_scaler_flags_leave_the_bf16_candidates_in() {
        let args = on_cpu(&[
            "--strategy",
            "auto",
            "--memory-budget",
            "1G",
            "--precision",
            "16-mixed",
            "--initial-loss-scale",
            "1024",
            "--max-consecutive-skips",
            "5",
        ]);
        let all = candidates(&args, 2, &Device::flex());
        assert_eq!(all.len(), 3 * 10);
        assert!(
            all[..10]
                .iter()
                .all(|c| c.initial_loss_scale == Some(1024.0))
        );
        assert!(
            all[10..]
                .iter()
                .all(|c| c.initial_loss_scale.is_none() && c.max_consecutive_skips.is_none())
        );
        let plan = |c: &TrainArgs| {
            let fits = c.precision == Precision::Bf16True;
            Ok::<_, TrainError>((if fits { 0 } else { 2 }, ()))
        };
        let (chosen, _, choice) =
            search(&args, 2, &Device::flex(), Budget::given(1), 4, plan).unwrap();
        assert_eq!(chosen.precision, Precision::Bf16True);
        let said = choice.unwrap().explain();
        for flag in ["--initial-loss-scale", "--max-consecutive-skips"] {
            assert!(
                said.contains(&format!("not used by this choice: {flag}")),
                "{said}"
            );
        }
    }
}
