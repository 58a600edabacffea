use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burnscale_collective::{Buffer, Communicator, DType, ReduceOp};
use burnscale_nn::{BlockModel, autocast, autodiff_on, dropout};
use burnscale_precision::{LossScaler, Precision, ScalerConfig};

use crate::host::{self, HostValues};
use crate::layout::{self, Slot};
use crate::{ShardError, Strategy};

/// DDP's default gradient bucket: 25 MB of f32.
const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;
const PRESENT: &str = "the model is only moved out during a step";

/// One rank's view of a model trained under a [`Strategy`]: what the rank holds, and the
/// collectives that keep the ranks in step. Every rank must call the same methods in the same
/// order. A micro-step reads this rank's slice of the global batch; gradients are summed
/// locally over micro-steps (no collective until the last one, as `no_sync`), then
/// averaged over the ranks.
pub struct Sharded<'c, M: BlockModel> {
    strategy: Strategy,
    comm: &'c dyn Communicator,
    device: Device,
    slots: Vec<Slot>,
    /// Slot indices moved by one collective, in consecutive groups of at most 25 MB (DDP's
    /// gradient buckets; also the broadcast and ZeRO-1/2's all-gather after a step).
    buckets: Vec<Vec<usize>>,
    /// Slot indices of each unit: the root (embeddings and head) first, then each block.
    /// ZeRO-3 gathers unit by unit; gradients reduced unit by unit go by them too.
    units: Vec<Vec<usize>>,
    /// The full replica (ddp, zero1, zero2) or this rank's shards (zero3).
    model: Option<M>,
    /// This rank's own gradients, summed over the micro-steps of an optimizer step.
    local: HostValues,
    /// Gradients after the collective: full (ddp, zero1) or this rank's shards.
    reduced: HostValues,
    /// The most gradient bytes (`local` and `reduced` together) held at once so far in this
    /// step, and in the last finished one.
    grad_peak: usize,
    grad_bytes: usize,
    /// Per-block activation checkpointing (always on under ZeRO-3).
    checkpoint: bool,
    precision: Precision,
    /// Where ZeRO-3's shards live between uses when offloaded (else the plain device).
    home: Option<Device>,
    /// The dtype gradients travel in when reduced over the ranks.
    reduce_dtype: DType,
    scaler: Option<LossScaler>,
}

