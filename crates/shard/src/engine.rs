use std::collections::{HashMap, HashSet};

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType as TensorDType, FloatDType, Gradients};
use burnscale_collective::{Communicator, DType, ReduceOp, gather_u64s, tensor_dtype};
use burnscale_nn::{
    BlockModel, Flops, RootWeights, autocast, autodiff_on, dropout, regather, selective,
};
use burnscale_precision::{LossScaler, Precision, ScalerConfig};

use crate::layout::{self, Slot};
use crate::params::{self, Flat, Track};
use crate::{
    CheckpointMode, Checkpointing, ShardError, Sharding, Share, StepGrads, Strategy, host,
};

/// The root's units: the embeddings', then the rest (the head's); blocks follow them.
const EMBEDDINGS: usize = 0;
const HEAD: usize = 1;
const FIRST_BLOCK: usize = 2;

/// DDP's default gradient bucket: 25 MB of f32.
pub const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;
/// The model is moved out only during a step; a step whose collective failed leaves none (the
/// group is broken: the caller drops the engine, as [`Sharded::step`] says).
const PRESENT: &str = "a Sharded engine whose step returned an error cannot be used again: drop it";

/// One rank's view of a model trained under a [`Strategy`]: what the rank holds, and the
/// collectives that keep the ranks in step. Every rank must call the same methods in the same
/// order. A micro-step reads this rank's slice of the global batch. Where gradients are
/// whole (DDP, ZeRO-1) they are summed locally over the micro-steps of an optimizer step (no
/// collective until the last one, as `no_sync`), then averaged over the ranks; where they
/// are sharded (ZeRO-2/3) every micro-step reduce-scatters its own and the shards are
/// summed, as DeepSpeed and FSDP2 do, so that no full gradient sum outlives a micro-step.
///
/// Everything lives on the rank's device as tensors (parameters, shards, gathered units,
/// gradients, optimizer state) and the collectives take and return tensors; only
/// `offload_params` and the optimizer's own offload move anything to the host.
pub struct Sharded<'c, M: BlockModel> {
    sharding: Sharding,
    comm: &'c dyn Communicator,
    device: Device,
    slots: Vec<Slot>,
    /// Slot indices moved by one collective, in consecutive groups of at most 25 MB (DDP's
    /// gradient buckets; also the broadcast and ZeRO-1/2's all-gather after a step).
    buckets: Vec<Vec<usize>>,
    /// Slot indices of each unit: the parameters the embeddings read, the rest of the root
    /// (the head's), then each block. Sharded parameters are gathered unit by unit; sharded
    /// gradients are reduce-scattered unit by unit as backward leaves each one.
    units: Vec<Vec<usize>>,
    /// The units the head reads: its own, and the embeddings' when it shares their
    /// parameters (a decoder reading the word embeddings).
    head_units: Vec<usize>,
    /// The full replica, or this rank's shards when parameters are sharded.
    model: Option<M>,
    /// The parameters rank 0's model had frozen (`require_grad` false): gathered and set
    /// untracked, so that no backward gives them a gradient; never reduced, so never stepped
    /// (no optimizer state), as PyTorch leaves a parameter whose `.grad` stays `None`.
    frozen: HashSet<ParamId>,
    /// The whole model's FLOP count, taken before it was sharded.
    flops: Flops,
    /// The parameters outside the blocks that `flops` counts, as each runs.
    root_weights: Vec<RootWeights>,
    /// This rank's own gradients not reduced yet (flat, in the gradient dtype): whole ones
    /// summed over the micro-steps of an optimizer step; sharded ones only until their
    /// unit's or bucket's reduce-scatter in the same micro-step.
    local: Flat,
    /// Gradients after the collective (flat, in the gradient dtype): full, or this rank's
    /// shards, summed over the micro-steps.
    reduced: Flat,
    /// The parameters this rank's backward reached in this step. The others' reductions
    /// count zeros (every rank joins each collective), but, as in PyTorch and a plain Burn
    /// loop, the optimizer does not step them (AdamW would decay them): BigBird's pooler,
    /// which its classifier does not read. Every rank runs the same graph, so they agree.
    reached: HashSet<ParamId>,
    /// The most gradient bytes (`local` and `reduced` together) held at once so far in this
    /// step, and in the last finished one.
    grad_peak: usize,
    grad_bytes: usize,
    /// This step's micro-step losses (each its share of the step's), on the device:
    /// read once, when the step ends, so that nothing waits for the device mid-step.
    losses: Vec<Tensor<1>>,
    /// How many blocks, from the lowest, are checkpointed (keep only their input, and under
    /// [`CheckpointMode::Selective`] their linears' outputs).
    checkpointed: usize,
    checkpoint_mode: CheckpointMode,
    precision: Precision,
    /// Where the parameter shards live between uses when offloaded (else the device).
    home: Option<Device>,
    /// The dtype gradients travel in when reduced over the ranks.
    reduce_dtype: DType,
    scaler: Option<LossScaler>,
}

/// What [`Sharded::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// This rank's part of the step's loss, the sum of its micro-steps' [`Share`]s of it,
    /// taken as the engine takes the gradients: the mean over the ranks of these parts is
    /// the step's loss (over every item of the global batch), whereas one rank's part
    /// alone is that only on one rank.
    pub loss: f64,
    /// The global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// Whether the loss scaler skipped the update (the gradients overflowed).
    pub skipped: bool,
}

/// `Ok` if every rank's model has rank 0's parameters (paths and shapes), before any value is
/// sent: else every rank stops naming the ranks whose model differs (rank 0 included, which
/// a broadcast's length check alone would leave waiting for them in the next collective).
fn same_layout_on_every_rank(comm: &dyn Communicator, slots: &[Slot]) -> Result<(), ShardError> {
    let all = gather_u64s(comm, &layout::fingerprint(slots))?;
    let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    match differ.first() {
        None => Ok(()),
        Some(&first) => Err(ShardError::ModelMismatch {
            rank: comm.rank(),
            detail: format!(
                "the models of ranks {differ:?} are not rank 0's (rank {first}: {} parameters of {} values, rank 0: {} of {}, or their paths, shapes or tied weights differ): build the same model on every rank",
                all[first][0], all[first][1], all[0][0], all[0][1]
            ),
        }),
    }
}

