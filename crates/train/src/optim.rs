//! Optimizers from burn-optim, stepped parameter by parameter with their state keyed by
//! parameter path, so the state can be sharded, offloaded and checkpointed by name.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::{MomentumConfig, MomentumState};
use burn::optim::{
    AdamConfig, AdamState, AdamWState, AdaptiveMomentumState, DynOptimizer, DynState, RecordState,
    SgdConfig, SgdState, StateSink, StateSource,
};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burnscale_collective::{Communicator, ReduceOp};
use burnscale_shard::StepGrads;
use burnscale_shard::layout::{self, Slot};

use crate::TrainError;
use crate::adafactor::{Adafactor, AdafactorState};
use crate::adam8bit::AdamW8bit;
use crate::cli::{
    MIN_8BIT_SIZE, MIN_LR_RATIO, Offload, OptimizerKind, Schedule, TrainArgs, value_name,
};
use crate::fused_adamw::FusedAdamW;
use crate::offload::DiskStates;

/// The runner's optimizer: one burn-optim optimizer for decayed parameters (matrices and
/// embeddings, rank >= 2) and one without decay (biases, norms), as nanoGPT configures AdamW
/// (AdamW as [`FusedAdamW`]: burn-optim's values, in one pass over host memory).
/// Under `--optimizer adam8bit`, the matrices that [`AdamW8bit::quantizes`] (and that are not
/// embeddings kept in 32 bits by `--embedding-state-32bit`) get 8-bit state; the rest, as in
/// bitsandbytes, a 32-bit AdamW. Under `--optimizer adafactor`, a step's statistics span
/// every rank's rows of a parameter ([`crate::adafactor`]): they are reduced across the
/// ranks given to [`ParamOptimizer::step`].
///
/// Under `--offload` the state lives in host memory and each parameter is stepped there (on a
/// CPU-only run the host is the device); under `--offload-dir` it lives on disk between steps.
pub struct ParamOptimizer {
    kind: OptimizerKind,
    decay: Arc<dyn DynOptimizer>,
    no_decay: Arc<dyn DynOptimizer>,
    /// `decay` and `no_decay` typed where they are AdamW, which takes each gradient with the
    /// factor it is still to be multiplied by ([`FusedAdamW::step_scaled`]).
    adamw: Option<(Arc<FusedAdamW>, Arc<FusedAdamW>)>,
    /// `--optimizer adam8bit`'s 8-bit AdamW, and the paths of the parameters it steps.
    eight_bit: Option<(Arc<dyn DynOptimizer>, HashSet<String>)>,
    adafactor: Option<Factored>,
    states: HashMap<String, DynState>,
    /// Where parameters are stepped and their state kept; `None`: on the parameter's device.
    host: Option<Device>,
    /// Whether the parameters themselves live on `host` (`--offload params`), so that only
    /// their gradients cross to it.
    params_on_host: bool,
    disk: Option<DiskStates>,
}

impl ParamOptimizer {
    /// The optimizer `args` name, for rank `rank` (whose `--offload-dir` files are its own),
    /// for the parameters of `model` (whole, before any sharding).
    pub fn new<M: Module>(args: &TrainArgs, rank: usize, model: &M) -> Result<Self, TrainError> {
        let adam = args.adam();
        let (b1, b2, eps) = (adam.beta1 as f32, adam.beta2 as f32, adam.epsilon as f32);
        let adafactor = |weight_decay: f64| Adafactor {
            beta_1: args.beta1,
            weight_decay,
            relative_step: args.adafactor_relative_step,
        };
        let build = |weight_decay: f64| -> (Arc<dyn DynOptimizer>, Option<Arc<FusedAdamW>>) {
            let wd = weight_decay as f32;
            let optim: Arc<dyn DynOptimizer> = match args.optimizer {
                OptimizerKind::Adamw | OptimizerKind::Adam8bit => {
                    let adamw = Arc::new(FusedAdamW::new(b1, b2, eps, wd));
                    return (adamw.clone(), Some(adamw));
                }
                OptimizerKind::Adam => Arc::new(
                    AdamConfig::new()
                        .with_beta_1(b1)
                        .with_beta_2(b2)
                        .with_epsilon(eps)
                        .with_weight_decay((wd > 0.0).then(|| WeightDecayConfig::new(wd)))
                        .build(),
                ),
                OptimizerKind::Sgd => Arc::new(
                    SgdConfig::new()
                        .with_momentum((args.sgd_momentum() > 0.0).then(|| {
                            // torch.optim.SGD's dampening (burn-optim's default is 0.1).
                            MomentumConfig::new()
                                .with_momentum(args.sgd_momentum())
                                .with_dampening(0.0)
                        }))
                        .with_weight_decay((wd > 0.0).then(|| WeightDecayConfig::new(wd)))
                        .build(),
                ),
                OptimizerKind::Adafactor => Arc::new(adafactor(weight_decay)),
            };
            (optim, None)
        };
        let disk = match &args.offload_dir {
            Some(dir) => Some(DiskStates::create(dir, rank)?),
            None => None,
        };
        let offload = args.offload != Offload::None || disk.is_some();
        let eight_bit = (args.optimizer == OptimizerKind::Adam8bit).then(|| {
            let optim: Arc<dyn DynOptimizer> = Arc::new(AdamW8bit {
                beta_1: b1,
                beta_2: b2,
                epsilon: eps,
                weight_decay: args.weight_decay() as f32,
            });
            (optim, eight_bit_paths(model, args))
        });
        let adafactor = (args.optimizer == OptimizerKind::Adafactor).then(|| Factored {
            decay: adafactor(args.weight_decay()),
            no_decay: adafactor(0.0),
            slots: layout::slots(model, 1)
                .into_iter()
                .map(|s| (s.path.clone(), s))
                .collect(),
        });
        let ((decay, decay_adamw), (no_decay, no_decay_adamw)) =
            (build(args.weight_decay()), build(0.0));
        Ok(Self {
            kind: args.optimizer,
            decay,
            no_decay,
            adamw: decay_adamw.zip(no_decay_adamw),
            eight_bit,
            adafactor,
            states: HashMap::new(),
            host: offload.then(Device::flex),
            params_on_host: args.offload == Offload::Params,
            disk,
        })
    }

