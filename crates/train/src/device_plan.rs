//! The memory plan on a cubecl device (a GPU, or cubecl's CPU runtime): what the device's
//! pools will reserve, found by a dry run of the training step before the first real one.
//!
//! The host planner ([`crate::plan`]) composes a peak from what Flex allocates; on a cubecl
//! device Burn's fusion keeps fewer intermediates and the pools round everything to their
//! pages, so that composition does not carry over (one reading: cubecl's CPU runtime
//! reserved 0.63x the host plan). cubecl can instead run a workload for its compilation and
//! tuning alone (`DryRun`): every launch is compiled and dropped, and every allocation is
//! carved from the pools as it would be but left unbacked, costing no device memory. So a
//! zero-valued copy of the model trains a step under a dry run, through the same engine, the
//! same optimizer and the same pools as the run, and the pools' reservation at the end is
//! the plan: the pools' own arithmetic, not a model of it.
//!
//! Two passes: the first compiles and tunes (autotune's measurements run for real and leave
//! their scratch in the pools; they are also what the real first step no longer pays), the
//! second, on a fresh copy from released pages, is read. Each runs the steps that reach the
//! run's peak (`TrainArgs::steps_to_peak`: two, since the optimizer's state exists only from
//! the first step's end, unless the run is one step). The model itself, held beside the
//! copy, is taken off the readings where it lies on the rank's device.
//!
//! The ranks plan each configuration `--strategy auto` weighs ([`crate::auto`]'s candidates,
//! fastest first; the given one alone otherwise) and run the first whose largest plan over
//! the ranks fits the budget, so that every rank chooses alike. The budget is
//! `--memory-budget`, and never more than the device's memory, which cubecl's runtime reads
//! (divided among the processes that draw on one, as every process on a host does on the CPU
//! runtime): a plan above it stops before the first step, as it could not run.

#[cfg(feature = "cube")]
pub use dry::resolve;
use serde::Serialize;

use crate::TrainArgs;
use crate::auto::AutoChoice;
use crate::memory::human_bytes;

/// A device plan: what the pools reserve for this rank's engine, and what its steps add.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DevicePlan {
    /// The pools' reservation with the engine built, before any step (bytes).
    pub engine: usize,
    /// The plan: the reservation after the steps, the device peak the run should reach.
    pub peak: usize,
    /// The steps a pass of the dry run took.
    pub dry_steps: usize,
    /// The dry run's wall time: kernels compiled and tuned there are not compiled again in
    /// the first step.
    pub dry_run_s: f64,
}

impl DevicePlan {
    /// What the steps added to the engine's reservation.
    pub fn steps(&self) -> usize {
        self.peak.saturating_sub(self.engine)
    }

    /// The plan, as `--plan` prints it before the first step.
    pub fn table(&self) -> String {
        format!(
            "  engine built (reserved)  {}\n  + steps (dry run)        {}\n  = device peak            {}\n  (dry run of {} step(s), twice, in {:.1} s: its kernels are compiled and tuned, not the first step's)",
            human_bytes(self.engine),
            human_bytes(self.steps()),
            human_bytes(self.peak),
            self.dry_steps,
            self.dry_run_s
        )
    }
}

/// What a rank runs, as its device plan decided.
pub struct Resolved {
    /// The configuration: the one given, or the one `--strategy auto` chose.
    pub args: TrainArgs,
    /// Its plan on this rank.
    pub plan: DevicePlan,
    /// What `--strategy auto` chose within `--memory-budget`, and what it passed over.
    pub choice: Option<AutoChoice>,
}

/// Each rank's share of its device's memory, from every rank's (capacity, memory, process):
/// the processes that draw on one memory divide it, and the most that share one. cubecl's
/// CPU runtime gives every process on a host the host's memory; within a process its ranks
/// share one device, whose pools each rank's plan reads whole, so they do not divide it again.
#[cfg(any(feature = "cube", test))]
fn shares(ranks: &[[u64; 3]]) -> (Vec<usize>, usize) {
    let processes_on = |memory: u64| {
        let mut processes: Vec<u64> = ranks
            .iter()
            .filter(|&&[_, other, _]| other == memory)
            .map(|&[_, _, process]| process)
            .collect();
        processes.sort_unstable();
        processes.dedup();
        processes.len()
    };
    let sharing: Vec<usize> = ranks
        .iter()
        .map(|&[_, memory, _]| processes_on(memory))
        .collect();
    let shares = ranks
        .iter()
        .zip(&sharing)
        .map(|(&[capacity, ..], &processes)| capacity as usize / processes)
        .collect();
    (shares, sharing.into_iter().max().unwrap_or(1))
}