impl<'c, M: BlockModel> Sharded<'c, M> {
    /// Applies `strategy` to `model` on `device`. Every rank starts from rank 0's parameters
    /// (broadcast), then keeps what the strategy gives it.
    pub fn new(
        strategy: Strategy,
        model: M,
        comm: &'c dyn Communicator,
        device: &Device,
    ) -> Result<Self, ShardError> {
        let slots = layout::slots(&model, comm.world_size());
        // First: every rank then stops alike on what follows (a tied parameter included).
        if comm.world_size() > 1 {
            same_layout_on_every_rank(comm, &slots)?;
        }
        if let Some(slot) = slots.iter().find(|s| s.numel() == 0) {
            return Err(ShardError::EmptyParameter {
                path: slot.path.clone(),
                dims: slot.dims.clone(),
            });
        }
        let mut index: HashMap<ParamId, usize> = HashMap::new();
        for (i, slot) in slots.iter().enumerate() {
            if let Some(first) = index.insert(slot.id, i) {
                return Err(ShardError::SharedParameter {
                    first: slots[first].path.clone(),
                    second: slot.path.clone(),
                });
            }
        }
        let buckets = layout::buckets(&slots, BUCKET_ELEMS)
            .into_iter()
            .map(|range| range.collect())
            .collect();
        let (units, head_units) = {
            // A clone only for the ids (dropped here: a lazy model's clones share its values).
            let mut root = model.clone();
            let blocks = root.take_blocks();
            let embedding = root.embedding_params();
            let (embeddings, head): (Vec<ParamId>, Vec<ParamId>) = params::param_ids(&root)
                .into_iter()
                .partition(|id| embedding.contains(id));
            let head_units = match root.head_params().iter().any(|id| embedding.contains(id)) {
                true => vec![EMBEDDINGS, HEAD],
                false => vec![HEAD],
            };
            let units = [embeddings, head]
                .into_iter()
                .chain(blocks.iter().map(params::param_ids))
                .map(|ids| ids.iter().map(|id| index[id]).collect())
                .collect();
            (units, head_units)
        };
        let sharding = strategy.sharding();
        let mut this = Self {
            sharding,
            comm,
            device: device.clone(),
            slots,
            buckets,
            units,
            head_units,
            model: None,
            frozen: HashSet::new(),
            flops: model.flops(),
            root_weights: model.root_weights(),
            local: HashMap::new(),
            reached: HashSet::new(),
            reduced: HashMap::new(),
            grad_peak: 0,
            grad_bytes: 0,
            losses: Vec::new(),
            checkpointed: 0,
            checkpoint_mode: CheckpointMode::Full,
            precision: Precision::F32True,
            home: None,
            reduce_dtype: DType::F32,
            scaler: None,
        };
        // Rank 0's frozen parameters are every rank's, known before any value is set tracked.
        this.model = Some(if sharding.parameters {
            let (model, frozen) = this.shard_from_rank0(model)?;
            this.frozen = this.frozen_on_every_rank(frozen)?;
            model
        } else {
            let frozen = match this.comm.rank() {
                0 => params::frozen(&model, None),
                _ => HashSet::new(),
            };
            this.frozen = this.frozen_on_every_rank(frozen)?;
            this.broadcast_from_rank0(model)?
        });
        if this.slots.iter().all(|slot| this.frozen.contains(&slot.id)) {
            return Err(ShardError::AllFrozen);
        }
        Ok(this)
    }

    /// Per-block activation checkpointing of the blocks `checkpointing` names: each keeps
    /// only its input in forward (and, `mode` selective, its linears' outputs) and is
    /// recomputed in backward (sharded, from its parameters gathered again, or kept gathered
    /// when not resharded after forward); the others keep their graphs.
    pub fn checkpoint_activations(
        mut self,
        checkpointing: Checkpointing,
        mode: CheckpointMode,
    ) -> Result<Self, ShardError> {
        self.checkpointed = checkpointing.blocks(self.units.len() - FIRST_BLOCK)?;
        self.checkpoint_mode = mode;
        Ok(self)
    }

    /// How many blocks backward recomputes ([`Sharded::checkpoint_activations`]): those
    /// checkpointed but the frozen ones below the lowest that trains, which run once, outside
    /// autodiff.
    pub fn recomputed_blocks(&self) -> usize {
        self.checkpointed.saturating_sub(self.frozen_below())
    }

    /// Whether sharded parameters are dropped after each unit's forward and gathered again
    /// for its backward (the default), or kept gathered from forward to the end of backward
    /// ([`Sharding::reshard_after_forward`]). Only sharded parameters can be resharded.
    pub fn reshard_after_forward(mut self, on: bool) -> Result<Self, ShardError> {
        if !self.sharding.parameters {
            return Err(ShardError::NotSharded(
                "reshard_after_forward chooses when gathered parameter shards are dropped (zero3)",
            ));
        }
        self.sharding.reshard_after_forward = on;
        Ok(self)
    }

    /// Trains under `precision`: the `*-true` policies keep the weights (and so the optimizer
    /// state) in 16 bits; the mixed ones keep f32 masters and run each forward on a 16-bit
    /// copy with autocast; `16-mixed` scales the loss with `scaler`.
    pub fn precision(mut self, precision: Precision, scaler: ScalerConfig) -> Self {
        self.precision = precision;
        self.scaler = precision.scales_loss().then(|| LossScaler::new(scaler));
        if precision.has_16bit_weights() {
            let model = self.model.take().expect(PRESENT);
            self.model = Some(burnscale_precision::cast(model, precision.param_dtype()));
        }
        self
    }

    /// Keeps this rank's parameter shards on `host` between uses (ZeRO-3's parameter
    /// offload): each unit's shards are moved to the device as it is gathered, and the shards
    /// are stepped where they live.
    pub fn offload_params(mut self, host: Device) -> Result<Self, ShardError> {
        if !self.sharding.parameters {
            return Err(ShardError::NotSharded(
                "parameter offload keeps the parameter shards of zero3 on the host",
            ));
        }
        let model = self.model.take().expect(PRESENT);
        self.model = Some(model.to_device(&host));
        self.home = Some(host);
        Ok(self)
    }

    /// Reduces gradients over the ranks in `dtype` (f32 by default; bf16 or f16 halve the
    /// traffic at the cost of rounding the sum).
    pub fn reduce_dtype(mut self, dtype: DType) -> Self {
        self.reduce_dtype = dtype;
        self
    }

    /// The loss scale (`16-mixed`) and the steps it skipped so far.
    pub fn loss_scale(&self) -> Option<(f64, usize)> {
        self.scaler.as_ref().map(|s| (s.scale(), s.skipped()))
    }

    /// `module` as forward runs it: a 16-bit copy under the mixed policies.
    fn compute<U: Module>(&self, module: U) -> U {
        if self.precision.is_mixed() {
            burnscale_precision::cast(module, self.precision.compute_dtype())
        } else {
            module
        }
    }

    /// The loss backward starts from: the micro-step's `share` of the step's, times the loss
    /// scale. Keeps that share for the step's report, unread.
    fn scaled(&mut self, loss: Tensor<1>, share: &Share) -> Tensor<1> {
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let loss = share.of(loss, self.comm.world_size());
        self.losses
            .push(loss.clone().inner().cast(TensorDType::F32));
        loss * scale
    }

    /// This step's loss (the sum of its micro-steps' shares): the step's one read of it.
    fn step_loss(&mut self) -> f64 {
        let losses = std::mem::take(&mut self.losses);
        if losses.is_empty() {
            return 0.0;
        }
        let values = Tensor::cat(losses, 0).into_data();
        values.iter::<f32>().map(f64::from).sum()
    }

    /// The items the model's loss scores in `target` ([`BlockModel::loss_items`]).
    pub fn loss_items(&self, target: &M::Target) -> Option<Tensor<1>> {
        self.model.as_ref().expect(PRESENT).loss_items(target)
    }

