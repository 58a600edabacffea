//! Optimizers from burn-optim, stepped parameter by parameter with their state keyed by
//! parameter path, so the state can be sharded, offloaded and checkpointed by name.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, DynOptimizer, DynState, GradientsParams, SgdConfig, StateSink,
};
use burn::prelude::*;

use crate::TrainError;
use crate::cli::{Offload, OptimizerKind, Schedule, TrainArgs, value_name};
use crate::offload::DiskStates;

/// The runner's optimizer: one burn-optim optimizer for decayed parameters (matrices and
/// embeddings, rank >= 2) and one without decay (biases, norms), as nanoGPT configures AdamW.
///
/// Under `--offload` the state lives in host memory and each parameter is stepped there (on a
/// CPU-only run the host is the device); under `--offload-dir` it lives on disk between steps.
pub struct ParamOptimizer {
    decay: Arc<dyn DynOptimizer>,
    no_decay: Arc<dyn DynOptimizer>,
    states: HashMap<String, DynState>,
    /// Where parameters are stepped and their state kept; `None`: on the parameter's device.
    host: Option<Device>,
    /// Whether the parameters themselves live on `host` (`--offload params`), so that only
    /// their gradients cross to it.
    params_on_host: bool,
    disk: Option<DiskStates>,
}

impl ParamOptimizer {
    /// The optimizer `args` name, for rank `rank` (whose `--offload-dir` files are its own).
    pub fn new(args: &TrainArgs, rank: usize) -> Result<Self, TrainError> {
        let build = |weight_decay: f64| -> Result<Arc<dyn DynOptimizer>, TrainError> {
            let (b1, b2, wd) = (args.beta1 as f32, args.beta2 as f32, weight_decay as f32);
            Ok(match args.optimizer {
                OptimizerKind::Adamw => Arc::new(
                    AdamWConfig::new()
                        .with_beta_1(b1)
                        .with_beta_2(b2)
                        .with_epsilon(1e-8)
                        .with_weight_decay(wd)
                        .build(),
                ),
                OptimizerKind::Adam => Arc::new(
                    AdamConfig::new()
                        .with_beta_1(b1)
                        .with_beta_2(b2)
                        .with_epsilon(1e-8)
                        .with_weight_decay((wd > 0.0).then(|| WeightDecayConfig::new(wd)))
                        .build(),
                ),
                OptimizerKind::Sgd => Arc::new(
                    SgdConfig::new()
                        .with_momentum(
                            (args.momentum > 0.0)
                                .then(|| MomentumConfig::new().with_momentum(args.momentum)),
                        )
                        .with_weight_decay((wd > 0.0).then(|| WeightDecayConfig::new(wd)))
                        .build(),
                ),
                other => {
                    return Err(TrainError::NotYetSupported(format!(
                        "--optimizer {}",
                        value_name(other)
                    )));
                }
            })
        };
        let disk = match &args.offload_dir {
            Some(dir) => Some(DiskStates::create(dir, rank)?),
            None => None,
        };
        let offload = args.offload != Offload::None || disk.is_some();
        Ok(Self {
            decay: build(args.weight_decay)?,
            no_decay: build(0.0)?,
            states: HashMap::new(),
            host: offload.then(Device::flex),
            params_on_host: args.offload == Offload::Params,
            disk,
        })
    }

    /// Applies one update to every parameter that has a gradient. If offloaded state cannot
    /// be read or written, the other parameters are still stepped (a state that could not be
    /// written stays in memory), and the first error is returned with the model.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        mut grads: GradientsParams,
    ) -> (M, Result<(), TrainError>) {
        let mut mapper = StepMapper {
            path: Vec::new(),
            optim: self,
            grads: &mut grads,
            lr,
            error: None,
        };
        let model = model.map(&mut mapper);
        (model, mapper.error.map_or(Ok(()), Err))
    }

    /// Bytes of optimizer state held in memory (moments, momentum buffers).
    pub fn state_bytes(&self) -> usize {
        self.states
            .iter()
            .map(|(path, state)| {
                let mut sink = StateSink::default();
                self.for_rank(state.rank())
                    .state_flatten(path, state, &mut sink);
                sink.tensors
                    .iter()
                    .map(|(_, d)| d.num_elements() * d.dtype().size())
                    .sum::<usize>()
            })
            .sum()
    }

    /// Bytes of optimizer state in `--offload-dir` files.
    pub fn offloaded_bytes(&self) -> usize {
        self.disk.as_ref().map_or(0, DiskStates::bytes)
    }

    fn for_rank(&self, rank: usize) -> &Arc<dyn DynOptimizer> {
        if rank >= 2 {
            &self.decay
        } else {
            &self.no_decay
        }
    }

    /// The state of the `rank`-dimensional parameter at `path`, on `device`.
    fn take_state(
        &mut self,
        rank: usize,
        path: &str,
        device: &Device,
    ) -> Result<Option<DynState>, TrainError> {
        if let Some(state) = self.states.remove(path) {
            return Ok(Some(state));
        }
        match &self.disk {
            Some(disk) => disk.load(self.for_rank(rank).as_ref(), rank, path, device),
            None => Ok(None),
        }
    }

    /// Keeps `state` of the parameter at `path`: on disk under `--offload-dir` (in memory if
    /// that fails, so that nothing is lost), else in memory.
    fn put_state(&mut self, rank: usize, path: String, state: DynState) -> Result<(), TrainError> {
        let optim = self.for_rank(rank).clone();
        let stored = match &mut self.disk {
            Some(disk) => disk.store(optim.as_ref(), &path, &state),
            None => {
                self.states.insert(path, state);
                return Ok(());
            }
        };
        if stored.is_err() {
            self.states.insert(path, state);
        }
        stored
    }
}