    /// Applies one update to every parameter that has a gradient. `span`: the ranks whose
    /// shards of each parameter this rank's shards are (its ZeRO group), over which
    /// Adafactor's statistics are reduced; `None` when this rank holds whole parameters. If
    /// offloaded state cannot be read or written, the other parameters are still stepped (a
    /// state that could not be written stays in memory), and the first error is returned
    /// with the model.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: impl Into<StepGrads>,
        span: Option<&dyn Communicator>,
    ) -> (M, Result<(), TrainError>) {
        let mut grads = grads.into();
        let spans = match self.adafactor.is_some() {
            true => match self.adafactor_spans(&model, &grads, span) {
                Ok(spans) => Some(spans),
                Err(e) => return (model, Err(e)),
            },
            false => None,
        };
        let mut mapper = StepMapper {
            path: Vec::new(),
            optim: self,
            grads: &mut grads,
            spans: spans.as_ref(),
            lr,
            error: None,
        };
        let model = model.map(&mut mapper);
        (model, mapper.error.map_or(Ok(()), Err))
    }

    /// Adafactor's first two phases over every parameter of `model`: the sums over all rows,
    /// then the update's sum of squares, each reduced across `span` in one collective. A
    /// state this rank cannot read is taken as fresh, so that its part of each reduction has
    /// every rank's layout: all ranks join both reductions, and the first error is returned
    /// after them (returned before, it would leave the others waiting in them).
    fn adafactor_spans<M: Module>(
        &self,
        model: &M,
        grads: &StepGrads,
        span: Option<&dyn Communicator>,
    ) -> Result<Spans, TrainError> {
        let (rank, world) = span.map_or((0, 1), |c| (c.rank(), c.world_size()));
        let mut error = None;
        let mut phase = |sums: Option<&BTreeMap<String, Tensor<1>>>| {
            let mut visit = AdafactorPhase {
                optim: self,
                grads,
                sums,
                rank,
                world,
                path: Vec::new(),
                out: BTreeMap::new(),
                error: None,
            };
            model.visit(&mut visit);
            if let Some(e) = visit.error {
                error.get_or_insert(e);
            }
            reduced(span, visit.out)
        };
        let sums = phase(None)?;
        let update_sq = phase(Some(&sums))?;
        match error {
            Some(e) => Err(e),
            None => Ok(Spans { sums, update_sq }),
        }
    }

    /// Where a parameter on `device` is stepped: the host when offloaded, else `device`.
    fn home(&self, device: &Device) -> Device {
        self.host.clone().unwrap_or_else(|| device.clone())
    }

    /// `tensor` and `grad` where they are stepped ([`ParamOptimizer::home`]); offloaded, the
    /// gradient crosses to the host, and the parameter unless it lives there.
    fn to_home<const D: usize>(
        &self,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        home: &Device,
    ) -> (Tensor<D>, Tensor<D>) {
        (
            self.moved(tensor, home, !self.params_on_host),
            self.moved(grad, home, true),
        )
    }

    fn moved<const D: usize>(&self, t: Tensor<D>, device: &Device, crosses: bool) -> Tensor<D> {
        match self.host.is_some() && crosses {
            true => burnscale_shard::host::transfer(t, device),
            false => t.to_device(device),
        }
    }

    /// Calls `visit` with each parameter's path and its state flattened (tensors by name,
    /// scalars), from memory or from `--offload-dir`, one parameter at a time, in path order.
    pub fn for_each_state(
        &self,
        mut visit: impl FnMut(&str, StateSink) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        let mut paths: Vec<&String> = self.states.keys().collect();
        if let Some(disk) = &self.disk {
            paths.extend(disk.paths());
        }
        paths.sort();
        paths.dedup();
        for path in paths {
            let sink = match self.states.get(path) {
                Some(state) => {
                    let mut sink = StateSink::default();
                    self.optimizer(path, state.rank())
                        .state_flatten(path, state, &mut sink);
                    sink
                }
                None => match &self.disk {
                    Some(disk) => disk.flattened(path)?,
                    None => continue,
                },
            };
            visit(path, sink)?;
        }
        Ok(())
    }

    /// Sets the state of the `rank`-dimensional parameter at `path` from `source` (as
    /// [`ParamOptimizer::for_each_state`] gave it, possibly re-sliced), kept where this
    /// optimizer keeps state: the host when offloaded, else `device`.
    pub fn restore_state(
        &mut self,
        rank: usize,
        path: &str,
        saved: StateSink,
        device: &Device,
    ) -> Result<(), TrainError> {
        let device = self.home(device);
        let state = self.unflatten(rank, path, saved, &device).ok_or_else(|| {
            TrainError::InvalidData(format!(
                "the saved optimizer state of `{path}` does not fit this optimizer: resume with the checkpoint's --optimizer, --min-8bit-size and --embedding-state-32bit (which choose each parameter's 8-bit or 32-bit state)"
            ))
        })?;
        self.put_state(rank, path.to_string(), state)
    }

    /// The state of the `rank`-dimensional parameter at `path` from its flattened form, on
    /// `device`, in the dtype it was saved in. (burn-optim's `state_unflatten` builds every
    /// tensor in the device's default float dtype, f32: a 16-bit parameter's state would come
    /// back f32 and its next step would mix dtypes, so the state is cast back.)
    fn unflatten(
        &self,
        rank: usize,
        path: &str,
        saved: StateSink,
        device: &Device,
    ) -> Option<DynState> {
        let dtype = saved.tensors.first().map(|(_, data)| data.dtype());
        let mut source = StateSource::new(saved.scalars.into_iter().collect());
        for (name, data) in saved.tensors {
            source.insert_tensor(name, data);
        }
        let state = self
            .optimizer(path, rank)
            .state_unflatten(rank, path, &mut source, device)?;
        // 8-bit AdamW's state leads with its byte codes and is never cast.
        match dtype.filter(|d| d.is_float()).map(FloatDType::from) {
            Some(dtype) if dtype != FloatDType::F32 => cast_state(self.kind, state, dtype, device),
            _ => Some(state),
        }
    }

    /// Bytes of optimizer state held in memory (moments, momentum buffers).
    pub fn state_bytes(&self) -> usize {
        self.states
            .iter()
            .map(|(path, state)| {
                let mut sink = StateSink::default();
                self.optimizer(path, state.rank())
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

    /// The optimizer that steps (and keeps the state of) the `rank`-dimensional parameter at
    /// `path`.
    fn optimizer(&self, path: &str, rank: usize) -> &Arc<dyn DynOptimizer> {
        if let Some((optim, paths)) = &self.eight_bit
            && paths.contains(path)
        {
            optim
        } else {
            decayed(rank, &self.decay, &self.no_decay)
        }
    }

    /// [`ParamOptimizer::optimizer`], typed, where it is AdamW.
    fn adamw(&self, path: &str, rank: usize) -> Option<Arc<FusedAdamW>> {
        let (decay, no_decay) = self.adamw.as_ref()?;
        let chosen = Arc::as_ptr(self.optimizer(path, rank));
        [decay, no_decay]
            .into_iter()
            .find(|adamw| std::ptr::addr_eq(Arc::as_ptr(adamw), chosen))
            .cloned()
    }

    /// The state of the `rank`-dimensional parameter at `path`, on `device`, moved out.
    fn take_state(
        &mut self,
        rank: usize,
        path: &str,
        device: &Device,
    ) -> Result<Option<DynState>, TrainError> {
        match self.states.remove(path) {
            Some(state) => Ok(Some(state)),
            None => self.read_state(rank, path, device),
        }
    }

    /// The state of the `rank`-dimensional parameter at `path`, on `device`, left in place.
    fn peek_state(
        &self,
        rank: usize,
        path: &str,
        device: &Device,
    ) -> Result<Option<DynState>, TrainError> {
        match self.states.get(path) {
            Some(state) => Ok(Some(state.clone())),
            None => self.read_state(rank, path, device),
        }
    }

    /// The state of the parameter at `path` from `--offload-dir`, if it has one there.
    fn read_state(
        &self,
        rank: usize,
        path: &str,
        device: &Device,
    ) -> Result<Option<DynState>, TrainError> {
        let Some(saved) = self.disk.as_ref().map(|d| d.flattened(path)).transpose()? else {
            return Ok(None);
        };
        if saved.tensors.is_empty() && saved.scalars.is_empty() {
            return Ok(None);
        }
        self.unflatten(rank, path, saved, device)
            .map(Some)
            .ok_or_else(|| {
                TrainError::InvalidData(format!(
                    "the optimizer state of `{path}` on disk does not fit this optimizer"
                ))
            })
    }

    /// Keeps `state` of the parameter at `path`: on disk under `--offload-dir` (in memory if
    /// that fails, so that nothing is lost), else in memory.
    fn put_state(&mut self, rank: usize, path: String, state: DynState) -> Result<(), TrainError> {
        let optim = self.optimizer(&path, rank).clone();
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

/// `--optimizer adafactor`'s two optimizers (with and without weight decay) and every
/// parameter's place in the layout, by path.
struct Factored {
    decay: Adafactor,
    no_decay: Adafactor,
    slots: HashMap<String, Slot>,
}

impl Factored {
    fn for_rank(&self, rank: usize) -> &Adafactor {
        decayed(rank, &self.decay, &self.no_decay)
    }
}

/// Which of an optimizer's two settings steps a `rank`-dimensional parameter: weight decay
/// for matrices and embeddings (rank >= 2), none for biases and norms (as nanoGPT).
fn decayed<'a, T: ?Sized>(rank: usize, decay: &'a T, no_decay: &'a T) -> &'a T {
    match rank >= 2 {
        true => decay,
        false => no_decay,
    }
}

/// Adafactor's statistics over all rows of each parameter, by path.
struct Spans {
    sums: BTreeMap<String, Tensor<1>>,
    update_sq: BTreeMap<String, Tensor<1>>,
}

/// `values` summed over `span`'s ranks: concatenated in path order (the same on every rank),
/// reduced in one collective, and split again.
fn reduced(
    span: Option<&dyn Communicator>,
    values: BTreeMap<String, Tensor<1>>,
) -> Result<BTreeMap<String, Tensor<1>>, TrainError> {
    let Some(comm) = span.filter(|c| c.world_size() > 1) else {
        return Ok(values);
    };
    if values.is_empty() {
        return Ok(values);
    }
    let lens: Vec<(String, usize)> = values
        .iter()
        .map(|(k, v)| (k.clone(), v.dims()[0]))
        .collect();
    let all = comm.all_reduce_tensor(
        Tensor::cat(values.into_values().collect(), 0),
        ReduceOp::Sum,
    )?;
    let mut start = 0;
    Ok(lens
        .into_iter()
        .map(|(path, len)| {
            start += len;
            (path, all.clone().narrow(0, start - len, len))
        })
        .collect())
}

/// One of Adafactor's first two phases: each parameter's partial sums (`sums` absent), or
/// its update's sum of squares given every row's sums.
struct AdafactorPhase<'a> {
    optim: &'a ParamOptimizer,
    grads: &'a StepGrads,
    sums: Option<&'a BTreeMap<String, Tensor<1>>>,
    rank: usize,
    world: usize,
    path: Vec<String>,
    out: BTreeMap<String, Tensor<1>>,
    error: Option<TrainError>,
}

impl ModuleVisitor for AdafactorPhase<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(grad) = self.grads.get::<D>(param.id) else {
            return;
        };
        let path = self.path.join(".");
        let factored = self.optim.adafactor.as_ref().expect("an Adafactor phase");
        let Some(slot) = factored.slots.get(&path) else {
            self.error.get_or_insert(TrainError::InvalidData(format!(
                "`{path}` is not a parameter of the model the optimizer was built for"
            )));
            return;
        };
        let real = slot.clone().over(self.world).owned_rows(self.rank).1;
        let tensor = param.val().inner();
        let home = self.optim.home(&tensor.device());
        let state = match self.optim.peek_state(D, &path, &home) {
            Ok(state) => state.map(|s| s.downcast::<AdafactorState<D>>()),
            Err(e) => {
                self.error.get_or_insert(e);
                None
            }
        };
        let (tensor, grad) = self.optim.to_home(tensor, grad, &home);
        let adafactor = factored.for_rank(D);
        let out = match self.sums {
            None => adafactor.partial_sums(&tensor, grad, state.as_ref(), real),
            Some(sums) => Some(adafactor.update_sum_sq(
                grad,
                state.as_ref(),
                sums.get(&path),
                &slot.dims,
                real,
            )),
        };
        if let Some(out) = out {
            self.out.insert(path, out);
        }
    }
}

struct StepMapper<'a> {
    path: Vec<String>,
    optim: &'a mut ParamOptimizer,
    grads: &'a mut StepGrads,
    spans: Option<&'a Spans>,
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
        let Some((grad, factor)) = self.grads.remove_with_factor::<D>(param.id) else {
            return param;
        };
        let path = self.path.join(".");
        let adamw = self.optim.adamw(&path, D);
        // The factor reaches AdamW with the gradient on the parameter's device (its kernel
        // multiplies as it reads); offloaded gradients cross to the host multiplied, and the
        // other optimizers take them multiplied.
        let (grad, factor) = match adamw.is_some() && self.optim.host.is_none() {
            true => (grad, factor),
            false => (StepGrads::multiply(grad, factor.as_ref()), None),
        };
        let (id, tensor, mapper) = param.consume();
        let (require_grad, device) = (tensor.is_require_grad(), tensor.device());
        let home = self.optim.home(&device.clone().inner());
        let state = match self.optim.take_state(D, &path, &home) {
            Ok(state) => state,
            Err(e) => {
                self.error.get_or_insert(e);
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        let (on_home, grad) = self.optim.to_home(tensor.inner(), grad, &home);
        let factored = self.optim.adafactor.as_ref().zip(self.spans);
        let (updated, state) = match (factored, adamw) {
            (Some((factored, spans)), _) => {
                let (updated, state) = factored.for_rank(D).finish(
                    self.lr,
                    on_home,
                    grad,
                    state.map(|s| s.downcast::<AdafactorState<D>>()),
                    spans.sums.get(&path),
                    spans.update_sq[&path].clone(),
                    &factored.slots[&path].dims,
                );
                (updated, Some(DynState::create(state, D)))
            }
            (None, Some(adamw)) => {
                let state = state.map(|s| s.downcast::<AdamWState<D>>());
                let (updated, state) = adamw.step_scaled(self.lr, on_home, grad, factor, state);
                (updated, state.map(|s| DynState::create(s, D)))
            }
            (None, None) => {
                let optim = self.optim.optimizer(&path, D).clone();
                let (updated, state) =
                    optim.step_dyn(D, self.lr, on_home.into_bridge(), grad.into_bridge(), state);
                (Tensor::<D>::from_bridge(updated), state)
            }
        };
        if let Some(state) = state
            && let Err(e) = self.optim.put_state(D, path, state)
        {
            self.error.get_or_insert(e);
        }
        let updated =
            self.optim
                .moved(updated, &device.clone().inner(), !self.optim.params_on_host);
        let mut updated = burnscale_nn::autodiff_on(updated, &device);
        if require_grad {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// `Ok` if the optimizer can train `model` as `args` say: `--embedding-state-32bit` has an
/// embedding table to act on, one that trains and would otherwise keep 8-bit state. Checked
/// once on the model given, before any plan or rank.
pub(crate) fn check_trains<M: Module>(model: &M, args: &TrainArgs) -> Result<(), TrainError> {
    if !args.embedding_state_32bit {
        return Ok(());
    }
    let refused = |why: String| {
        Err(TrainError::InvalidArgs(format!(
            "--embedding-state-32bit keeps embedding tables' state in 32 bits, but {why}: drop the flag"
        )))
    };
    let tables = embedding_paths(model);
    if tables.is_empty() {
        return refused("this model has none (no burn `Embedding`)".into());
    }
    let frozen = crate::freeze::known_frozen(model, &args.freeze);
    let trained: Vec<Slot> = layout::slots(model, 1)
        .into_iter()
        .filter(|s| tables.contains(&s.path) && !frozen.contains(&s.id))
        .collect();
    if trained.is_empty() {
        return refused("every embedding table is frozen: they keep no state".into());
    }
    let min = args.min_8bit_size.unwrap_or(MIN_8BIT_SIZE);
    if !trained.iter().any(|s| AdamW8bit::quantizes(&s.dims, min)) {
        let sizes: Vec<String> = trained
            .iter()
            .map(|s| format!("{} {:?}", s.path, s.dims))
            .collect();
        return refused(format!(
            "the embedding tables ({}) are below --min-8bit-size {min} elements, so their state is 32-bit already",
            sizes.join(", ")
        ));
    }
    Ok(())
}

/// The paths of the parameters `--optimizer adam8bit` keeps 8-bit state for (none under
/// another optimizer): matrices of at least `--min-8bit-size` elements, but the embedding
/// tables under `--embedding-state-32bit`.
pub fn eight_bit_paths<M: Module>(model: &M, args: &TrainArgs) -> HashSet<String> {
    if args.optimizer != OptimizerKind::Adam8bit {
        return HashSet::new();
    }
    let kept = match args.embedding_state_32bit {
        true => embedding_paths(model),
        false => HashSet::new(),
    };
    burnscale_shard::layout::slots(model, 1)
        .into_iter()
        .filter(|s| {
            AdamW8bit::quantizes(&s.dims, args.min_8bit_size.unwrap_or(MIN_8BIT_SIZE))
                && !kept.contains(&s.path)
        })
        .map(|s| s.path)
        .collect()
}

/// Bytes of state `args`' optimizer keeps for a parameter of `held` dims (a shard's when
/// sharded) whose weights are `weight` bytes each; `eight_bit`: one of
/// [`eight_bit_paths`]. What [`ParamOptimizer::state_bytes`] reads once the state exists.
pub(crate) fn state_bytes_of(
    args: &TrainArgs,
    held: &[usize],
    weight: usize,
    eight_bit: bool,
) -> usize {
    let numel: usize = held.iter().product();
    let rank = held.len();
    match args.optimizer {
        OptimizerKind::Adam8bit if eight_bit => crate::adam8bit::state_bytes(held),
        OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit => 2 * weight * numel,
        OptimizerKind::Sgd if args.sgd_momentum() > 0.0 => weight * numel,
        OptimizerKind::Sgd => 0,
        // f32 statistics: a matrix's row and column means, a vector's whole second moment;
        // the first moment when it keeps one.
        OptimizerKind::Adafactor => {
            let second = match rank {
                0 | 1 => numel,
                _ => numel / held[rank - 1] + numel / held[rank - 2],
            };
            let first = if args.beta1.is_some() { numel } else { 0 };
            4 * (second + first)
        }
    }
}

/// The paths of `model`'s burn `Embedding` tables.
fn embedding_paths<M: Module>(model: &M) -> HashSet<String> {
    #[derive(Default)]
    struct Find {
        path: Vec<String>,
        owners: Vec<String>,
        embeddings: HashSet<String>,
    }
    impl ModuleVisitor for Find {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.push(name.to_string());
            self.owners.push(container_type.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
            self.owners.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
            if self.owners.last().is_some_and(|o| o == "Struct:Embedding") {
                self.embeddings.insert(self.path.join("."));
            }
        }
    }
    let mut find = Find::default();
    model.visit(&mut find);
    find.embeddings
}

/// `state` (of one of the runner's optimizers) with its tensors cast to `dtype`; `None` for a
/// parameter of a rank no model here has (above 4).
fn cast_state(
    kind: OptimizerKind,
    state: DynState,
    dtype: FloatDType,
    device: &Device,
) -> Option<DynState> {
    Some(match state.rank() {
        1 => cast_ranked::<1>(kind, state, dtype, device),
        2 => cast_ranked::<2>(kind, state, dtype, device),
        3 => cast_ranked::<3>(kind, state, dtype, device),
        4 => cast_ranked::<4>(kind, state, dtype, device),
        _ => return None,
    })
}

fn cast_ranked<const D: usize>(
    kind: OptimizerKind,
    state: DynState,
    dtype: FloatDType,
    device: &Device,
) -> DynState {
    let adaptive = |m: AdaptiveMomentumState<D>| AdaptiveMomentumState {
        time: m.time,
        moment_1: m.moment_1.cast(dtype),
        moment_2: m.moment_2.cast(dtype),
        max_moment_2: m.max_moment_2.map(|t| t.cast(dtype)),
    };
    match kind {
        OptimizerKind::Adam => {
            let momentum = adaptive(state.downcast::<AdamState<D>>().momentum);
            DynState::create(AdamState { momentum }, D)
        }
        OptimizerKind::Sgd => {
            // The velocity is private: read back through its own flattening.
            let momentum = state.downcast::<SgdState<D>>().momentum.map(|m| {
                let mut sink = StateSink::default();
                m.state_flatten("", &mut sink);
                let (_, velocity) = sink.tensors.remove(0);
                MomentumState::new(Tensor::<D>::from_data(velocity, device).cast(dtype))
            });
            DynState::create(SgdState { momentum }, D)
        }
        _ => {
            let momentum = adaptive(state.downcast::<AdamWState<D>>().momentum);
            DynState::create(AdamWState { momentum }, D)
        }
    }
}

/// Learning rate per optimizer step: linear warm-up to `--lr`, then constant, or cosine
/// annealing to `min_lr_ratio * lr` at the last step. The cosine is transformers'
/// `get_cosine_with_min_lr_schedule_with_warmup` at 1-based steps: step `s` of a warm-up of
/// `w` takes `s / w` of the peak, so no step runs at 0 and the peak is the warm-up's last
/// step's, once; step `w + k` of the `n` after it is annealed by `k / n`.
pub struct LrSchedule {
    warmup: usize,
    peak: f64,
    /// The cosine's final rate, and the steps it anneals over.
    cosine: Option<(f64, usize)>,
    step: usize,
}

impl LrSchedule {
    pub fn new(args: &TrainArgs) -> Self {
        let cosine = (args.schedule() == Schedule::Cosine).then(|| {
            let min = args.lr() * args.min_lr_ratio.unwrap_or(MIN_LR_RATIO);
            (min, args.max_steps.saturating_sub(args.warmup_steps).max(1))
        });
        Self {
            warmup: args.warmup_steps,
            peak: args.lr(),
            cosine,
            step: 0,
        }
    }

    /// The flags that make the schedule, each with its value: what a checkpoint records, so
    /// that a resumed run whose schedule is another's says so. A constant rate does not
    /// depend on the run's length.
    pub fn flags(args: &TrainArgs) -> BTreeMap<String, String> {
        let mut flags = BTreeMap::from([
            ("--lr".to_string(), args.lr().to_string()),
            ("--schedule".to_string(), value_name(args.schedule())),
            ("--warmup-steps".to_string(), args.warmup_steps.to_string()),
        ]);
        if args.schedule() == Schedule::Cosine {
            let ratio = args.min_lr_ratio.unwrap_or(MIN_LR_RATIO);
            flags.insert("--min-lr-ratio".to_string(), ratio.to_string());
            flags.insert("--max-steps".to_string(), args.max_steps.to_string());
        }
        flags
    }

    /// What of the schedule `args` give a run does not reach, if anything: a warm-up as long
    /// as the run leaves the schedule after it unread (and, longer, the peak `--lr` too).
    pub fn unreached(args: &TrainArgs) -> Option<String> {
        let (warmup, steps) = (args.warmup_steps, args.max_steps);
        (warmup > 0 && warmup >= steps).then(|| {
            format!(
                "--warmup-steps {warmup} is not below --max-steps {steps}: the run ends in its warm-up, at {:.3e}, {:.0}% of --lr, and never reaches the {} schedule after it",
                args.lr() * steps as f64 / warmup as f64,
                100.0 * steps as f64 / warmup as f64,
                value_name(args.schedule())
            )
        })
    }

    /// The rate for the next optimizer step.
    pub fn lr(&self) -> f64 {
        let step = self.step + 1;
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        match self.cosine {
            Some((min, steps)) => {
                let progress = ((step - self.warmup) as f64 / steps as f64).min(1.0);
                min + (self.peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            None => self.peak,
        }
    }

    /// Moves past an optimizer step taken. A step the loss scaler skipped is not one: the
    /// schedule stays where it was, as HF's Trainer and accelerate leave it (and as Adam's
    /// step count stays).
    pub fn advance(&mut self) {
        self.step += 1;
    }
}

/// The settings the optimizer steps with (`args.optimizer`'s, each with its value, defaults
/// resolved, and which parameters it steps: `--freeze`): what a checkpoint records beside
/// the schedule's flags, so that a resumed run whose optimizer is set otherwise says so.
pub fn optimizer_flags(args: &TrainArgs) -> BTreeMap<String, String> {
    let frozen = match args.freeze.is_empty() {
        true => "none".to_string(),
        false => args.freeze.join(","),
    };
    let mut flags = BTreeMap::from([
        (
            "--weight-decay".to_string(),
            args.weight_decay().to_string(),
        ),
        ("--grad-clip".to_string(), args.grad_clip.to_string()),
        ("--freeze".to_string(), frozen),
    ]);
    let mut set = |flag: &str, value: String| flags.insert(flag.to_string(), value);
    match args.optimizer {
        OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit => {
            let adam = args.adam();
            set("--beta1", adam.beta1.to_string());
            set("--beta2", adam.beta2.to_string());
            set("--adam-epsilon", adam.epsilon.to_string());
        }
        OptimizerKind::Sgd => {
            set("--momentum", args.sgd_momentum().to_string());
        }
        OptimizerKind::Adafactor => {
            let beta1 = args.beta1.map_or("none".to_string(), |b| b.to_string());
            set("--beta1", beta1);
            set(
                "--adafactor-relative-step",
                args.adafactor_relative_step.to_string(),
            );
        }
    }
    if args.optimizer == OptimizerKind::Adam8bit {
        let min = args.min_8bit_size.unwrap_or(MIN_8BIT_SIZE);
        set("--min-8bit-size", min.to_string());
        set(
            "--embedding-state-32bit",
            args.embedding_state_32bit.to_string(),
        );
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> TrainArgs {
        let argv = [&["--lr", "0.1", "--max-steps", "10"][..], extra].concat();
        TrainArgs::from_flags(&argv).unwrap()
    }

    /// The rates of `s`'s first ten steps, each taken.
    fn ten_rates(mut s: LrSchedule) -> Vec<f64> {
        (0..10)
            .map(|_| {
                let lr = s.lr();
                s.advance();
                lr
            })
            .collect()
    }

    #[test]
    fn cosine_with_warmup() {
        // transformers' lambda at steps 1..=10 (warm-up 2, min ratio 0.1): 0.5, 1, then
        // 0.1 + 0.9 * 0.5 * (1 + cos(pi * k / 8)) for k = 1..=8.
        let lrs = ten_rates(LrSchedule::new(&args(&["--warmup-steps", "2"])));
        let near = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(near(lrs[0], 0.05) && near(lrs[1], 0.1), "{lrs:?}");
        assert!(
            lrs.windows(2).skip(1).all(|w| w[1] < w[0]),
            "the peak once: {lrs:?}"
        );
        assert!(near(lrs[5], 0.055), "half-way: {lrs:?}");
        assert!(near(lrs[9], 0.01), "the minimum at the last step: {lrs:?}");
        let lrs = ten_rates(LrSchedule::new(&args(&["--min-lr-ratio", "0"])));
        assert_eq!(lrs.last(), Some(&0.0));
    }

    #[test]
    fn a_run_that_ends_in_its_warm_up_says_so() {
        let note = LrSchedule::unreached(&args(&["--warmup-steps", "40"])).unwrap();
        assert!(
            note.contains("ends in its warm-up, at 2.500e-2, 25% of --lr")
                && note.contains("cosine schedule"),
            "{note}"
        );
        assert!(LrSchedule::unreached(&args(&["--warmup-steps", "10"])).is_some());
        assert!(LrSchedule::unreached(&args(&["--warmup-steps", "9"])).is_none());
        assert!(LrSchedule::unreached(&args(&[])).is_none());
    }

    #[test]
    fn constant_schedule() {
        let flags = |extra: &[&str]| LrSchedule::flags(&args(extra));
        let constant = ["--schedule", "constant"];
        let longer = [&constant[..], &["--max-steps", "40"]].concat();
        assert_eq!(flags(&constant), flags(&longer));
        assert_ne!(flags(&[]), flags(&["--max-steps", "40"]));
        let lrs = ten_rates(LrSchedule::new(&args(&["--schedule", "constant"])));
        assert!(lrs.iter().all(|&lr| lr == 0.1));
    }

    #[test]
    fn embedding_state_32bit_needs_an_embedding_table() {
        use burn::nn::{EmbeddingConfig, LinearConfig};
        let given = ["--optimizer", "adam8bit", "--embedding-state-32bit"];
        let flags = args(&given);
        let device = Device::flex();
        let table = EmbeddingConfig::new(5000, 8).init(&device);
        check_trains(&table, &flags).unwrap();
        assert!(eight_bit_paths(&table, &flags).is_empty());
        let linear = LinearConfig::new(4, 3).init(&device);
        let err = check_trains(&linear, &flags).unwrap_err();
        assert!(err.to_string().contains("this model has none"), "{err}");
        // A table that would keep 32-bit state anyway leaves the flag nothing to do.
        let frozen = args(&[&given[..], &["--freeze", "weight"]].concat());
        let err = check_trains(&table, &frozen).unwrap_err();
        assert!(err.to_string().contains("is frozen"), "{err}");
        let small = EmbeddingConfig::new(500, 8).init(&device);
        let err = check_trains(&small, &flags).unwrap_err();
        assert!(
            err.to_string()
                .contains("(weight [500, 8]) are below --min-8bit-size 4096"),
            "{err}"
        );
        let lower = args(&[&given[..], &["--min-8bit-size", "4000"]].concat());
        check_trains(&small, &lower).unwrap();
    }

    /// Two AdamW steps of a linear layer (a decayed weight, an undecayed bias) with gradients
    /// still to be multiplied by a factor, on cubecl's CPU runtime, where AdamW's kernel
    /// multiplies as it reads: the parameters equal Flex's steps with the gradients multiplied
    /// beforehand, to f32's rounding.
    #[cfg(feature = "cubecl-cpu")]
    #[test]
    fn adamw_takes_the_factor_into_its_kernel() {
        use burn::nn::{Linear, LinearConfig};
        use burn::optim::GradientsParams;
        use burn::tensor::{Distribution, Tolerance};

        let args = args(&["--weight-decay", "0.1"]);
        let host = Device::flex();
        let start = LinearConfig::new(5, 7).init(&host);
        let grads: Vec<_> = (0..2)
            .map(|_| {
                let normal = |dims: Vec<usize>| {
                    Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &host).into_data()
                };
                (normal(vec![5, 7]), normal(vec![1, 7]))
            })
            .collect();
        // Steps by the factors given with the gradients, or with the gradients multiplied.
        let trained = |device: Device, with_factor: bool| {
            let mut model: Linear = start.clone().to_device(&device);
            let mut optim = ParamOptimizer::new(&args, 0, &model).unwrap();
            for (step, (weight, bias)) in grads.iter().enumerate() {
                let factor = 0.25 * (step + 1) as f32;
                let scale = if with_factor { 1.0 } else { factor };
                let grad = |data: &burn::tensor::TensorData| {
                    Tensor::<2>::from_data(data.clone(), &device) * scale
                };
                let mut g = GradientsParams::new();
                g.register(model.weight.id, grad(weight));
                g.register(model.bias.as_ref().unwrap().id, grad(bias).reshape([7]));
                let factor = with_factor.then(|| Tensor::<1>::from_floats([factor], &device));
                let result;
                (model, result) = optim.step(0.01, model, StepGrads::new(g, factor), None);
                result.unwrap();
            }
            let bias = model.bias.unwrap().val().into_data();
            (model.weight.val().into_data(), bias)
        };
        let (want, got) = (trained(host, false), trained(Device::cpu(), true));
        let tolerance = Tolerance::<f32>::rel_abs(1e-5, 1e-7);
        got.0.assert_approx_eq::<f32>(&want.0, tolerance);
        got.1.assert_approx_eq::<f32>(&want.1, tolerance);
    }

    /// `--optimizer sgd` steps as torch.optim.SGD(momentum, weight_decay) does, by its
    /// documented algorithm: g += wd * p (matrices only, here), b = g on the first step and
    /// b = momentum * b + g after (dampening 0), p -= lr * b.
    #[test]
    fn sgd_steps_as_torch_optim_sgd() {
        use burn::nn::{Linear, LinearConfig};
        use burn::optim::GradientsParams;

        let (lr, momentum, wd) = (0.1, 0.9, 0.01);
        let args = args(&["--optimizer", "sgd", "--weight-decay", "0.01"]);
        let device = Device::flex();
        let mut model: Linear = LinearConfig::new(2, 3).init(&device);
        let start = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let mut weight = start(model.weight.val());
        let mut bias = start(model.bias.as_ref().unwrap().val().unsqueeze());
        let (mut weight_buf, mut bias_buf) = (vec![0f32; 6], vec![0f32; 3]);
        let mut optim = ParamOptimizer::new(&args, 0, &model).unwrap();
        for step in 0..3 {
            let grad = |n: usize, shift: f32| -> Vec<f32> {
                (0..n)
                    .map(|i| (i as f32 - shift) * 0.3 + step as f32)
                    .collect()
            };
            let (gw, gb) = (grad(6, 2.0), grad(3, 1.0));
            let mut g = GradientsParams::new();
            g.register(
                model.weight.id,
                Tensor::<2>::from_data(TensorData::new(gw.clone(), [2, 3]), &device),
            );
            g.register(
                model.bias.as_ref().unwrap().id,
                Tensor::<1>::from_data(TensorData::new(gb.clone(), [3]), &device),
            );
            let result;
            (model, result) = optim.step(lr, model, StepGrads::new(g, None), None);
            result.unwrap();
            let torch = |p: &mut [f32], buf: &mut [f32], g: &[f32], decay: f32| {
                for ((p, b), g) in p.iter_mut().zip(buf.iter_mut()).zip(g) {
                    let g = g + decay * *p;
                    *b = if step == 0 { g } else { momentum * *b + g };
                    *p -= lr as f32 * *b;
                }
            };
            torch(&mut weight, &mut weight_buf, &gw, wd);
            torch(&mut bias, &mut bias_buf, &gb, 0.0);
            let got = (
                start(model.weight.val()),
                start(model.bias.as_ref().unwrap().val().unsqueeze()),
            );
            for (got, want) in [(&got.0, &weight), (&got.1, &bias)] {
                for (a, b) in got.iter().zip(want.iter()) {
                    assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                        "step {step}: {got:?} {want:?}"
                    );
                }
            }
        }
    }
}