    /// Runs forward and backward on one micro-batch (this rank's slice), its loss taken as
    /// its `share` of the step's. Sharded gradients are reduce-scattered every micro-step;
    /// whole ones on the `last` micro-step of an optimizer step. Its loss is reported by
    /// [`Sharded::step`].
    pub fn micro_step(
        &mut self,
        input: M::Input,
        target: M::Target,
        share: &Share,
        last: bool,
    ) -> Result<(), ShardError> {
        if let Share::Even(0) = share {
            return Err(ShardError::NoMicroBatches);
        }
        // Checkpointed blocks are recomputed block by block; gathered units are dropped as
        // backward leaves each (or, resharded, their weights after forward); and in later
        // micro-steps of an accumulation into whole sums a plain backward would hand back
        // every gradient at once, a second whole copy beside the sums.
        if self.checkpointed > 0 || self.acting().parameters || !self.local.is_empty() {
            return self.blockwise_micro_step(input, target, share, last);
        }
        // The whole model in one graph: a replica's own, or the shards of a rank acting as one
        // (alone, they are its whole parameters: taken as they are, tracked).
        let units: Vec<usize> = (0..self.units.len()).collect();
        let model = self.unit(self.model.as_ref().expect(PRESENT), &units, true)?;
        let loss = {
            let _autocast = autocast::scope(self.precision.is_mixed());
            model.loss(input, target)
        };
        let loss = self.scaled(loss, share);
        self.add_grads(&model, loss.backward());
        if last || self.sharding.gradients {
            for bucket in self.all_buckets() {
                self.reduce(bucket)?;
            }
        }
        Ok(())
    }

    /// Skips the step if any rank's gradients overflowed (`16-mixed`), measures their global
    /// L2 norm (unscaled, taken across shards), and hands this rank's part of the model with
    /// its gradients to `optimize`, then redistributes the result. The gradients come with the
    /// factor that unscales them and clips them to a norm of `max_norm` (0: only measures),
    /// which the optimizer applies as it steps each one ([`StepGrads`]).
    ///
    /// Called while whole gradients wait for their reduction (no micro-step passed `last`
    /// since the last step, under DDP or ZeRO-1), it fails before anything is taken. Any other
    /// error here (a collective that failed, a peer gone) leaves the engine without its
    /// model: it is to be dropped, as a broken process group is, not used again. Keeping the
    /// old parameters to fall back on would hold them twice at the step's peak.
    pub fn step(
        &mut self,
        max_norm: f64,
        optimize: impl FnOnce(M, StepGrads) -> M,
    ) -> Result<StepOutcome, ShardError> {
        // Unreduced, they would step nothing now and twice over in the next step.
        if !self.local.is_empty() {
            return Err(ShardError::UnreducedGradients);
        }
        let world = self.comm.world_size();
        let mut grads = std::mem::take(&mut self.reduced);
        let reached = std::mem::take(&mut self.reached);
        self.grad_bytes = std::mem::take(&mut self.grad_peak);
        let unscale = self.scaler.as_ref().map(|s| 1.0 / s.scale());
        // The squared norm stays on the device (summed over the ranks when sharded; when
        // replicated, the ranks' mean of their equal norms, so that they skip or clip alike:
        // a sum carries any rank's NaN on every engine, where a maximum may drop it): not finite
        // when any gradient overflowed (or squares past f32's range, a norm, still scaled,
        // above ~1.8e19). Unscaling the sum is exact for power-of-two loss scales (the
        // scaler's default and its steps), one rounding otherwise.
        let mut sum_sq = self.squared_norm(&grads);
        if let Some(unscale) = unscale {
            sum_sq = sum_sq * (unscale * unscale);
        }
        if world > 1 && (self.sharding.optimizer_state || self.scaler.is_some()) {
            let op = match self.sharding.optimizer_state {
                true => ReduceOp::Sum,
                false => ReduceOp::Mean,
            };
            sum_sq = self.comm.all_reduce_tensor(sum_sq, op)?;
        }
        // Only a loss scaler decides on the host, before the update (and that read serves
        // the report too).
        let mut read_sum_sq = None;
        if let Some(scaler) = self.scaler.as_mut() {
            let value = sum_sq.clone().into_scalar::<f32>();
            read_sum_sq = Some(value);
            if !scaler.update(!value.is_finite())? {
                return Ok(StepOutcome {
                    loss: self.step_loss(),
                    grad_norm: f64::INFINITY,
                    skipped: true,
                });
            }
        }
        let factor = match (unscale, max_norm > 0.0) {
            (None, false) => None,
            (Some(unscale), false) => Some(Tensor::full(
                [1],
                unscale,
                (&self.inner_device(), TensorDType::F32),
            )),
            (None, true) => Some(clip_coefficient(sum_sq.clone(), max_norm)),
            (Some(unscale), true) => Some(clip_coefficient(sum_sq.clone(), max_norm) * unscale),
        };

        let model = self.model.take().expect(PRESENT);
        let (target, replica) = if self.sharding.optimizer_state && !self.sharding.parameters {
            let shards = self.own_shards(&model);
            let device = self.inner_device();
            (
                params::set_values(model.clone(), shards, &device, Track::No),
                Some(model),
            )
        } else {
            (model, None)
        };
        grads.retain(|id, _| reached.contains(id));
        let grads = StepGrads::new(params::to_grads(&target, grads), factor);
        // Shards are plain between uses; Burn's optimizers step leaves on autodiff (each is
        // asked whether it is distributed, which a plain tensor cannot answer).
        let shards = self.sharding.optimizer_state;
        let target = match shards {
            true => params::leaves(target, &self.frozen, &self.device),
            false => target,
        };
        let updated = optimize(target, grads);
        self.model = Some(match replica {
            // Burn's optimizers return each parameter on its gradient's device: offloaded
            // shards go back where they live.
            None if shards => match &self.home {
                Some(home) => params::detached(&updated).to_device(home),
                None => params::detached(&updated),
            },
            None => updated,
            Some(replica) => {
                let mut shards = params::values(&updated, None);
                drop(updated);
                // The frozen parameters are as the replica holds them: only what the step
                // changed comes back.
                shards.retain(|id, _| !self.frozen.contains(id));
                let trained = self.all_buckets().map(|b| self.trained(b));
                self.gather(replica, shards, trained, true)?
            }
        });
        // Read when the whole step is queued: the device never waits for the host.
        let sum_sq = read_sum_sq.unwrap_or_else(|| sum_sq.into_scalar::<f32>());
        let grad_norm = (sum_sq as f64).sqrt();
        Ok(StepOutcome {
            loss: self.step_loss(),
            grad_norm,
            skipped: false,
        })
    }

    /// The sum of the squares of every value in `grads` (`[1]`, on the device), summed in
    /// slot order so that a run is reproducible.
    fn squared_norm(&self, grads: &Flat) -> Tensor<1> {
        self.slots
            .iter()
            .filter_map(|slot| grads.get(&slot.id))
            .map(|g| squares_summed(g.clone()))
            .reduce(|sum, squares| sum + squares)
            .unwrap_or_else(|| Tensor::zeros([1], (&self.inner_device(), TensorDType::F32)))
    }