#[cfg(feature = "cube")]
mod dry {
    use std::collections::HashSet;
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::time::Instant;

    use burn::backend::DispatchDevice;
    use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
    use burn::prelude::*;
    use burn::tensor::DType;
    use burn_cubecl::cubecl::dry_run::DryRun;
    use burnscale_collective::Communicator;

    use super::{DevicePlan, Resolved};
    use crate::auto::{self, Budget};
    use crate::optim::ParamOptimizer;
    use crate::runner::{self, BatchPart, TrainTask};
    use crate::{Strategy, TrainArgs, TrainError};
    use burnscale_collective::gather_u64s;

    /// Plans `model`'s run on this rank of `comm`: `args`' configuration, or under `auto` the
    /// first of its candidates planned within the budget on every rank (an error naming each
    /// plan when none is). The budget is `--memory-budget`, bounded by the device's memory,
    /// which is the budget where none is given ([`Budget::on_device`]). Every rank calls it
    /// together, before its engine is built. `task` is copied, its stream does not move.
    pub fn resolve<T: TrainTask>(
        model: &T::Model,
        task: &T,
        args: &TrainArgs,
        comm: &dyn Communicator,
        device: &Device,
        part: BatchPart,
    ) -> Result<Resolved, TrainError> {
        // The smallest share of any rank bounds them all, so that all weigh one budget.
        let mine = [
            capacity(device).map_or(0, |b| b as u64),
            memory_key(device),
            std::process::id() as u64,
        ];
        let ranks: Vec<[u64; 3]> = gather_u64s(comm, &mine)?
            .into_iter()
            .map(|rank| [rank[0], rank[1], rank[2]])
            .collect();
        let (shares, sharing) = super::shares(&ranks);
        if sharing > 1 && comm.rank() == 0 {
            eprintln!(
                "memory plan: {sharing} processes on a host draw on its memory (cubecl's CPU runtime), and each plans within its share"
            );
        }
        let smallest = shares.into_iter().filter(|&bytes| bytes > 0).min();
        let Some(budget) = Budget::on_device(args, smallest)? else {
            let plan = dry_run(model, task, args, comm, device, part)?;
            return Ok(Resolved {
                args: args.clone(),
                plan,
                choice: None,
            });
        };
        if let Some(note) = budget.note(args).filter(|_| comm.rank() == 0) {
            eprintln!("{note}");
        }
        auto::agree_on_candidates(comm, args, device)?;
        let world = comm.world_size();
        let depth = burnscale_nn::BlockModel::blocks(model).len();
        let (args, plan, choice) = auto::search(args, world, device, budget, depth, |candidate| {
            let plan = dry_run(model, task, candidate, comm, device, part)?;
            // Every rank weighs the largest plan of any, so that all choose alike.
            let peaks = gather_u64s(comm, &[plan.peak as u64])?;
            let largest = peaks.iter().map(|rank| rank[0] as usize).max();
            Ok((largest.unwrap_or(plan.peak), plan))
        })?;
        Ok(Resolved { args, plan, choice })
    }

    /// What `device` can hold, as its cubecl runtime says (a GPU's memory; the host's, or its
    /// cgroup's limit, for the CPU runtime).
    fn capacity(device: &Device) -> Option<usize> {
        match device.clone().without_autodiff().as_dispatch() {
            DispatchDevice::Cube(cube) => cube
                .client()
                .properties()
                .memory
                .max_memory()
                .map(|bytes| bytes as usize),
            _ => None,
        }
    }