/// What [`Sharded::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// Whether the loss scaler skipped the update (the gradients overflowed).
    pub skipped: bool,
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
        let units = {
            // A clone only for the ids (dropped here: a lazy model's clones share its values).
            let mut root = model.clone();
            let blocks = root.take_blocks();
            std::iter::once(host::param_ids(&root))
                .chain(blocks.iter().map(host::param_ids))
                .map(|ids| ids.iter().map(|id| index[id]).collect())
                .collect()
        };
        let mut this = Self {
            strategy,
            comm,
            device: device.clone(),
            slots,
            buckets,
            units,
            model: None,
            local: HashMap::new(),
            reduced: HashMap::new(),
            grad_peak: 0,
            grad_bytes: 0,
            checkpoint: strategy == Strategy::Zero3,
            precision: Precision::F32True,
            home: None,
            reduce_dtype: DType::F32,
            scaler: None,
        };
        this.model = Some(if strategy == Strategy::Zero3 {
            this.shard_from_rank0(model)?
        } else {
            this.broadcast_from_rank0(model)?
        });
        Ok(this)
    }

    /// Per-block activation checkpointing: each block keeps only its input in forward and is
    /// recomputed in backward. ZeRO-3 always works this way (it must drop gathered weights).
    pub fn checkpoint_activations(mut self, on: bool) -> Self {
        self.checkpoint = on || self.strategy == Strategy::Zero3;
        self
    }

    /// Whether gradients are reduce-scattered unit by unit as backward leaves each unit:
    /// ZeRO-3, and ZeRO-2 with checkpointing (whose backward runs block by block; a plain
    /// backward computes every gradient at once).
    fn per_unit(&self) -> bool {
        self.strategy == Strategy::Zero3 || (self.strategy == Strategy::Zero2 && self.checkpoint)
    }

    /// Trains under `precision`: the `*-true` policies keep the weights (and so the optimizer
    /// state) in 16 bits; the mixed ones keep f32 masters and run each forward on a 16-bit
    /// copy with autocast; `16-mixed` scales the loss with `scaler`.
    pub fn precision(mut self, precision: Precision, scaler: ScalerConfig) -> Self {
        self.precision = precision;
        self.scaler = precision.scales_loss().then(|| LossScaler::new(scaler));
        if precision.param_dtype() != burn::tensor::FloatDType::F32 {
            let model = self.model.take().expect(PRESENT);
            self.model = Some(burnscale_precision::cast(model, precision.param_dtype()));
        }
        self
    }

    /// Keeps this rank's parameter shards on `host` between uses (ZeRO-3's parameter
    /// offload): each unit is gathered onto the device as it runs, and the shards are stepped
    /// where they live.
    pub fn offload_params(mut self, host: Device) -> Result<Self, ShardError> {
        if self.strategy != Strategy::Zero3 {
            return Err(ShardError::Offload(format!(
                "parameter offload keeps ZeRO-3's shards on the host, but the strategy is {:?}",
                self.strategy
            )));
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

    /// The micro-step's share of the step loss (what it reports), and the loss backward
    /// starts from: divided over the accumulation steps, times the loss scale.
    fn scaled(&self, loss: Tensor<1>, accumulate: usize) -> (f64, Tensor<1>) {
        let value = loss.clone().into_scalar::<f32>() as f64 / accumulate as f64;
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        (value, loss * (scale / accumulate as f64))
    }

    /// Runs forward and backward on one micro-batch (this rank's slice), with the loss
    /// divided by `accumulate`; the `last` micro-step of an optimizer step reduces the
    /// gradients over the ranks. Returns the (divided) loss.
    pub fn micro_step(
        &mut self,
        input: M::Input,
        target: M::Target,
        accumulate: usize,
        last: bool,
    ) -> Result<f64, ShardError> {
        if self.checkpoint {
            return self.blockwise_micro_step(input, target, accumulate, last);
        }
        let model = self.compute(self.model.as_ref().expect(PRESENT).clone());
        let loss = {
            let _autocast = autocast::scope(self.precision.is_mixed());
            model.loss(input, target)
        };
        let (value, loss) = self.scaled(loss, accumulate);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        host::add_grads(&model, &mut grads, &mut self.local);
        self.note_grads();
        if last {
            for bucket in self.all_buckets() {
                self.reduce(bucket)?;
            }
        }
        Ok(value)
    }

    /// Unscales the reduced gradients (`16-mixed`), skips the step if any rank's overflowed,
    /// clips them to a global L2 norm of `max_norm` (0: only measures; the norm is taken
    /// across shards), hands this rank's part of the model with its gradients to `optimize`,
    /// and redistributes the result.
    pub fn step(
        &mut self,
        max_norm: f64,
        optimize: impl FnOnce(M, GradientsParams) -> M,
    ) -> Result<StepOutcome, ShardError> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let mut grads = std::mem::take(&mut self.reduced);
        self.grad_bytes = std::mem::take(&mut self.grad_peak);
        if self.strategy == Strategy::Zero1 {
            for slot in &self.slots {
                if let Some(grad) = grads.get_mut(&slot.id) {
                    *grad = slot.shard_of(grad, rank);
                }
            }
        }
        if let Some(scale) = self.scaler.as_ref().map(LossScaler::scale) {
            let inv = (1.0 / scale) as f32;
            grads.values_mut().flatten().for_each(|g| *g *= inv);
            let overflow = grads.values().flatten().any(|g| !g.is_finite());
            let mut flag = Buffer::F32(vec![if overflow { 1.0 } else { 0.0 }]);
            if world > 1 {
                self.comm.all_reduce(&mut flag, ReduceOp::Max)?;
            }
            let found_inf = f32s(flag)[0] > 0.0;
            let scaler = self.scaler.as_mut().expect("checked above");
            if !scaler.update(found_inf)? {
                return Ok(StepOutcome {
                    grad_norm: f64::INFINITY,
                    skipped: true,
                });
            }
        }
        let mut sum_sq: f64 = grads.values().flatten().map(|&g| g as f64 * g as f64).sum();
        if self.strategy != Strategy::Ddp && world > 1 {
            let mut buf = Buffer::F32(vec![sum_sq as f32]);
            self.comm.all_reduce(&mut buf, ReduceOp::Sum)?;
            sum_sq = f32s(buf)[0] as f64;
        }
        let norm = sum_sq.sqrt();
        if max_norm > 0.0 && norm > max_norm {
            let scale = (max_norm / (norm + 1e-6)) as f32;
            grads.values_mut().flatten().for_each(|g| *g *= scale);
        }

        let model = self.model.take().expect(PRESENT);
        let inner = self.home.clone().unwrap_or_else(|| self.inner_device());
        let (target, replica) = match self.strategy {
            Strategy::Ddp | Strategy::Zero3 => (model, None),
            Strategy::Zero1 | Strategy::Zero2 => {
                let shards = self.own_shards(&model);
                (
                    host::set_values(model.clone(), shards, &inner, false),
                    Some(model),
                )
            }
        };
        let grads = host::to_grads(&target, grads, &inner);
        let updated = optimize(target, grads);
        self.model = Some(match replica {
            None => updated,
            Some(replica) => {
                let shards = host::values(&updated);
                drop(updated);
                self.gather(replica, shards, self.all_buckets(), &self.device, true)?
            }
        });
        Ok(StepOutcome {
            grad_norm: norm,
            skipped: false,
        })
    }

    /// The whole model on every rank (ZeRO-3 gathers it: a collective), for evaluation and
    /// saving.
    pub fn full_model(&self) -> Result<M, ShardError> {
        let model = self.model.as_ref().expect(PRESENT).clone();
        if self.strategy != Strategy::Zero3 {
            return Ok(model);
        }
        let shards = host::values(&model);
        self.gather(model, shards, self.all_buckets(), &self.device, true)
    }

    /// Bytes of parameters this rank holds between steps.
    pub fn param_bytes(&self) -> usize {
        host::param_bytes(self.model.as_ref().expect(PRESENT))
    }

    /// The most bytes of gradients this rank held at once during the last step: its own
    /// f32 sums over the micro-steps and what the collectives handed it, as the engine keeps
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
            .map(|g| 4 * g.len())
            .sum();
        self.grad_peak = self.grad_peak.max(held);
    }

    fn inner_device(&self) -> Device {
        self.device.clone().inner()
    }

    /// Rank 0's parameter values in `model` on every rank.
    fn broadcast_from_rank0(&self, model: M) -> Result<M, ShardError> {
        if self.comm.world_size() == 1 {
            return Ok(model);
        }
        let mut values = host::values(&model);
        let mut model = model;
        for bucket in &self.buckets {
            let slots: Vec<&Slot> = bucket.iter().map(|&i| &self.slots[i]).collect();
            let mine: Vec<f32> = slots
                .iter()
                .flat_map(|s| values.remove(&s.id).expect("a value for every parameter"))
                .collect();
            let expected = mine.len();
            let mut buf = Buffer::F32(mine);
            self.comm.broadcast(&mut buf, 0)?;
            let root = f32s(buf);
            if root.len() != expected {
                return Err(ShardError::ModelMismatch {
                    rank: self.comm.rank(),
                    detail: format!(
                        "rank 0 sent {} values for parameters {}.., this rank has {expected}",
                        root.len(),
                        slots[0].path
                    ),
                });
            }
            let bucket_values = slots
                .iter()
                .zip(layout::split(&root, slots.iter().map(|s| s.numel())))
                .map(|(s, v)| (s.id, (v, s.dims.clone())))
                .collect();
            model = host::set_values(model, bucket_values, &self.device, true);
        }
        Ok(model)
    }

    /// Rank 0's parameter values, each rank keeping only its shards: one parameter at a time,
    /// in visit order, so a lazy model is initialised one parameter at a time on rank 0 only
    /// (in the order a single device would draw them) and no rank ever holds the whole model.
    fn shard_from_rank0(&self, mut model: M) -> Result<M, ShardError> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        for slot in &self.slots {
            let full = if rank == 0 {
                host::values_of(&model, &[slot.id])
                    .remove(&slot.id)
                    .expect("the slot is a parameter of the model")
            } else {
                Vec::new()
            };
            let full = if world == 1 {
                full
            } else {
                let mut buf = Buffer::F32(full);
                self.comm.broadcast(&mut buf, 0)?;
                f32s(buf)
            };
            if full.len() != slot.numel() {
                return Err(ShardError::ModelMismatch {
                    rank,
                    detail: format!(
                        "rank 0 sent {} values for {}, this rank's has {}",
                        full.len(),
                        slot.path,
                        slot.numel()
                    ),
                });
            }
            let shard = (slot.shard_of(&full, rank), slot.shard_dims());
            drop(full);
            let shard = HashMap::from([(slot.id, shard)]);
            model = host::set_values(model, shard, &self.inner_device(), false);
        }
        Ok(model)
    }

    /// This rank's shard of every parameter of `module`, shaped as shards.
    fn own_shards<U: Module>(&self, module: &U) -> HashMap<ParamId, (Vec<f32>, Vec<usize>)> {
        let by_id: HashMap<ParamId, &Slot> = self.slots.iter().map(|s| (s.id, s)).collect();
        host::shards(module, &by_id, self.comm.rank())
            .into_iter()
            .map(|(id, v)| (id, (v, by_id[&id].shard_dims())))
            .collect()
    }

    /// Every bucket, in order.
    fn all_buckets(&self) -> impl Iterator<Item = Group> + use<M> {
        (0..self.buckets.len()).map(Group::Bucket)
    }

    /// `module` with the full values of the parameters in `groups`, all-gathered from
    /// every rank's `shards` (consumed as they are sent), one collective per group.
    fn gather<U: Module>(
        &self,
        mut module: U,
        mut shards: HostValues,
        groups: impl IntoIterator<Item = Group>,
        device: &Device,
        require_grad: bool,
    ) -> Result<U, ShardError> {
        let world = self.comm.world_size();
        for group in groups {
            let indices = match group {
                Group::Bucket(i) => &self.buckets[i],
                Group::Unit(i) => &self.units[i],
            };
            let slots: Vec<&Slot> = indices.iter().map(|&i| &self.slots[i]).collect();
            let mine: Vec<f32> = slots
                .iter()
                .flat_map(|s| shards.remove(&s.id).expect("a shard for every parameter"))
                .collect();
            let expected = world * mine.len();
            let gathered = if world == 1 {
                mine
            } else {
                f32s(self.comm.all_gather(&Buffer::F32(mine))?)
            };
            if gathered.len() != expected {
                return Err(ShardError::ModelMismatch {
                    rank: self.comm.rank(),
                    detail: format!(
                        "gathered {} values for parameters {}.., expected {expected}",
                        gathered.len(),
                        slots[0].path
                    ),
                });
            }
            let full = slots
                .iter()
                .zip(layout::unpack_gathered(&slots, &gathered, world))
                .map(|(s, v)| (s.id, (v, s.dims.clone())))
                .collect();
            module = host::set_values(module, full, device, require_grad);
        }
        Ok(module)
    }

    /// Averages the local gradients of one group over the ranks: all-reduce (ddp, zero1)
    /// or reduce-scatter to this rank's shards (zero2, zero3).
    fn reduce(&mut self, group: Group) -> Result<(), ShardError> {
        let world = self.comm.world_size();
        let indices = match group {
            Group::Bucket(i) => &self.buckets[i],
            Group::Unit(i) => &self.units[i],
        };
        let slots: Vec<&Slot> = indices.iter().map(|&i| &self.slots[i]).collect();
        let local: Vec<Vec<f32>> = slots
            .iter()
            .map(|s| {
                self.local
                    .remove(&s.id)
                    .unwrap_or_else(|| vec![0.0; s.numel()])
            })
            .collect();
        let reduced = match self.strategy {
            Strategy::Ddp | Strategy::Zero1 if world == 1 => local,
            Strategy::Ddp | Strategy::Zero1 => {
                let mut buf = Buffer::from_f32(self.reduce_dtype, local.concat());
                self.comm.all_reduce(&mut buf, ReduceOp::Mean)?;
                layout::split(&f32s(buf), slots.iter().map(|s| s.numel()))
            }
            Strategy::Zero2 | Strategy::Zero3 => {
                let packed = layout::pack_rank_major(&slots, &local, world);
                drop(local);
                let mine = if world == 1 {
                    packed
                } else {
                    let packed = Buffer::from_f32(self.reduce_dtype, packed);
                    f32s(self.comm.reduce_scatter(&packed, ReduceOp::Mean)?)
                };
                layout::split(&mine, slots.iter().map(|s| s.shard_numel()))
            }
        };
        for (slot, grad) in slots.iter().zip(reduced) {
            self.reduced.insert(slot.id, grad);
        }
        self.note_grads();
        Ok(())
    }

    /// Per-block checkpointing, and ZeRO-3. Blocks run forward outside autodiff, keeping
    /// only their input; backward takes each block again, recomputes it under autodiff (with
    /// the same dropout masks) and back-propagates the incoming gradient through it. Under
    /// ZeRO-2 and ZeRO-3 a block's gradients are reduce-scattered as soon as backward leaves
    /// it on the last micro-step, so a rank holds one block's full gradients (and the root's)
    /// at a time (earlier micro-steps of an accumulation keep full sums); under ZeRO-3
    /// its parameters are also gathered just before it runs and dropped after, and the root
    /// unit (embeddings and head) stays gathered for the whole micro-step. DDP and ZeRO-1
    /// reduce their buckets after the whole backward, as without checkpointing.
    fn blockwise_micro_step(
        &mut self,
        input: M::Input,
        target: M::Target,
        accumulate: usize,
        last: bool,
    ) -> Result<f64, ShardError> {
        let zero3 = self.strategy == Strategy::Zero3;
        let per_unit = self.per_unit();
        let _autocast = autocast::scope(self.precision.is_mixed());
        let mut root = self.model.as_ref().expect(PRESENT).clone();
        let blocks = root.take_blocks();
        let root = self.compute(if zero3 {
            self.gather_unit(root, 0, &self.device, true)?
        } else {
            root
        });

        let (embedded, mask) = root.embed(input); // [batch, seq, d_model]
        let inner_mask = mask.clone().map(|m| m.inner());
        let mut x = embedded.clone().inner();
        let mut saved = Vec::with_capacity(blocks.len());
        let training = dropout::training_scope();
        for (i, block) in blocks.iter().enumerate() {
            let block = self.block(block, i, false)?;
            saved.push((x.clone(), dropout::position()));
            x = root.block_forward(&block, x, &inner_mask);
        }
        drop(training);
        let x = autodiff_on(x, &self.device).require_grad();
        let (value, loss) = self.scaled(root.head_loss(x.clone(), target), accumulate);
        let resume = dropout::position();

        let grads = loss.backward();
        let mut grad_x = x
            .grad(&grads)
            .expect("the head reads the last block's output");
        host::add_grads(
            &root,
            &mut GradientsParams::from_grads(grads, &root),
            &mut self.local,
        );
        for (i, block) in blocks.iter().enumerate().rev() {
            let block = self.block(block, i, true)?;
            let (x, at) = saved.pop().expect("one saved input per block");
            dropout::rewind(at);
            let x = autodiff_on(x, &self.device).require_grad();
            let y = root.block_forward(&block, x.clone(), &mask);
            let grads = (y * autodiff_on(grad_x, &self.device)).sum().backward();
            grad_x = x
                .grad(&grads)
                .expect("a block's output depends on its input");
            host::add_grads(
                &block,
                &mut GradientsParams::from_grads(grads, &block),
                &mut self.local,
            );
            self.note_grads();
            drop(block);
            if per_unit && last {
                self.reduce(Group::Unit(i + 1))?;
            }
        }
        dropout::rewind(resume);
        if embedded.is_tracked() {
            let grads = (embedded * autodiff_on(grad_x, &self.device))
                .sum()
                .backward();
            host::add_grads(
                &root,
                &mut GradientsParams::from_grads(grads, &root),
                &mut self.local,
            );
        }
        self.note_grads();
        if last {
            if per_unit {
                self.reduce(Group::Unit(0))?;
            } else {
                for bucket in self.all_buckets() {
                    self.reduce(bucket)?;
                }
            }
        }
        Ok(value)
    }

    /// Block `i` for forward outside autodiff (`!train`) or for recomputation under it: its
    /// gathered parameters under ZeRO-3, else the replica's own; in the compute dtype.
    fn block(&self, block: &M::Block, i: usize, train: bool) -> Result<M::Block, ShardError> {
        let block = match (self.strategy, train) {
            (Strategy::Zero3, true) => {
                self.gather_unit(block.clone(), i + 1, &self.device, true)?
            }
            (Strategy::Zero3, false) => {
                self.gather_unit(block.clone(), i + 1, &self.inner_device(), false)?
            }
            (_, true) => block.clone(),
            (_, false) => host::detached(block),
        };
        Ok(self.compute(block))
    }

    /// `unit` (shard-shaped) with its full parameters gathered onto `device`.
    fn gather_unit<U: Module>(
        &self,
        unit: U,
        index: usize,
        device: &Device,
        require_grad: bool,
    ) -> Result<U, ShardError> {
        let shards = host::values(&unit);
        self.gather(unit, shards, [Group::Unit(index)], device, require_grad)
    }
}

/// Slots moved by one collective: one of the size-capped buckets, or one unit.
#[derive(Debug, Clone, Copy)]
enum Group {
    Bucket(usize),
    Unit(usize),
}

fn f32s(buf: Buffer) -> Vec<f32> {
    match buf {
        Buffer::F32(values) => values,
        other => other.to_f32(),
    }
}