    /// The model's logits for `input` (built on [`Sharded::eval_device`]) in evaluation mode
    /// (no dropout, no graph), computed as training computes (a mixed policy's 16-bit copy,
    /// with autocast). It runs unit by unit: sharded parameters are gathered one unit at a
    /// time, as for training, and a mixed replica casts one unit at a time (its root, the
    /// embeddings and the head, whole: once for each), so an evaluation never holds the whole
    /// model twice. Without `input` it only takes part in the gathers
    /// (`None`): what a rank whose share of a distributed evaluation is done does while the
    /// others compute, since every rank joins each of ZeRO-3's gathers.
    pub fn eval_logits(&self, input: Option<M::Input>) -> Result<Option<M::Logits>, ShardError> {
        let _autocast = autocast::scope(self.precision.is_mixed());
        let model = self.model.as_ref().expect(PRESENT);
        if input.is_none() && !self.sharding.parameters {
            return Ok(None);
        }
        let mut root = model.valid();
        let blocks = root.take_blocks();
        let mut x = {
            // Gathered only while it embeds: freed before the blocks are.
            let embeddings = self.unit(&root, &[EMBEDDINGS], false)?.valid();
            input.map(|input| embeddings.embed(input))
        };
        for (i, block) in blocks.iter().enumerate() {
            let block = self.unit(block, &[FIRST_BLOCK + i], false)?.valid();
            x = x.map(|(x, mask)| (root.block_forward(&block, x, &mask), mask));
        }
        let head = self.unit(&root, &self.head_units, false)?.valid();
        Ok(x.map(|(x, _)| head.logits(x)))
    }

    /// The sequences in `input` and their positions ([`BlockModel::extent`]).
    pub fn extent(&self, input: &M::Input) -> [usize; 2] {
        self.model.as_ref().expect(PRESENT).extent(input)
    }

    /// Model FLOPs of a forward and backward pass on `input` ([`BlockModel::train_flops`]),
    /// less what frozen parameters leave undone: the blocks' ([`Flops::frozen_in_blocks`])
    /// and the root's ([`RootWeights::frozen`]).
    pub fn train_flops(&self, input: &M::Input) -> f64 {
        let model = self.model.as_ref().expect(PRESENT);
        let all = model.train_flops(&self.flops, input);
        if self.frozen.is_empty() {
            return all;
        }
        let frozen_below = self.frozen_below();
        let blocks: Vec<(usize, usize, bool)> = self.units[FIRST_BLOCK..]
            .iter()
            .enumerate()
            .map(|(i, unit)| {
                let numel = |frozen_only: bool| {
                    unit.iter()
                        .map(|&s| &self.slots[s])
                        .filter(|s| !frozen_only || self.frozen.contains(&s.id))
                        .map(Slot::numel)
                        .sum()
                };
                (numel(false), numel(true), i < frozen_below)
            })
            .collect();
        let [batch, seq] = model.extent(input);
        let keys = model.attended_keys(seq);
        let root: f64 = self
            .root_weights
            .iter()
            .filter(|r| self.frozen.contains(&r.id))
            .map(|r| r.frozen(batch, seq))
            .sum();
        all - self.flops.frozen_in_blocks(batch, seq, keys, &blocks) - root
    }

    /// Where [`Sharded::eval_logits`] takes its input.
    pub fn eval_device(&self) -> Device {
        self.inner_device()
    }

    /// The whole model on every rank (sharded parameters are gathered: a collective), for
    /// a caller of training that asks for it.
    pub fn full_model(&self) -> Result<M, ShardError> {
        let model = self.model.as_ref().expect(PRESENT).clone();
        if !self.sharding.parameters {
            return Ok(model);
        }
        let shards = self.shards_on_device(&model, None);
        self.gather(
            model,
            shards,
            self.all_buckets().map(|b| self.group(b)),
            true,
        )
    }