    /// Which memory `device` draws on: its host's for cubecl's CPU runtime, equal on every
    /// process of the host; else the device's own (one GPU per rank). A host whose name
    /// cannot be read is taken as not shared. (Hashed alike on every rank: they run one
    /// binary.)
    fn memory_key(device: &Device) -> u64 {
        let host = on_host_memory(device)
            .then(crate::accelerator::host_name)
            .flatten();
        let mut hasher = DefaultHasher::new();
        match host {
            Some(host) => host.hash(&mut hasher),
            None => (std::process::id(), format!("{device:?}")).hash(&mut hasher),
        }
        hasher.finish()
    }

    /// Whether `device` is cubecl's CPU runtime, whose memory is its host's.
    fn on_host_memory(device: &Device) -> bool {
        #[cfg(feature = "cubecl-cpu")]
        let host = Some(Device::cpu());
        #[cfg(not(feature = "cubecl-cpu"))]
        let host: Option<Device> = None;
        host.is_some_and(|cpu| device.clone().without_autodiff() == cpu)
    }

    /// Plans `args`' run on this rank of `comm` by training a zero-valued copy of `model` for
    /// the steps that reach the run's peak under a dry run, twice (see the module's description).
    fn dry_run<T: TrainTask>(
        model: &T::Model,
        task: &T,
        args: &TrainArgs,
        comm: &dyn Communicator,
        device: &Device,
        part: BatchPart,
    ) -> Result<DevicePlan, TrainError> {
        let start = Instant::now();
        let mut read = (0, 0);
        for _pass in 0..2 {
            read = pass(model, task, args, comm, device, part)?;
        }
        let (engine, peak) = read;
        Ok(DevicePlan {
            engine,
            peak,
            dry_steps: args.steps_to_peak(),
            dry_run_s: start.elapsed().as_secs_f64(),
        })
    }

    /// One pass: the pools' reservation once a zero copy's engine is built, and after its
    /// steps.
    fn pass<T: TrainTask>(
        model: &T::Model,
        task: &T,
        args: &TrainArgs,
        comm: &dyn Communicator,
        device: &Device,
        part: BatchPart,
    ) -> Result<(usize, usize), TrainError> {
        // What is queued runs for real before the dry run opens; ranks sharing a device (and
        // the process-wide mode) open and close it together.
        synced(device)?;
        comm.barrier()?;
        let dry = DryRun::new();
        let result = (|| {
            // The copy lies where parameters are initialised and loaded (cubecl's persistent
            // pool), as `model` does. Beside it `model` is held too, which the run does not
            // hold twice (its engine takes it, or drops it once sharded), so its bytes on
            // this device come off the readings.
            let held = bytes_on(model, device);
            let frozen = crate::freeze::known_frozen(model, &args.freeze);
            let copy = device.memory_persistent_allocations(model.clone(), |model| {
                zeros_like(model, init_dtypes(args), &frozen, device)
            });
            let mut optim = ParamOptimizer::new(args, part.rank, &copy)?;
            let mut engine = runner::build_engine(copy, args, comm, device)?;
            let mut task = task.clone();
            synced(device)?;
            comm.barrier()?;
            let engine_built = reserved(device).saturating_sub(held);
            for _ in 0..args.steps_to_peak() {
                runner::micro_steps(&mut engine, &mut task, T::largest_batch, args, device, part)?;
                runner::optimizer_step(&mut engine, &mut optim, args.lr(), args)?;
            }
            // An evaluation's forward, on the validation set's largest batch (every rank the
            // same one, each joining ZeRO-3's gathers): at its own batch size it can reserve
            // more than training.
            if task.eval_batches() > 0 {
                let (input, _) = task.largest_eval_batch(&engine.eval_device());
                runner::check_rows(engine.extent(&input)[0], None)?;
                drop(engine.eval_logits(Some(input))?);
            }
            // Read as the run's device peak is, with the pages the steps emptied still held.
            drained(device)?;
            comm.barrier()?;
            Ok((engine_built, reserved(device).saturating_sub(held)))
        })();
        // Dropped under the dry run, then its pages (never backed) released, before it closes;
        // the constants cached meanwhile hold what no kernel wrote. No rank launches for real
        // until every rank has closed it (the mode is the process's, read at each launch).
        synced(device)?;
        burnscale_nn::device_cache::clear();
        comm.barrier()?;
        drop(dry);
        comm.barrier()?;
        result
    }