struct StepMapper<'a> {
    path: Vec<String>,
    optim: &'a mut ParamOptimizer,
    grads: &'a mut GradientsParams,
    lr: f64,
    error: Option<TrainError>,
}

impl ModuleMapper for StepMapper<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(grad) = self.grads.remove::<D>(param.id) else {
            return param;
        };
        let path = self.path.join(".");
        let (id, tensor, mapper) = param.consume();
        let (require_grad, device) = (tensor.is_require_grad(), tensor.device());
        let home = match &self.optim.host {
            Some(host) => host.clone(),
            None => device.clone().inner(),
        };
        let state = match self.optim.take_state(D, &path, &home) {
            Ok(state) => state,
            Err(e) => {
                self.error.get_or_insert(e);
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        // Offloaded, the gradient crosses to the host, and the parameter there and back
        // unless it lives there.
        let crosses = |moved: bool| self.optim.host.is_some() && moved;
        let (param_crosses, grad_crosses) = (crosses(!self.optim.params_on_host), crosses(true));
        let to = |t: Tensor<D>, device: &Device, crosses: bool| match crosses {
            true => burnscale_shard::host::transfer(t, device),
            false => t.to_device(device),
        };
        let optim = self.optim.for_rank(D).clone();
        let (updated, state) = optim.step_dyn(
            D,
            self.lr,
            to(tensor.inner(), &home, param_crosses).into_bridge(),
            to(grad, &home, grad_crosses).into_bridge(),
            state,
        );
        if let Some(state) = state
            && let Err(e) = self.optim.put_state(D, path, state)
        {
            self.error.get_or_insert(e);
        }
        let updated = to(
            Tensor::<D>::from_bridge(updated),
            &device.clone().inner(),
            param_crosses,
        );
        let mut updated = burnscale_nn::autodiff_on(updated, &device);
        if require_grad {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// Learning rate per optimizer step: linear warm-up, then constant or burn-optim's cosine
/// annealing down to `min_lr_ratio * lr` at the last step.
pub struct LrSchedule {
    warmup: usize,
    peak: f64,
    cosine: Option<ModuleLrScheduler>,
    step: usize,
}

impl LrSchedule {
    pub fn new(args: &TrainArgs) -> Result<Self, TrainError> {
        let cosine = match args.schedule {
            Schedule::Constant => None,
            Schedule::Cosine => Some(
                CosineAnnealingLrSchedulerConfig::new(
                    args.lr,
                    args.max_steps.saturating_sub(args.warmup_steps).max(1),
                )
                .with_min_lr(args.lr * args.min_lr_ratio)
                .init()
                .map_err(TrainError::InvalidArgs)?,
            ),
        };
        Ok(Self {
            warmup: args.warmup_steps,
            peak: args.lr,
            cosine,
            step: 0,
        })
    }

    /// The rate for the next optimizer step.
    pub fn next_lr(&mut self) -> f64 {
        self.step += 1;
        if self.step <= self.warmup {
            return self.peak * self.step as f64 / self.warmup as f64;
        }
        match &mut self.cosine {
            Some(cosine) => cosine.step().base(),
            None => self.peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> TrainArgs {
        let argv = [&["--lr", "0.1", "--max-steps", "10"][..], extra].concat();
        TrainArgs::from_flags(&argv).unwrap()
    }

    #[test]
    fn cosine_with_warmup() {
        let mut s = LrSchedule::new(&args(&["--warmup-steps", "2"])).unwrap();
        let lrs: Vec<f64> = (0..10).map(|_| s.next_lr()).collect();
        assert!((lrs[0] - 0.05).abs() < 1e-12 && (lrs[1] - 0.1).abs() < 1e-12);
        assert!((lrs[2] - 0.1).abs() < 1e-12, "cosine starts at the peak");
        assert!(lrs.windows(2).skip(2).all(|w| w[1] < w[0]), "{lrs:?}");
        assert!(lrs[9] > 0.01 && lrs[9] < 0.03, "{lrs:?}");
    }

    #[test]
    fn constant_schedule() {
        let mut s = LrSchedule::new(&args(&["--schedule", "constant"])).unwrap();
        assert!((0..10).all(|_| s.next_lr() == 0.1));
    }
}