    /// The ranks this engine keeps in step.
    pub fn comm(&self) -> &'c dyn Communicator {
        self.comm
    }

    /// The ranks among which each parameter's rows are split for the optimizer step (this
    /// rank steps its shards): the process group under ZeRO on more than one rank, else
    /// `None` (every rank steps whole parameters).
    pub fn shard_group(&self) -> Option<&'c dyn Communicator> {
        (self.sharding.optimizer_state && self.comm.world_size() > 1).then_some(self.comm)
    }

    /// Whether every rank holds the whole model (not only shards of it).
    pub fn holds_whole_model(&self) -> bool {
        !self.sharding.parameters
    }

    /// Every parameter's path and dims, in the order [`Sharded::for_each_full_parameter`]
    /// visits them.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.units
            .iter()
            .flatten()
            .map(|&i| (self.slots[i].path.clone(), self.slots[i].dims.clone()))
            .collect()
    }

    /// Calls `visit` with every parameter's path, dims and full value (flat, f32), one unit
    /// at a time: sharded parameters are gathered unit by unit (a collective every rank
    /// joins), so beside its shards a rank holds one unit's full values at a time, never the
    /// whole model.
    pub fn for_each_full_parameter(
        &self,
        mut visit: impl FnMut(&str, &[usize], Tensor<1>),
    ) -> Result<(), ShardError> {
        let model = self.model.as_ref().expect(PRESENT);
        for unit in 0..self.units.len() {
            let ids: Vec<ParamId> = self.units[unit].iter().map(|&i| self.slots[i].id).collect();
            let full = match self.sharding.parameters {
                true => {
                    let mut shards = self.shards_on_device(model, Some(&ids));
                    self.gathered(&mut shards, self.group(Group::Unit(unit)))?
                }
                false => {
                    let mut values = params::values(model, Some(&ids));
                    self.group(Group::Unit(unit))
                        .into_iter()
                        .map(|s| (s, values.remove(&s.id).expect("a value per parameter")))
                        .collect()
                }
            };
            for (slot, value) in full {
                visit(&slot.path, &slot.dims, value.cast(TensorDType::F32));
            }
        }
        Ok(())
    }

    /// The elements of the parameters that train (not frozen).
    pub fn trainable_params(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| !self.frozen.contains(&s.id))
            .map(Slot::numel)
            .sum()
    }

    /// Every parameter's place in the layout, in visit order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Which model states each rank keeps only its shard of.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The sharding as it acts on this rank ([`Sharding::acting_on`]).
    fn acting(&self) -> Sharding {
        self.sharding.acting_on(
            self.comm.world_size(),
            self.precision.is_mixed(),
            self.home.is_some(),
        )
    }

    /// What this rank holds of every parameter (by id), flat, in the dtype it is stored in:
    /// its shard (zero-padded rows) when parameters are sharded, else the whole value.
    pub fn held_parameters(&self) -> Flat {
        params::values(self.model.as_ref().expect(PRESENT), None)
    }

    /// Replaces what this rank holds of the parameters in `values` (by id, flat, as
    /// [`Sharded::held_parameters`] gives them), cast to the dtype each is stored in. A value
    /// for no parameter of the model, or of another length than this rank holds, is
    /// [`ShardError::HeldValues`], with nothing replaced.
    pub fn set_held_parameters(&mut self, values: Flat) -> Result<(), ShardError> {
        let by_id: HashMap<ParamId, &Slot> = self.slots.iter().map(|s| (s.id, s)).collect();
        let sharded = self.sharding.parameters;
        for (id, value) in &values {
            let Some(slot) = by_id.get(id) else {
                return Err(ShardError::HeldValues(format!(
                    "parameter {id} is not one of the model's"
                )));
            };
            let held: usize = match sharded {
                true => slot.shard_dims().iter().product(),
                false => slot.numel(),
            };
            if value.dims()[0] != held {
                return Err(ShardError::HeldValues(format!(
                    "`{}` is given {} values, this rank holds {held}",
                    slot.path,
                    value.dims()[0]
                )));
            }
        }
        let model = self.model.take().expect(PRESENT);
        // Shards stay plain tensors where they live (the host when offloaded); a replica's
        // parameters are tracked on the autodiff device.
        let home = match sharded {
            true => self.home.clone().unwrap_or_else(|| self.inner_device()),
            false => self.inner_device(),
        };
        let shaped: HashMap<ParamId, (Tensor<1>, Vec<usize>)> = values
            .into_iter()
            .map(|(id, v)| {
                let slot = by_id[&id];
                let dims = match sharded {
                    true => slot.shard_dims(),
                    false => slot.dims.clone(),
                };
                (id, (v.to_device(&home), dims))
            })
            .collect();
        self.model = Some(match sharded {
            true => params::set_values(model, shaped, &home, Track::No),
            false => params::set_values(model, shaped, &self.device, self.track(true)),
        });
        Ok(())
    }

    /// The loss scaler (`16-mixed`), for a checkpoint ([`Sharded::restore_scaler`]).
    pub fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Continues from `saved` (a checkpoint's loss scaler), when this run scales the loss.
    pub fn restore_scaler(&mut self, saved: &LossScaler) {
        if let Some(own) = self.scaler.as_mut() {
            own.resume_from(saved);
        }
    }

    /// Bytes of parameters this rank holds between steps.
    pub fn param_bytes(&self) -> usize {
        params::param_bytes(self.model.as_ref().expect(PRESENT))
    }

    /// The most bytes of gradients this rank held at once during the last step: its own
    /// sums over the micro-steps and what the collectives handed it, as the engine keeps
    /// them (not what a strategy's formula says it should keep).
    pub fn grad_bytes(&self) -> usize {
        self.grad_bytes
    }

    /// Records the gradient bytes held now in this step's peak.
    fn note_grads(&mut self) {
        let held: usize = self
            .local
            .values()
            .chain(self.reduced.values())
            .map(|g| g.shape().num_elements() * g.dtype().size())
            .sum();
        self.grad_peak = self.grad_peak.max(held);
    }

    fn inner_device(&self) -> Device {
        self.device.clone().inner()
    }

    /// Rank 0's parameter values in `model` on every rank, bucket by bucket (in f32).
    fn broadcast_from_rank0(&self, model: M) -> Result<M, ShardError> {
        let mut values = params::values(&model, None);
        if self.comm.world_size() == 1 {
            // Its own values, set as the ranks' are: leaves on the device, tracked unless
            // frozen (a parameter mapped after initialisation would otherwise be a computed
            // tensor, whose gradient backward drops).
            let own = (self.slots.iter())
                .map(|s| {
                    let value = values.remove(&s.id).expect("a value for every parameter");
                    (s.id, (value, s.dims.clone()))
                })
                .collect();
            return Ok(params::set_values(
                model,
                own,
                &self.device,
                self.track(true),
            ));
        }
        let mut model = model;
        for bucket in &self.buckets {
            let slots: Vec<&Slot> = bucket.iter().map(|&i| &self.slots[i]).collect();
            let mine = Tensor::cat(
                slots
                    .iter()
                    .map(|s| {
                        let value = values.remove(&s.id).expect("a value for every parameter");
                        value.cast(TensorDType::F32)
                    })
                    .collect(),
                0,
            );
            let expected = mine.dims()[0];
            let root = self.comm.broadcast_tensor(mine, 0)?;
            if root.dims()[0] != expected {
                return Err(ShardError::ModelMismatch {
                    rank: self.comm.rank(),
                    detail: format!(
                        "rank 0 sent {} values for parameters {}.., this rank has {expected}",
                        root.dims()[0],
                        slots[0].path
                    ),
                });
            }
            // Each value in storage of its own: a slice of the bucket would keep the whole
            // bucket alive for as long as any of its parameters is unchanged (a frozen one, or
            // one no backward reaches, the whole run: a second copy of the bucket's parameters
            // from the first step on).
            let bucket_values = slots
                .iter()
                .zip(layout::split(root, slots.iter().map(|s| s.numel())))
                .map(|(s, v)| (s.id, (layout::owned(v), s.dims.clone())))
                .collect();
            model = params::set_values(model, bucket_values, &self.device, self.track(true));
        }
        Ok(model)
    }

    /// Rank 0's parameter values, each rank keeping only its shards: one parameter at a time,
    /// in visit order, so a lazy model is initialised one parameter at a time on rank 0 only
    /// (in the order a single device would draw them) and no rank ever holds the whole model.
    /// Also, on rank 0, which of them are frozen (read as each is initialised).
    fn shard_from_rank0(&self, mut model: M) -> Result<(M, HashSet<ParamId>), ShardError> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let device = self.inner_device();
        let mut frozen = HashSet::new();
        for slot in &self.slots {
            let full = if rank == 0 {
                frozen.extend(params::frozen(&model, Some(&[slot.id])));
                params::values(&model, Some(&[slot.id]))
                    .remove(&slot.id)
                    .expect("the slot is a parameter of the model")
                    .cast(TensorDType::F32)
            } else {
                Tensor::empty([slot.numel()], (&device, TensorDType::F32))
            };
            let full = if world == 1 {
                full
            } else {
                self.comm.broadcast_tensor(full, 0)?
            };
            if full.dims()[0] != slot.numel() {
                return Err(ShardError::ModelMismatch {
                    rank,
                    detail: format!(
                        "rank 0 sent {} values for {}, this rank's has {}",
                        full.dims()[0],
                        slot.path,
                        slot.numel()
                    ),
                });
            }
            let shard = (layout::owned(slot.shard_of(&full, rank)), slot.shard_dims());
            drop(full);
            let shard = HashMap::from([(slot.id, shard)]);
            model = params::set_values(model, shard, &device, Track::No);
        }
        // A parameter initialised here keeps its dtype through `set_values` (a lazy model
        // built in bf16 by `init_in`: rank 0's, and another rank's whose clone shares rank
        // 0's values, initialised once rank 0 read them, or whichever rank a loaded model
        // reached), a new one takes the value's: every rank's shards in f32, as the values
        // travelled, until `.precision()` casts them.
        Ok((burnscale_precision::cast(model, FloatDType::F32), frozen))
    }

    /// Rank 0's `frozen` parameters, on every rank (a flag per slot, broadcast).
    fn frozen_on_every_rank(
        &self,
        frozen: HashSet<ParamId>,
    ) -> Result<HashSet<ParamId>, ShardError> {
        if self.comm.world_size() == 1 {
            return Ok(frozen);
        }
        let flags: Vec<f32> = self
            .slots
            .iter()
            .map(|s| f32::from(u8::from(frozen.contains(&s.id))))
            .collect();
        let flags = Tensor::<1>::from_floats(flags.as_slice(), &self.inner_device());
        let flags = self.comm.broadcast_tensor(flags, 0)?.into_data();
        if flags.num_elements() != self.slots.len() {
            return Err(ShardError::ModelMismatch {
                rank: self.comm.rank(),
                detail: format!(
                    "rank 0 has {} parameters, this rank {}",
                    flags.num_elements(),
                    self.slots.len()
                ),
            });
        }
        Ok(self
            .slots
            .iter()
            .zip(flags.iter::<f32>())
            .filter(|(_, flag)| *flag != 0.0)
            .map(|(slot, _)| slot.id)
            .collect())
    }

    /// How values set for a forward are left: tracked (but the frozen parameters) when
    /// `require_grad`, else plain.
    fn track(&self, require_grad: bool) -> Track<'_> {
        match require_grad {
            true => Track::AllBut(&self.frozen),
            false => Track::No,
        }
    }

    /// This rank's shard of every parameter of `module`, shaped as shards.
    fn own_shards<U: Module>(&self, module: &U) -> HashMap<ParamId, (Tensor<1>, Vec<usize>)> {
        let by_id: HashMap<ParamId, &Slot> = self.slots.iter().map(|s| (s.id, s)).collect();
        params::shards(module, &by_id, self.comm.rank())
            .into_iter()
            .map(|(id, v)| (id, (v, by_id[&id].shard_dims())))
            .collect()
    }

    /// The parameter shards of `module` named in `ids` (all when `None`), flat, on the
    /// device: moved from the host when offloaded.
    fn shards_on_device<U: Module>(&self, module: &U, ids: Option<&[ParamId]>) -> Flat {
        let mut shards = params::values(module, ids);
        if self.home.is_some() {
            let device = self.inner_device();
            for shard in shards.values_mut() {
                *shard = host::transfer(shard.clone(), &device);
            }
        }
        shards
    }

    /// Every bucket, in order.
    fn all_buckets(&self) -> impl Iterator<Item = Group> + use<M> {
        (0..self.buckets.len()).map(Group::Bucket)
    }

    fn group(&self, group: Group) -> Vec<&Slot> {
        let indices = match group {
            Group::Bucket(i) => &self.buckets[i],
            Group::Unit(i) => &self.units[i],
        };
        indices.iter().map(|&i| &self.slots[i]).collect()
    }

    /// The parameters of `group` that train (not frozen).
    fn trained(&self, group: Group) -> Vec<&Slot> {
        let mut slots = self.group(group);
        slots.retain(|s| !self.frozen.contains(&s.id));
        slots
    }

    /// `module` with the full values of the parameters in `groups`, all-gathered from
    /// every rank's `shards` (consumed as they are sent, in their dtype), one collective per
    /// group; on the autodiff device and tracked if `require_grad`.
    fn gather<'s, U: Module>(
        &'s self,
        mut module: U,
        mut shards: Flat,
        groups: impl IntoIterator<Item = Vec<&'s Slot>>,
        require_grad: bool,
    ) -> Result<U, ShardError> {
        for slots in groups {
            let full = self
                .gathered(&mut shards, slots)?
                .into_iter()
                .map(|(s, v)| (s.id, (v, s.dims.clone())))
                .collect();
            module = params::set_values(module, full, &self.device, self.track(require_grad));
        }
        Ok(module)
    }

    /// The full values (flat) of the parameters in `slots`, all-gathered from every rank's
    /// `shards` (taken out of it, in their dtype) in one collective.
    fn gathered<'s>(
        &self,
        shards: &mut Flat,
        slots: Vec<&'s Slot>,
    ) -> Result<Vec<(&'s Slot, Tensor<1>)>, ShardError> {
        let world = self.comm.world_size();
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        let mine: Vec<Tensor<1>> = slots
            .iter()
            .map(|s| shards.remove(&s.id).expect("a shard for every parameter"))
            .collect();
        // Alone, a shard is the whole parameter: nothing to pack or move.
        if world == 1 {
            return Ok(slots.into_iter().zip(mine).collect());
        }
        let mine = Tensor::cat(mine, 0);
        let expected = world * mine.dims()[0];
        let gathered = self.comm.all_gather_tensor(mine)?;
        if gathered.dims()[0] != expected {
            return Err(ShardError::ModelMismatch {
                rank: self.comm.rank(),
                detail: format!(
                    "gathered {} values for parameters {}.., expected {expected}",
                    gathered.dims()[0],
                    slots[0].path
                ),
            });
        }
        let full = layout::unpack_gathered(&slots, gathered, world);
        Ok(slots.into_iter().zip(full).collect())
    }

    /// Averages the local gradients of one group over the ranks: all-reduce where every rank
    /// steps the whole model (DDP), else reduce-scatter to the shards this rank steps (ZeRO-1
    /// on the last micro-step, as DeepSpeed's stage 1: an all-reduce would move twice the
    /// bytes for gradients the rank then cuts), added to the shards earlier micro-steps of
    /// the step reduced. Frozen parameters have none, and take no part.
    fn reduce(&mut self, group: Group) -> Result<(), ShardError> {
        let world = self.comm.world_size();
        let slots: Vec<Slot> = self.trained(group).into_iter().cloned().collect();
        if slots.is_empty() {
            return Ok(());
        }
        let slots: Vec<&Slot> = slots.iter().collect();
        let (device, grad_dtype) = (self.inner_device(), self.grad_dtype());
        let local: Vec<Tensor<1>> = slots
            .iter()
            .map(|s| match self.local.remove(&s.id) {
                Some(grad) => {
                    self.reached.insert(s.id);
                    grad
                }
                None => Tensor::zeros([s.numel()], (&device, grad_dtype)),
            })
            .collect();
        let dtype = tensor_dtype(self.reduce_dtype);
        let reduced = if world == 1 {
            // Alone, the mean is the local sum and a shard the whole gradient.
            local
        } else if !self.sharding.optimizer_state {
            let flat = self
                .comm
                .all_reduce_tensor(Tensor::cat(local, 0).cast(dtype), ReduceOp::Mean)?
                .cast(grad_dtype);
            layout::split(flat, slots.iter().map(|s| s.numel()))
        } else {
            let packed = layout::pack_rank_major(&slots, &local, world);
            drop(local);
            let mine = self
                .comm
                .reduce_scatter_tensor(packed.cast(dtype), ReduceOp::Mean)?
                .cast(grad_dtype);
            layout::split(mine, slots.iter().map(|s| s.shard_numel()))
        };
        for (slot, grad) in slots.iter().zip(reduced) {
            let sum = match self.reduced.remove(&slot.id) {
                Some(earlier) => earlier + grad,
                None => grad,
            };
            self.reduced.insert(slot.id, sum);
        }
        self.note_grads();
        Ok(())
    }

    /// Backward block by block. With [`Keep::Inputs`] (the checkpointed blocks) blocks run
    /// forward outside autodiff, keeping only their input; backward takes each block again,
    /// recomputes it under autodiff (with the same dropout masks) and back-propagates the
    /// incoming gradient through it. With sharded gradients a unit's are reduce-scattered as
    /// soon as backward leaves it, on every micro-step (the head's, each block's, the
    /// embeddings'), so a rank holds one unit's full gradients at a time. Sharded parameters
    /// are gathered just before a unit runs and dropped after: each block for its forward
    /// and for its backward, the head's unit for the head's forward and backward, the
    /// embeddings' for their forward and (recomputed) backward; or, not resharded after
    /// forward, kept gathered from a unit's forward to the end of its backward. DDP and
    /// ZeRO-1 reduce their buckets after the whole backward of the last micro-step.
    ///
    /// With [`Keep::Graphs`] no block is recomputed: each runs forward under autodiff from an
    /// input of its own and keeps its graph, and backward goes through the graphs block by
    /// block, adding each block's gradients into the sums as it leaves it (PyTorch adds into
    /// `.grad` as backward goes), instead of a plain backward's whole second copy at its end.
    /// A graph keeps its block's gathered parameters, except where they are resharded after
    /// forward: there the block's linears run through [`regather`], its weights are dropped
    /// after its forward and gathered again for its backward, which reads them from there.
    fn blockwise_micro_step(
        &mut self,
        input: M::Input,
        target: M::Target,
        share: &Share,
        last: bool,
    ) -> Result<(), ShardError> {
        let sharded_params = self.sharding.parameters;
        let acting = self.acting();
        let keep_gathered = acting.keeps_gathered();
        let _autocast = autocast::scope(self.precision.is_mixed());
        let mut root = self.model.as_ref().expect(PRESENT).clone();
        let blocks = root.take_blocks();
        let start = dropout::position();
        // Sharded, the root is gathered around each use (the embeddings kept gathered, with
        // their graph, when not resharded); else its compute copy serves all. The embeddings'
        // output under autodiff, with their gathered unit, when backward need not recompute
        // them.
        let (mut x, mask, embedded) = if acting.reshards() {
            let _training = dropout::training_scope();
            let (x, mask) = self.unit(&root, &[EMBEDDINGS], false)?.embed(input.clone());
            (x, mask, None)
        } else {
            let gathered = match sharded_params {
                true => Some(self.unit(&root, &[EMBEDDINGS], true)?),
                false => {
                    root = self.compute(root);
                    None
                }
            };
            let (embedded, mask) = gathered.as_ref().unwrap_or(&root).embed(input.clone()); // [batch, seq, d_model]
            (embedded.clone().inner(), mask, Some((embedded, gathered)))
        };
        let inner_mask = mask.clone().map(|m| m.inner());
        let mask = mask.map(|m| autodiff_on(m, &self.device));
        // Below the lowest unit that trains nothing needs a gradient: those blocks run outside
        // autodiff and keep nothing, and backward stops above them (as autodiff's own graph
        // starts at the first tracked parameter).
        let frozen_below = self.frozen_below();
        // Nor does the lowest block that trains need its input's gradient when the
        // embeddings below it train not; but resharded, its graph runs through regathered
        // linears, whose op hangs off its input, which so stays tracked.
        let embeddings_train = self.trains(EMBEDDINGS);
        let input_grad = |i: usize| i > frozen_below || embeddings_train;
        let graph_input_grad = |i: usize| input_grad(i) || acting.reshards();
        let mut saved = Vec::with_capacity(blocks.len() - frozen_below);
        {
            let _training = dropout::training_scope();
            for (i, block) in blocks.iter().enumerate() {
                let unit = [FIRST_BLOCK + i];
                if i < frozen_below {
                    x = root.block_forward(&self.unit(block, &unit, false)?, x, &inner_mask);
                    continue;
                }
                let keep = match i < self.checkpointed {
                    true => Keep::Inputs,
                    false => Keep::Graphs,
                };
                saved.push(match keep {
                    Keep::Inputs => {
                        let at = dropout::position();
                        let gathered = match keep_gathered {
                            true => Some(self.unit(block, &unit, true)?),
                            false => None,
                        };
                        let block = match &gathered {
                            Some(gathered) => params::detached(gathered),
                            None => self.unit(block, &unit, false)?,
                        };
                        let input = x.clone();
                        let forward = || root.block_forward(&block, x, &inner_mask);
                        let (y, kept) = match self.checkpoint_mode {
                            CheckpointMode::Full => (forward(), None),
                            CheckpointMode::Selective => {
                                let (y, kept) = selective::record(forward);
                                (y, Some(kept))
                            }
                        };
                        x = y;
                        Saved::Input(input, at, gathered, kept)
                    }
                    Keep::Graphs => {
                        let block = self.unit(block, &unit, true)?;
                        let input =
                            autodiff_on(x, &self.device).set_require_grad(graph_input_grad(i));
                        let forward = || root.block_forward(&block, input.clone(), &mask);
                        let (output, regathered) = match acting.reshards() {
                            true => regather::forward(forward),
                            false => (forward(), Vec::new()),
                        };
                        x = output.clone().inner();
                        Saved::Graph {
                            block: params::emptied(block, &regathered),
                            input,
                            output,
                            regathered,
                        }
                    }
                });
            }
        }
        let x = autodiff_on(x, &self.device).require_grad();
        let head = match (&embedded, sharded_params) {
            // A head tied to the token table reads it where the embeddings keep it gathered:
            // only the head's own unit is gathered.
            (Some((_, Some(kept))), true) => Some(self.unit(kept, &[HEAD], true)?),
            (_, true) => Some(self.unit(&root, &self.head_units, true)?),
            (_, false) => None,
        };
        let head_root = head.as_ref().unwrap_or(&root);
        let loss = head_root.head_loss(x.clone(), target);
        let loss = self.scaled(loss, share);
        let resume = dropout::position();

        let grads = loss.backward();
        let mut grad_x = Some(
            x.grad(&grads)
                .expect("the head reads the last block's output"),
        );
        self.add_grads(head_root, grads);
        drop(head);
        let per_unit = self.sharding.gradients;
        // The head's own unit is complete: the embeddings do not read it.
        if per_unit {
            self.reduce(Group::Unit(HEAD))?;
        }
        for (i, block) in blocks.iter().enumerate().skip(frozen_below).rev() {
            let (block, input, y, weights) = match saved.pop().expect("one saved part per block") {
                Saved::Input(x, at, gathered, kept) => {
                    let block = match gathered {
                        Some(gathered) => gathered,
                        None => self.unit(block, &[FIRST_BLOCK + i], true)?,
                    };
                    dropout::rewind(at);
                    let input = autodiff_on(x, &self.device).set_require_grad(input_grad(i));
                    let forward = || root.block_forward(&block, input.clone(), &mask);
                    let y = match kept {
                        Some(kept) => selective::replay(kept, forward),
                        None => forward(),
                    };
                    (block, input, y, Vec::new())
                }
                Saved::Graph {
                    block: kept,
                    input,
                    output,
                    regathered,
                } => {
                    let weights = match regathered.is_empty() {
                        true => Vec::new(),
                        false => {
                            let gathered = self.unit(block, &[FIRST_BLOCK + i], false)?;
                            params::matrices(&gathered, &regathered)
                        }
                    };
                    (kept, input, output, weights)
                }
            };
            let grad_y = grad_x
                .take()
                .expect("the gradient of the output of a block that trains");
            let grad_y = autodiff_on(grad_y, &self.device);
            let (grads, weight_grads) =
                regather::backward(weights, || (y * grad_y).sum().backward());
            let dtype = self.grad_dtype();
            // A linear backward did not reach has no gradient, as a parameter a plain backward
            // does not reach: its reduction counts zeros.
            for (id, grad) in weight_grads {
                if let Some(grad) = grad {
                    params::add_grad(&mut self.local, id, grad, dtype);
                }
            }
            grad_x = input.grad(&grads);
            // Gradients are found through the tensors the graph used: this block's.
            self.add_grads(&block, grads);
            drop(block);
            if per_unit {
                self.reduce(Group::Unit(FIRST_BLOCK + i))?;
            }
        }
        let embedded = match embedded {
            Some(embedded) => Some(embedded),
            None if !embeddings_train => None,
            None => {
                dropout::rewind(start);
                let gathered = self.unit(&root, &[EMBEDDINGS], true)?;
                Some((gathered.embed(input).0, Some(gathered)))
            }
        };
        dropout::rewind(resume);
        if let Some((embedded, gathered)) = embedded.filter(|(e, _)| e.is_tracked()) {
            let grad_x = grad_x.expect("the gradient of the first block's input");
            let grads = (embedded * autodiff_on(grad_x, &self.device))
                .sum()
                .backward();
            self.add_grads(gathered.as_ref().unwrap_or(&root), grads);
        }
        if per_unit {
            self.reduce(Group::Unit(EMBEDDINGS))?;
        } else if last {
            for bucket in self.all_buckets() {
                self.reduce(bucket)?;
            }
        }
        Ok(())
    }

    /// Whether any parameter of `unit` trains (is not frozen).
    fn trains(&self, unit: usize) -> bool {
        self.units[unit]
            .iter()
            .any(|&i| !self.frozen.contains(&self.slots[i].id))
    }

    /// The blocks, from the first, below the lowest unit that trains: none when the
    /// embeddings train.
    fn frozen_below(&self) -> usize {
        match self.trains(EMBEDDINGS) {
            true => 0,
            false => (FIRST_BLOCK..self.units.len())
                .take_while(|&u| !self.trains(u))
                .count(),
        }
    }

    /// Adds the gradients `grads` holds for `module`'s parameters into this rank's sums.
    fn add_grads<U: Module>(&mut self, module: &U, grads: Gradients) {
        let dtype = self.grad_dtype();
        params::add_grads(
            module,
            &mut GradientsParams::from_grads(grads, module),
            &mut self.local,
            dtype,
        );
        self.note_grads();
    }

    /// The dtype gradients are summed and held in: the weights' (f32 masters under the
    /// mixed policies, 16 bits under `*-true`, as PyTorch keeps a parameter's `.grad` in its
    /// dtype), so that `*-true` holds 2 bytes of gradient per parameter, not 4.
    fn grad_dtype(&self) -> TensorDType {
        self.precision.param_dtype().into()
    }

    /// `module` (shard-shaped when parameters are sharded) with the parameters of `units`
    /// ready for a forward outside autodiff (`!train`) or under it: gathered when sharded (in
    /// the compute dtype, so 16-bit policies gather 16-bit values; the module's other
    /// parameters stay shards), else the replica's own; in the compute dtype.
    fn unit<U: Module>(&self, module: &U, units: &[usize], train: bool) -> Result<U, ShardError> {
        if self.sharding.parameters {
            let shards = self.compute(module.clone());
            let ids: Vec<ParamId> = units
                .iter()
                .flat_map(|&u| self.units[u].iter().map(|&i| self.slots[i].id))
                .collect();
            let values = self.shards_on_device(&shards, Some(&ids));
            let groups = units.iter().map(|&u| self.group(Group::Unit(u)));
            return self.gather(shards, values, groups, train);
        }
        Ok(self.compute(if train {
            module.clone()
        } else {
            params::detached(module)
        }))
    }
}