    /// The bytes of `model`'s initialised parameters that live on `device`.
    fn bytes_on<M: Module>(model: &M, device: &Device) -> usize {
        struct On<'a>(&'a Device, usize);
        impl ModuleVisitor for On<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if param.is_initialized() {
                    let value = param.val();
                    if value.device() == *self.0 {
                        self.1 += value.shape().num_elements() * value.dtype().size();
                    }
                }
            }
        }
        let mut on = On(device, 0);
        model.visit(&mut on);
        on.1
    }

    /// `device`'s queue drained and its empty pages released.
    fn synced(device: &Device) -> Result<(), TrainError> {
        drained(device)?;
        device.memory_cleanup();
        Ok(())
    }

    /// `device`'s queue drained.
    fn drained(device: &Device) -> Result<(), TrainError> {
        device
            .sync()
            .map_err(|e| TrainError::DryRun(format!("{e:?}")))
    }

    /// What `device`'s pools reserve now (0 where it has none).
    fn reserved(device: &Device) -> usize {
        device
            .memory_pool_usage()
            .map_or(0, |usage| usage.bytes_reserved as usize)
    }

    /// The dtype a lazy parameter initialises in (`--init-on-device` casts it as it does), and
    /// the one a parameter given initialised is in when the engine takes it, where it is not
    /// its own: `--init-on-device` casts it first, except under zero3, whose engine casts its
    /// shards (crate::prepare).
    fn init_dtypes(args: &TrainArgs) -> (DType, Option<DType>) {
        let dtype: DType = args.precision.param_dtype().into();
        match args.init_on_device {
            true => (dtype, (args.strategy != Strategy::Zero3).then_some(dtype)),
            false => (DType::F32, None),
        }
    }

    /// `module` on `device` with every parameter replaced by zeros of its shape and dtype,
    /// under the same id; a lazy one stays lazy (initialised in `dtypes.0`, never through the
    /// original's initialiser, which it would share), an initialised one takes `dtypes.1`
    /// where given; those in `frozen` stay frozen (the engine trains what is tracked). Under a
    /// dry run the zeros are never written.
    fn zeros_like<M: Module>(
        module: M,
        dtypes: (DType, Option<DType>),
        frozen: &HashSet<ParamId>,
        device: &Device,
    ) -> M {
        struct Zeros<'a>((DType, Option<DType>), &'a HashSet<ParamId>, &'a Device);
        impl ModuleMapper for Zeros<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let shape = param.lazy_shape();
                let trains = !self.1.contains(&param.id);
                if !param.is_initialized() {
                    let (dtype, dims) = (self.0.0, shape.clone());
                    // Initialised where burn-nn's initialisers put parameters.
                    let init = move |device: &Device, require_grad: bool| {
                        let zeros = device.memory_persistent_allocations(dims, |dims| {
                            Tensor::zeros(dims, (device, dtype))
                        });
                        match require_grad {
                            true => zeros.require_grad(),
                            false => zeros,
                        }
                    };
                    return Param::uninitialized(param.id, init, self.2.clone(), trains, shape);
                }
                let dtype = self.0.1.unwrap_or_else(|| param.val().dtype());
                let zeros = Tensor::zeros(shape, (self.2, dtype)).set_require_grad(trains);
                Param::initialized(param.id, zeros)
            }
        }
        module.map(&mut Zeros(dtypes, frozen, device))
    }
}

#[cfg(test)]
mod tests {
    use super::shares;

    #[test]
    fn processes_drawing_on_one_memory_divide_it() {
        // On one host's CPU runtime (memory 7): process 1's two thread ranks, processes 2 and
        // 3; and a GPU of its own (memory 9).
        let ranks = [[96, 7, 1], [96, 7, 1], [96, 7, 2], [96, 7, 3], [40, 9, 4]];
        assert_eq!(shares(&ranks), (vec![32, 32, 32, 32, 40], 3));
        // Thread ranks of one process share its device's pools, which each one's plan reads.
        let ranks = [[96, 7, 1], [96, 7, 1]];
        assert_eq!(shares(&ranks), (vec![96, 96], 1));
        // One GPU per rank: each has the whole of its own.
        let ranks = [[80, 1, 5], [80, 2, 6]];
        assert_eq!(shares(&ranks), (vec![80, 80], 1));
    }
}