/// What a blockwise forward keeps of each block for backward.
#[derive(Debug, Clone, Copy)]
enum Keep {
    /// Only its input (and, not resharded after forward, its gathered parameters; under
    /// [`CheckpointMode::Selective`] its linears' outputs): backward recomputes it
    /// (activation checkpointing).
    Inputs,
    /// Its whole graph: backward goes through it as it is.
    Graphs,
}

/// One block's part of a blockwise forward, as [`Keep`] says.
#[allow(
    clippy::large_enum_variant,
    reason = "one per block, for one micro-step: the handles' bytes do not matter"
)]
enum Saved<B> {
    /// Its input (outside autodiff), where the dropout stream stood when it ran, its gathered
    /// parameters (tracked) when they stay gathered until its backward, and its linears'
    /// outputs under [`CheckpointMode::Selective`].
    Input(
        Tensor<3>,
        dropout::StreamPosition,
        Option<B>,
        Option<selective::Kept>,
    ),
    /// The block as it ran (its compute copy, less the weights its graph reads in backward
    /// from [`regather`]), its input leaf and its output, tracked, and those weights' ids.
    Graph {
        block: B,
        input: Tensor<3>,
        output: Tensor<3>,
        regathered: Vec<ParamId>,
    },
}

/// Slots moved by one collective: one of the size-capped buckets, or one unit.
#[derive(Debug, Clone, Copy)]
enum Group {
    Bucket(usize),
    Unit(usize),
}

/// The sum of the squares of `g`'s values, in f32 (`[1]`), in one reduction kernel where it
/// can: burn-fusion takes element-wise reads (the cast, the square) into a reduction along an
/// axis, not into a whole-tensor `sum`, which made the square a kernel and an f32 copy of its
/// own. A long gradient is summed in rows of 1024 first, so that the work spreads over the
/// device (one long row is one reduction's work); the rows' sums, and the elements past the
/// last whole row, are then summed in reductions of their own.
fn squares_summed(g: Tensor<1>) -> Tensor<1> {
    const ROW: usize = 1024;
    let squares = |t: Tensor<1>| {
        let t = t.cast(TensorDType::F32);
        t.clone() * t
    };
    let n = g.dims()[0];
    let (rows, tail) = (n / ROW, n % ROW);
    if rows < 2 {
        return squares(g).sum_dim(0);
    }
    let whole = match tail {
        0 => g.clone(),
        _ => g.clone().narrow(0, 0, rows * ROW),
    };
    let sum = squares(whole)
        .reshape([rows, ROW])
        .sum_dim(1)
        .sum_dim(0)
        .reshape([1]);
    match tail {
        0 => sum,
        _ => sum + squares(g.narrow(0, rows * ROW, tail)).sum_dim(0),
    }
}

/// What gradients are multiplied by to clip them to a global L2 norm of `max_norm`, from
/// their squared norm (`[1]`, on the device): 1 unless the norm is finite and above it. A
/// non-finite norm is not clipped to zero gradients: the step takes it, and the runner stops
/// on the norm it reports.
fn clip_coefficient(sum_sq: Tensor<1>, max_norm: f64) -> Tensor<1> {
    let norm = sum_sq.sqrt();
    let clipped = norm
        .clone()
        .greater_elem(max_norm)
        .bool_and(norm.clone().is_finite());
    let coefficient = (norm.clone() + 1e-6).recip() * max_norm;
    norm.ones_like().mask_where(clipped, coefficient)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Short, long (whole rows of 1024) and long with a tail: the sum of every square, exactly.
    /// Every value is a nonzero multiple of 1/4, so every partial sum is a multiple of 1/16
    /// below 2^20, which f32 holds exactly in any order: one value left out or counted twice
    /// (a tail's first or last) changes the sum.
    #[test]
    fn squares_summed_counts_every_value() {
        let device = Device::flex();
        for n in [1, 1000, 2047, 2048, 3000, 5 * 1024 + 1] {
            let values: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.5) * 0.5).collect();
            let want: f64 = values.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let got = squares_summed(Tensor::<1>::from_floats(values.as_slice(), &device))
                .into_scalar::<f32>() as f64;
            assert_eq!(got, want, "n = {n}");
        }
    }
}
