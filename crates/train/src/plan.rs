//! The memory planner: a run's per-rank peak, predicted before its first step from the
//! configuration, term by term (model states by kind, the 16-bit compute copy, the largest
//! gathered unit, activations with and without checkpointing, collective buffers, the
//! optimizer's temporaries), as DeepSpeed's `estimate_zero3_model_states_mem_needs` counts
//! model states, and beyond them what a step adds.
//!
//! Model states and buffers come from the parameter shapes and the engine's rules. What the
//! backend keeps for backward is not a formula of the shapes (it is whatever Burn's autodiff
//! saves), so a [`Probe`] measures it once on the run's largest micro-batch: the embeddings, ONE
//! block and the head run forward and backward on zero-valued copies in the compute dtype
//! (then each one's backward alone, as the engine's blockwise backward runs them),
//! and one optimizer step runs on the largest parameter, with the counting allocator
//! ([`crate::memory`]) reading what each adds. The planner composes these into the engine's
//! phases of a step (forward, backward at each end, the gradient reduction, the optimizer
//! step) and takes the largest.

use std::collections::{BTreeSet, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{DType, Gradients};
use burnscale_nn::{BlockModel, Mask, autocast, dropout, regather, selective};
use burnscale_shard::layout::{self, Slot};
use burnscale_shard::{BUCKET_ELEMS, StepGrads, params};
use serde::Serialize;

use crate::freeze;
use crate::memory::{self, human_bytes};
use crate::optim::{self, ParamOptimizer};
use crate::report::aligned;
use crate::runner::{self, BatchPart, TrainTask};
use crate::{CheckpointMode, TrainArgs, TrainError};

/// What the backend adds, measured once on the run's largest micro-batch (bytes), and the
/// parameters that get no gradient.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Probe {
    /// Heap of this process outside the model's parameters when the run begins (the data,
    /// the runtime).
    pub baseline: usize,
    /// What a copy of the task holds (each rank trains on its own).
    pub task: usize,
    /// What the embeddings' forward keeps for backward (their output included).
    pub embed: usize,
    /// What one block's forward keeps for backward (its output included).
    pub block: usize,
    /// One block's output: what a checkpointed block keeps of its forward.
    pub block_output: usize,
    /// What a block checkpointed selectively keeps beside its input: its linears' outputs
    /// ([`selective::record`]).
    pub block_tape: usize,
    /// What its re-run under autodiff then adds above them ([`selective::replay`]): the rest
    /// of its graph, where a fully checkpointed block's re-run adds `block`.
    pub block_replayed: usize,
    /// `block_backward` through that re-run, whose linears' backward is
    /// [`selective::ReplayOps`]'s.
    pub replayed_backward: usize,
    /// What a frozen block (every parameter untracked) keeps for backward when its input is
    /// tracked, as a block between units that train keeps it: the gradient of its input
    /// only, none of its weights'.
    pub frozen_block: usize,
    /// What a block keeps beyond `block` when its input is held as well, as the engine holds
    /// it going block by block (to read its gradient): an op that would work in place on an
    /// input the block alone owns copies it instead, and keeps the copy.
    pub held_input: usize,
    /// What the head and loss keep.
    pub head: usize,
    /// The most backward adds above the forward it undoes (gradients of the activations and
    /// the weights, the backward's temporaries), for each part alone, as backward meets
    /// them: the head and loss from the last block's output, one block, and the embeddings
    /// (a token table's whole gradient, dense, among theirs).
    pub head_backward: usize,
    pub block_backward: usize,
    pub embed_backward: usize,
    /// `block_backward` with the block's linears regathered (ZeRO-3 resharded after forward):
    /// their op drops each input as its backward reads it.
    pub regathered_backward: usize,
    /// The optimizer step's temporaries on the model's largest parameter (of `step_elems`
    /// elements), above its state.
    pub step: usize,
    pub step_elems: usize,
    /// The most an evaluation adds above the model: the validation set's largest batch (at its
    /// own batch size, which may be larger than training's) built, run through the model
    /// outside autodiff and scored; 0 without a validation set.
    pub eval: usize,
    /// The paths of the parameters outside the blocks that no backward reaches (BigBird's
    /// pooler, which its classifier does not read): the optimizer never steps them, so they
    /// have no state.
    pub unreached: BTreeSet<String>,
}

impl Probe {
    /// Measures `model`'s terms for `args` on `device` with the largest micro-batch of a copy of
    /// `task` (its own stream does not move). Run it on one thread before the ranks start:
    /// it reads the process-wide counting allocator. Without one, every term reads 0.
    pub fn measure<T: TrainTask>(
        model: &T::Model,
        task: &T,
        args: &TrainArgs,
        device: &Device,
    ) -> Result<Self, TrainError> {
        let baseline = memory::live_bytes().saturating_sub(materialized_bytes(model));
        let dtype = args.precision.compute_dtype();
        // Zero copies of the root and the first block only, never of the whole model.
        let mut root = model.clone();
        let block = root.take_blocks().into_iter().next();
        let root = zeros_like(root, dtype.into(), device);
        let block = block.map(|b| zeros_like(b, dtype.into(), device));
        let live = memory::live_bytes();
        let mut copy = task.clone();
        let task_bytes = memory::live_bytes().saturating_sub(live);
        let (input, target) = copy.largest_batch(device, BatchPart::WHOLE);
        runner::check_rows(model.extent(&input)[0], Some(args.batch_size))?;
        let (
            baseline,
            embed,
            block_bytes,
            block_output,
            head,
            parts,
            unreached,
            frozen_block,
            (block_tape, block_replayed, replayed_backward),
        ) = {
            let _autocast = autocast::scope(args.precision.is_mixed());
            let _training = dropout::training_scope();
            // The forward through the embeddings, the block and the head, with `mark` called
            // after each of the first two: the loss, the mask, and the block output's shape
            // and bytes.
            let forward = |mark: &mut dyn FnMut()| {
                let (x, mask) = root.embed(input.clone());
                mark();
                let x = match &block {
                    Some(block) => root.block_forward(block, x, &mask),
                    None => x,
                };
                mark();
                let (dims, bytes) = (x.shape(), x.shape().num_elements() * x.dtype().size());
                (root.head_loss(x, target.clone()), mask, dims, bytes)
            };
            // A block's forward through regathered linears (resharded ZeRO-3) from `input`,
            // then its backward: the most that adds above its start. Their op drops each input
            // as its backward reads it; Burn's linear keeps it to the end.
            let regathered = |block, input: Tensor<3>, mask: &Mask| {
                let (y, read) = regather::forward(|| root.block_forward(block, input, mask));
                let weights = params::matrices(block, &read);
                let peak = || memory::peak_added_by(|| y.sum().backward()).1;
                regather::backward(weights, peak).0
            };
            // A first forward and backward (and a block's through regathered linears) leave
            // what the backend keeps for good (the matmul's packing buffers, ~3 MiB for a
            // block of width 512 on Flex): outside the model, once, not in the first part
            // measured after them. Backward, not a drop, frees the graph.
            let live = memory::live_bytes();
            drop(forward(&mut || ()).0.backward());
            if let Some(block) = &block {
                let (x, mask) = root.embed(input.clone());
                regathered(block, x.detach().require_grad(), &mask);
            }
            let baseline = baseline + memory::live_bytes().saturating_sub(live);
            let mut marks = Vec::with_capacity(2);
            let live = memory::live_bytes();
            let (loss, mask, dims, output) = forward(&mut || marks.push(memory::live_bytes()));
            let headed = memory::live_bytes();
            drop(loss);
            let (embedded, blocked) = (marks[0], marks[1]);
            // Each part's backward on its own, as backward meets them: the head from the last
            // block's output, the block from its input, the embeddings.
            let leaf = || Tensor::<3>::zeros(dims.clone(), (device, dtype.into())).require_grad();
            let loss = root.head_loss(leaf(), target);
            let (grads, head_backward) = memory::peak_added_by(|| loss.backward());
            let mut reached = with_grads(&root, &grads);
            drop(grads);
            // What a block's forward from a tracked input leaf keeps, and then its backward.
            let from_leaf = |block: &_| {
                let input = leaf();
                let live = memory::live_bytes();
                let y = root.block_forward(block, input.clone(), &mask);
                let kept = memory::live_bytes().saturating_sub(live);
                drop(y.sum().backward());
                kept
            };
            // A block's forward outside autodiff keeping its linears' outputs, and its re-run
            // from `input` under autodiff taking them back: the bytes each keeps.
            let selective_block =
                |block: &<T::Model as BlockModel>::Block, input: Tensor<3>, mask: &Mask| {
                    let (plain, inner_mask) =
                        (params::detached(block), mask.clone().map(|m| m.inner()));
                    let at = dropout::position();
                    let live = memory::live_bytes();
                    let forward = || root.block_forward(&plain, input.clone().inner(), &inner_mask);
                    let (y, kept) = selective::record(forward);
                    drop(y);
                    let tape = memory::live_bytes().saturating_sub(live);
                    dropout::rewind(at);
                    let live = memory::live_bytes();
                    let y = selective::replay(kept, || root.block_forward(block, input, mask));
                    let replayed = memory::live_bytes().saturating_sub(live);
                    let backward = memory::peak_added_by(|| y.sum().backward()).1;
                    (tape, replayed, backward)
                };
            let (block_backward, regathered_backward, held_input, frozen_block, selective) =
                match &block {
                    Some(block) => {
                        let y = root.block_forward(block, leaf(), &mask);
                        let backward = memory::peak_added_by(|| y.sum().backward()).1;
                        let selective = selective_block(block, leaf(), &mask);
                        let held = from_leaf(block);
                        let held_input = held.saturating_sub(blocked.saturating_sub(embedded));
                        let frozen = from_leaf(&block.clone().no_grad()).saturating_sub(held_input);
                        (
                            backward,
                            regathered(block, leaf(), &mask),
                            held_input,
                            frozen,
                            selective,
                        )
                    }
                    None => (0, 0, 0, 0, (0, 0, 0)),
                };
            let (x, _) = root.embed(input);
            let embed_backward = match x.is_tracked() {
                true => {
                    let (grads, bytes) = memory::peak_added_by(|| x.sum().backward());
                    reached.extend(with_grads(&root, &grads));
                    bytes
                }
                false => 0,
            };
            let unreached = layout::slots(&root, 1)
                .into_iter()
                .filter(|slot| !reached.contains(&slot.id))
                .map(|slot| slot.path)
                .collect();
            (
                baseline,
                embedded.saturating_sub(live),
                blocked.saturating_sub(embedded),
                output,
                headed.saturating_sub(blocked),
                [
                    head_backward,
                    block_backward,
                    regathered_backward,
                    embed_backward,
                    held_input,
                ],
                unreached,
                frozen_block,
                selective,
            )
        };
        let [
            head_backward,
            block_backward,
            regathered_backward,
            embed_backward,
            held_input,
        ] = parts;
        // Outside autodiff each block's output takes its input's place: one block stands
        // for all.
        let eval = match copy.eval_batches() {
            0 => 0,
            _ => {
                let _autocast = autocast::scope(args.precision.is_mixed());
                let (root, block) = (root.valid(), block.as_ref().map(Module::valid));
                let inner = device.clone().inner();
                let scored = memory::peak_added_by(|| {
                    let (input, target) = copy.largest_eval_batch(&inner);
                    runner::check_rows(root.extent(&input)[0], None)?;
                    let (x, mask) = root.embed(input);
                    let x = match &block {
                        Some(block) => root.block_forward(block, x, &mask),
                        None => x,
                    };
                    Ok::<_, TrainError>(copy.score(root.logits(x), target))
                });
                scored.0?;
                scored.1
            }
        };
        drop((root, block, copy));
        let (step, step_elems) = optimizer_step_bytes(model, args, device)?;
        Ok(Self {
            baseline,
            task: task_bytes,
            embed,
            block: block_bytes,
            block_output,
            block_tape,
            block_replayed,
            replayed_backward,
            frozen_block,
            held_input,
            head,
            head_backward,
            block_backward,
            regathered_backward,
            embed_backward,
            step,
            step_elems,
            eval,
            unreached,
        })
    }
}

/// The parameters of `module` that `grads` holds a gradient for.
fn with_grads<M: Module>(module: &M, grads: &Gradients) -> HashSet<ParamId> {
    struct Reached<'a>(&'a Gradients, HashSet<ParamId>);
    impl ModuleVisitor for Reached<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.val().grad(self.0).is_some() {
                self.1.insert(param.id);
            }
        }
    }
    let mut reached = Reached(grads, HashSet::new());
    module.visit(&mut reached);
    reached.1
}

/// Bytes of the parameters of `module` already initialised (a lazy one holds none yet).
fn materialized_bytes<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_initialized() {
                self.0 += param.shape().num_elements() * param.val().dtype().size();
            }
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

/// `module` with fresh zero-valued parameters of the same shapes in `dtype`, tracked on
/// `device`: what the probe runs (a lazy module's initialisers never run).
fn zeros_like<M: Module>(module: M, dtype: DType, device: &Device) -> M {
    struct Zeros<'a>(DType, &'a Device);
    impl ModuleMapper for Zeros<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let zeros = Tensor::zeros(param.lazy_shape(), (self.1, self.0)).require_grad();
            Param::initialized(ParamId::new(), zeros)
        }
    }
    module.map(&mut Zeros(dtype, device))
}

/// Two optimizer steps on a zero copy of the model's largest parameter, in the weights'
/// dtype: the most the second step adds above the state it keeps, and the parameter's
/// elements (a shard's step adds its share).
fn optimizer_step_bytes<M: Module>(
    model: &M,
    args: &TrainArgs,
    device: &Device,
) -> Result<(usize, usize), TrainError> {
    let Some(slot) = layout::slots(model, 1).into_iter().max_by_key(Slot::numel) else {
        return Ok((0, 0));
    };
    let dims = slot.dims;
    #[derive(Module, Debug)]
    struct One {
        weight: Param<Tensor<2>>,
    }
    let (rows, cols) = (dims[0], dims[1..].iter().product::<usize>());
    let dtype: DType = args.precision.param_dtype().into();
    let inner = device.clone().inner();
    let one = One {
        weight: Param::from_tensor(Tensor::zeros([rows, cols], (&inner, dtype))),
    };
    // Under --offload-dir the probe's state goes to disk too (its own directory there,
    // removed with it): the step then adds the state it reads in and the copy it writes back,
    // which the plan, holding no state in memory between steps, counts nowhere else.
    let mut optim = ParamOptimizer::new(args, 0, &one)?;
    // Clipping and 16-mixed's unscaling hand the step its gradients with a factor, which each
    // optimizer multiplies in where it reads a gradient (Adafactor twice before its update).
    let multiplied = args.grad_clip > 0.0 || args.precision.scales_loss();
    let grads = |one: &One| {
        let mut grads = burn::optim::GradientsParams::new();
        grads.register(
            one.weight.id,
            Tensor::<2>::zeros([rows, cols], (&inner, dtype)),
        );
        let factor = multiplied.then(|| Tensor::<1>::ones([1], (&inner, DType::F32)));
        StepGrads::new(grads, factor)
    };
    let first = grads(&one);
    let (one, stepped) = optim.step(1e-3, one, first, None);
    stepped?;
    let second = grads(&one);
    let ((one, stepped), added) = memory::peak_added_by(|| optim.step(1e-3, one, second, None));
    stepped?;
    drop((one, optim));
    Ok((added, rows * cols))
}

/// One phase of a step, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The end of forward: every activation kept for backward.
    Forward,
    /// Backward through the last block (first in backward order).
    BackwardTop,
    /// Backward through the highest block that `--checkpoint-blocks` recomputes, the graphs
    /// above it gone, their gradients there.
    BackwardRecomputed,
    /// Backward through the first block: the gradients nearly all there.
    BackwardBottom,
    /// Backward through the embeddings: every other gradient there.
    Embeddings,
    /// The gradients reduced over the ranks.
    Reduce,
    /// The optimizer step (each gradient multiplied by the clipping and unscaling factor as
    /// it is stepped).
    Step,
    /// An evaluation's forward (after a step, the gradients gone), at the validation batch's
    /// size.
    Evaluation,
}

/// One rank's predicted bytes, by kind, at its peak phase; and the process's peak.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryPlan {
    pub world: usize,
    /// Ranks that are threads of this process (their peaks add up in it).
    pub ranks_in_process: usize,
    /// Model states held between steps.
    pub params: usize,
    pub optimizer: usize,
    /// Gradients held at the optimizer step.
    pub grads: usize,
    /// The mixed policies' 16-bit copy of what runs at once (the whole model, the root, or a
    /// unit).
    pub compute_copy: usize,
    /// ZeRO-3: the largest unit gathered at once (compute dtype).
    pub gathered_unit: usize,
    /// ZeRO-3 not resharded after forward: the units gathered and kept by the end of forward
    /// (compute dtype).
    pub gathered_kept: usize,
    /// Activations kept for backward at the end of forward, without and with every block
    /// checkpointed (the run's own is between them under `--checkpoint-blocks`).
    pub activations: usize,
    pub activations_checkpointed: usize,
    /// Collective buffers at once (a bucket packed for its reduction, the reduced values
    /// taking the place of the gradients it copies).
    pub buffers: usize,
    /// The optimizer step's temporaries on the largest tensor this rank steps.
    pub step_temporaries: usize,
    pub probe: Probe,
    /// The phase the peak falls in, and one rank's peak there.
    pub peak_phase: Phase,
    pub rank_peak: usize,
    /// The process's predicted peak: its ranks' peaks and the baseline.
    pub process_peak: usize,
    /// Every phase's prediction for one rank.
    pub phases: Vec<PhaseBytes>,
}

/// One rank's bytes in a phase, of which `transient` only for a moment (backward's
/// temporaries through one block): shown beside the phase, counted in it in full.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PhaseBytes {
    pub phase: Phase,
    pub bytes: usize,
    pub transient: usize,
}

impl PhaseBytes {
    fn new(phase: Phase, bytes: usize, transient: usize) -> Self {
        Self {
            phase,
            bytes,
            transient,
        }
    }
}

/// What the parameters are, unit by unit, as the engine groups them.
struct Units {
    /// Every slot of the model, over `world` ranks.
    slots: Vec<Slot>,
    /// The embeddings' slots, in visit order.
    embedding_slots: Vec<Slot>,
    head: usize,
    /// Each block's slots, in visit order.
    blocks: Vec<Vec<Slot>>,
    /// Whether the head reads the embeddings' parameters (a tied decoder).
    head_reads_embeddings: bool,
}

impl Units {
    /// `model`'s units over `world` ranks, leaving out the parameters in `frozen`.
    fn of<M: BlockModel>(model: &M, world: usize, frozen: &HashSet<ParamId>) -> Self {
        let unfrozen = |mut slots: Vec<Slot>| {
            slots.retain(|s| !frozen.contains(&s.id));
            slots
        };
        let slots = unfrozen(layout::slots(model, world));
        let mut root = model.clone();
        let blocks = root.take_blocks();
        let embedding: HashSet<ParamId> = root.embedding_params().into_iter().collect();
        let root_slots = unfrozen(layout::slots(&root, world));
        let embedding_slots: Vec<Slot> = root_slots
            .iter()
            .filter(|s| embedding.contains(&s.id))
            .cloned()
            .collect();
        let head = elems(&root_slots) - elems(&embedding_slots);
        let head_reads_embeddings = root.head_params().iter().any(|id| embedding.contains(id));
        let blocks = blocks
            .iter()
            .map(|b| unfrozen(layout::slots(b, world)))
            .collect();
        Self {
            slots,
            embedding_slots,
            head,
            blocks,
            head_reads_embeddings,
        }
    }

    fn numel(&self) -> usize {
        elems(&self.slots)
    }

    fn shard_numel(&self) -> usize {
        shard_elems(&self.slots)
    }

    /// Elements of one rank's shards of the head's own parameters (a tied table is the
    /// embeddings').
    fn head_shard(&self) -> usize {
        let blocks: usize = self.blocks.iter().map(|b| shard_elems(b)).sum();
        self.shard_numel() - shard_elems(&self.embedding_slots) - blocks
    }

    fn embeddings(&self) -> usize {
        elems(&self.embedding_slots)
    }

    /// The slots of the block with the most elements.
    fn largest_block_slots(&self) -> &[Slot] {
        let block = |slots: &&Vec<Slot>| elems(slots);
        self.blocks
            .iter()
            .max_by_key(block)
            .map_or(&[], Vec::as_slice)
    }

    fn largest_block(&self) -> usize {
        elems(self.largest_block_slots())
    }

    fn largest_param(&self) -> usize {
        self.slots.iter().map(Slot::numel).max().unwrap_or(0)
    }

    /// Elements the head's forward reads: its own, and the token table where it is tied.
    fn head_unit(&self) -> usize {
        self.head + self.tied_to_head()
    }

    /// Elements of the embeddings' unit that a tied head reads (and gives gradients).
    fn tied_to_head(&self) -> usize {
        match self.head_reads_embeddings {
            true => self.embeddings(),
            false => 0,
        }
    }

    fn largest_unit(&self) -> usize {
        self.largest_block().max(self.embeddings()).max(self.head)
    }

    /// The most ZeRO-1/2's gather after the step holds beside the replica (`w` bytes an
    /// element), bucket by bucket in the engine's order: the updated shards not yet sent, and
    /// the bucket twice (as received, and cut into its parameters).
    fn gathered_after_step(&self, w: usize) -> usize {
        let shards = self.shard_numel();
        let mut sent = 0;
        layout::buckets(&self.slots, BUCKET_ELEMS)
            .into_iter()
            .map(|range| {
                let bucket = &self.slots[range];
                sent += bucket.iter().map(Slot::shard_numel).sum::<usize>();
                w * (shards - sent + 2 * bucket.iter().map(Slot::numel).sum::<usize>())
            })
            .max()
            .unwrap_or(0)
    }

    /// Elements of the engine's largest gradient bucket: its buckets of these units, each
    /// counting the elements of the `trained` units' slots alone (the reduction leaves the
    /// frozen ones out).
    fn largest_bucket(&self, trained: &Units) -> usize {
        let trained: HashSet<ParamId> = trained.slots.iter().map(|s| s.id).collect();
        let bucket = |range: std::ops::Range<usize>| {
            self.slots[range]
                .iter()
                .filter(|s| trained.contains(&s.id))
                .map(Slot::numel)
                .sum()
        };
        layout::buckets(&self.slots, BUCKET_ELEMS)
            .into_iter()
            .map(bucket)
            .max()
            .unwrap_or(0)
    }
}

impl MemoryPlan {
    /// The plan for `model` trained as `args` say on `world` ranks, `ranks_in_process` of
    /// them threads of this process, with the backend's terms from `probe`.
    pub fn new<M: BlockModel>(
        model: &M,
        args: &TrainArgs,
        world: usize,
        ranks_in_process: usize,
        probe: Probe,
    ) -> Result<Self, TrainError> {
        let units = Units::of(model, world, &HashSet::new());
        // The trained parameters alone, unit by unit: what has gradients and optimizer state.
        let trained = Units::of(model, world, &freeze::known_frozen(model, &args.freeze));
        let sharding = args.acting_sharding(world)?;
        let w = DType::from(args.precision.param_dtype()).size();
        let c = DType::from(args.precision.compute_dtype()).size();
        let mixed = args.precision.is_mixed();
        let n = units.numel();
        let depth = units.blocks.len();

        let params = w * match sharding.parameters {
            true => units.shard_numel(),
            false => n,
        };
        let optimizer = optimizer_bytes(
            model,
            args,
            &trained,
            sharding.optimizer_state,
            &probe.unreached,
        );
        // The state held through forward and backward: none in a run that peaks in its first
        // step (the optimizer makes its state there).
        let state = match args.steps_to_peak() > 1 {
            true => optimizer,
            false => 0,
        };
        let full_grads = w * trained.numel();
        let sharded_grads = w * trained.shard_numel();
        // Gradients summed over earlier micro-steps of an accumulation: whole where the
        // engine reduces only on the last (DDP, ZeRO-1), else the shards every micro-step
        // reduced (ZeRO-2/3).
        let accumulated = match (args.accumulate > 1, sharding.gradients) {
            (false, _) => 0,
            (true, false) => full_grads,
            (true, true) => sharded_grads,
        };
        // Whole gradient sums carried over micro-steps (DDP, ZeRO-1): a unit's 16-bit gradients
        // are cast into the weights' dtype to be added in, both beside the sums for a moment.
        let whole_sums = args.accumulate > 1 && !sharding.gradients;
        let cast_into_sums = |elems: usize| match whole_sums && c != w {
            true => w * elems,
            false => 0,
        };
        // The lowest `checkpointed` blocks keep only their input; those above, their graphs.
        let checkpointed = args.checkpointing().blocks(depth)?;
        let keep_gathered = sharding.keeps_gathered();
        // Backward goes block by block with checkpointing, and wherever gathered units are
        // dropped as backward leaves each (or, resharded, their weights after forward).
        let blockwise = checkpointed > 0 || sharding.parameters;
        // The engine reduces unit by unit where it shards gradients along the blockwise
        // path, else bucket by bucket.
        let group = match sharding.gradients && blockwise {
            true => trained.largest_unit(),
            false => units.largest_bucket(&trained),
        };
        // One bucket's reduction beside the gradients: its packed copy, beside the gradients
        // it copies until they drop. What the collective receives then takes their place: a
        // bucket for an all-reduce (into a new buffer under MPI, the input freed; in place on
        // threads), a chunk for a reduce-scatter (which sends the packed copy as it is).
        // Gradients travel in `--grad-reduce-dtype`: a bucket of 16-bit weights' reduced in
        // f32 is cast up for the collective (measured +9.5% unplanned before it was counted).
        let r = burnscale_collective::tensor_dtype(args.grad_reduce_dtype.dtype()).size();
        let buffers = match world > 1 {
            true => w.max(r) * group,
            false => 0,
        };
        // Below the lowest unit that trains nothing is kept for backward: the engine runs those
        // blocks outside autodiff (as autodiff's own graph starts at the first tracked
        // parameter), and backward stops above them.
        let embeddings_train = !trained.embedding_slots.is_empty();
        let frozen_below = match embeddings_train {
            true => 0,
            false => trained.blocks.iter().take_while(|b| b.is_empty()).count(),
        };
        // Their copies (gathered, or cast) are dropped after their forward.
        let frozen_below_elems: usize = units.blocks[..frozen_below].iter().map(|b| elems(b)).sum();
        // Frozen blocks above it keep only what their input's gradient needs (those that
        // keep their graphs; a checkpointed one keeps its input alone).
        let frozen_above = |from: usize| {
            let from = from.max(frozen_below);
            trained.blocks[from..]
                .iter()
                .zip(&units.blocks[from..])
                .filter(|(trained, all)| trained.is_empty() && !all.is_empty())
                .count()
        };
        // The blocks that train or pass a gradient on and keep their graphs: above the
        // checkpointed ones.
        let graphs_from = checkpointed.max(frozen_below);
        let graph_depth = depth - graphs_from;
        // With sharded parameters resharded after forward the embeddings run outside
        // autodiff (they are recomputed in backward), so forward keeps only their output; so
        // too when they are frozen (the first block that trains keeps its input).
        let embed_kept = match sharding.reshards() || !embeddings_train {
            true => probe.block_output,
            false => probe.embed,
        };
        // What a checkpointed block keeps of its forward (its input; selective, its linears'
        // outputs too), and what its re-run in backward adds: with its kept outputs where no
        // phase counts them otherwise (`rerun_alone`), or beside them (`rerun`); then the
        // backward through it.
        let (checkpoint_kept, rerun_alone, rerun, rerun_backward) = match args.checkpoint_mode {
            CheckpointMode::Full => (
                probe.block_output,
                probe.block,
                probe.block,
                probe.block_backward,
            ),
            CheckpointMode::Selective => (
                probe.block_output + probe.block_tape,
                probe.block_tape + probe.block_replayed,
                probe.block_replayed,
                probe.replayed_backward,
            ),
        };
        // What forward keeps when the blocks from `from` up keep their graphs, and those below
        // (down to the lowest that trains) their inputs.
        let kept_above = |from: usize| {
            let (graphs, frozen) = (depth - from, frozen_above(from));
            embed_kept
                + (from - frozen_below) * checkpoint_kept
                + (graphs - frozen) * probe.block
                + frozen * probe.frozen_block
                + probe.head
        };
        let activations = kept_above(frozen_below);
        let activations_checkpointed = kept_above(depth);
        // A gathered unit is a copy of the shards: all-gathered from the ranks, or, alone, their
        // 16-bit cast. A rank alone that still acts sharded without a cast has its shards
        // offloaded, and on the CPU, the one device planned, the host is the device: moving
        // them there copies nothing (a rank alone otherwise acts as a replica:
        // `Sharding::acting_on`).
        let gathers = sharding.parameters && (world > 1 || mixed);
        // Not resharded after forward: every unit but the head's gathered by the end of
        // forward, each held until its backward ends.
        let kept_copies = keep_gathered && gathers;
        let gathered_kept = match kept_copies {
            true => c * (n - units.head - frozen_below_elems),
            false => 0,
        };
        // One micro-step's phases, its compute copy and largest gathered unit: a plain one
        // (one graph, one backward) or block by block.
        let micro_step = |blockwise: bool| {
            let mut phases = Vec::new();
            let gathered_unit;
            let compute_copy;
            if !blockwise {
                compute_copy = if mixed { c * n } else { 0 };
                gathered_unit = 0;
                // Plain, a micro-step of an accumulation into whole sums is the first: no sums yet.
                let earlier = match whole_sums {
                    true => 0,
                    false => accumulated,
                };
                let held = params + state + earlier + compute_copy;
                phases.push(PhaseBytes::new(Phase::Forward, held + activations, 0));
                phases.push(backward_top(
                    held + activations + probe.head_backward,
                    held + activations - probe.head
                        + c * trained.head_unit()
                        + probe.block_backward,
                    &probe,
                    probe.block_backward,
                ));
                // A plain backward: the embeddings last, beside its gradients of everything else
                // (a tied head's of the token table among them, until the embeddings' own add to
                // it); then all of them moved into the sums.
                let tied_table_grads = c * trained.tied_to_head();
                let embeddings = |held| {
                    held + probe.embed
                        + c * (trained.numel() - trained.embeddings())
                        + tied_table_grads
                        + probe.embed_backward
                };
                if embeddings_train {
                    phases.push(PhaseBytes::new(
                        Phase::Embeddings,
                        embeddings(held),
                        probe.embed_backward,
                    ));
                }
                phases.push(PhaseBytes::new(
                    Phase::BackwardBottom,
                    held + grads_moved_in(&trained.slots, c, w),
                    0,
                ));
                // This micro-step's whole gradients, sharded beside the shards earlier micro-steps
                // reduced (whole sums are reduced on the last micro-step, never a plain one).
                if !whole_sums {
                    let shard_sums = if sharding.gradients { accumulated } else { 0 };
                    phases.push(PhaseBytes::new(
                        Phase::Reduce,
                        params + state + compute_copy + full_grads + shard_sums + buffers,
                        0,
                    ));
                }
            } else {
                let root = units.embeddings() + units.head;
                let block = units.largest_block();
                // The unit a phase runs: gathered (zero3), or a 16-bit copy (mixed), or the
                // replica's own.
                let unit_copy = |elems: usize| match gathers || mixed {
                    true => c * elems,
                    false => 0,
                };
                compute_copy = if mixed && !sharding.parameters {
                    c * root
                } else {
                    0
                };
                let head_unit = units.head_unit();
                gathered_unit = if gathers {
                    c * block.max(head_unit).max(units.embeddings())
                } else {
                    0
                };
                let held = params + state + accumulated + compute_copy;
                // Each block's graph kept from forward holds its input beside it (`held_input`).
                let kept = kept_above(graphs_from) + graph_depth * probe.held_input;
                // Graphs kept from forward keep their blocks' weights to each block's backward:
                // a mixed replica's 16-bit copies of them (gathered units count in
                // `gathered_kept`).
                let graph_elems: usize = units.blocks[graphs_from..].iter().map(|b| elems(b)).sum();
                let copies_kept = match graph_depth > 0 && mixed && !gathers {
                    true => c * graph_elems,
                    false => gathered_kept,
                };
                // Kept gathered, a tied head reads the token table the embeddings keep (counted in
                // `gathered_kept`): its copy is its own unit.
                let head_copy = match (gathers, kept_copies) {
                    (false, _) => 0,
                    (true, true) => c * units.head,
                    (true, false) => c * head_unit,
                };
                phases.push(PhaseBytes::new(
                    Phase::Forward,
                    held + kept + copies_kept + head_copy,
                    0,
                ));
                // Zero2/3 reduce-scatter each unit's gradients as backward leaves it, on every
                // micro-step. A tied decoder's gradient of the token table stays whole until the
                // embeddings' own backward adds theirs and reduce-scatters the sum, the last.
                let per_unit = sharding.gradients;
                let tied_table_grads = match per_unit {
                    true => w * trained.tied_to_head(),
                    false => 0,
                };
                // Backward through the head and loss; then the top block recomputed beside the
                // head's gradients (a tied decoder's include the token table's), the head's
                // activations freed. Reduced per unit, the head's are its shard by then (added
                // into the shards earlier micro-steps reduced, when there are some).
                let head_grads = match (per_unit, args.accumulate > 1) {
                    (false, _) => w * trained.head_unit(),
                    (true, false) => w * trained.head_shard() + tied_table_grads,
                    (true, true) => tied_table_grads,
                };
                // A unit with `slots` recomputed: its `copy` with what its forward `kept` and its
                // backward's own peak (its gradients among them); then those gradients, in the
                // compute dtype, moved one parameter at a time into the unit's sums (empty unless
                // carried over micro-steps: then each is cast beside its sum), and per unit held
                // whole until its reduce-scatter, which packs a copy once the unit is dropped
                // (beside it, then cast from it into `--grad-reduce-dtype` where that differs).
                // One after another, not all at once. The gradient of its output from the unit above
                // goes into its backward, which then adds as much less than the probe's (whose
                // own gradient of the output is new); after it, the gradient of its input, as
                // large, waits for the unit below.
                let unit_backward = |slots: &[Slot], copy: usize, kept: usize, backward: usize| {
                    let elems = elems(slots);
                    let summed = match whole_sums {
                        false => grads_moved_in(slots, c, w),
                        true => c * elems + cast_into_sums(elems),
                    };
                    let (whole, packed) = match (per_unit, world > 1) {
                        (false, _) => (0, 0),
                        (true, false) => (w * elems, w * elems),
                        (true, true) => (w * elems, w.max(r) * elems),
                    };
                    let grad_in = probe.block_output;
                    (copy + kept + backward)
                        .max(copy + summed + grad_in)
                        .max(whole + packed + grad_in)
                };
                // The top block's backward: its copy gathered again unless kept (then it counts in
                // `copies_kept`), its activations recomputed unless forward kept its graph (then
                // they count in `kept`).
                let top_copy = match keep_gathered || copies_kept > gathered_kept {
                    true => 0,
                    false => unit_copy(block),
                };
                // The top block is recomputed when every block is checkpointed (and one trains,
                // or passes a gradient on).
                let top_recomputed = checkpointed == depth && frozen_below < depth;
                let top_activations = match top_recomputed {
                    true => rerun + probe.held_input,
                    false => 0,
                };
                // Resharded, the blocks' graphs run through regathered linears.
                // Resharded, the blocks' graphs run through regathered linears; a recomputed
                // block's backward is its re-run's.
                let block_backward = |graph: bool| match (graph, sharding.reshards()) {
                    (true, true) => probe.regathered_backward,
                    (true, false) => probe.block_backward,
                    (false, _) => rerun_backward,
                };
                let top_backward = block_backward(!top_recomputed);
                let block_slots = trained.largest_block_slots();
                let top_block = unit_backward(block_slots, top_copy, top_activations, top_backward);
                phases.push(backward_top(
                    held + kept + copies_kept + head_copy + probe.head_backward,
                    held + kept.saturating_sub(probe.head) + copies_kept + top_block + head_grads,
                    &probe,
                    top_backward,
                ));
                // The bottom block's backward, its activations (recomputed, or kept) and its copy
                // beside the embeddings' (kept gathered with them, or gathered again after) and the
                // head's input, held to the end of the micro-step.
                let head_input = probe.block_output;
                let bottom_backward = block_backward(graphs_from == frozen_below);
                let bottom_activations = match graphs_from == frozen_below {
                    true => probe.block,
                    false => rerun_alone,
                };
                let bottom_block = unit_backward(
                    block_slots,
                    unit_copy(block),
                    bottom_activations + probe.held_input,
                    bottom_backward,
                );
                let embed_gathered = match kept_copies {
                    true => c * units.embeddings(),
                    false => 0,
                };
                // The gradients held as a unit's backward starts: those of the units above it,
                // whole sums (the head's take in a tied table's), or reduced per unit, their
                // shards (a tied table's whole gradient counts in `tied_table_grads`). A unit's
                // own come in after its backward (`unit_backward`); reduced, its shard is a chunk
                // of its packed copy, which its whole sums no longer beside it outweigh.
                let grads_above = |unit: &[Slot]| match per_unit {
                    true => {
                        w * (trained.shard_numel()
                            - shard_elems(&trained.embedding_slots)
                            - shard_elems(unit))
                    }
                    false => {
                        w * (trained.numel() - trained.embeddings() + trained.tied_to_head()
                            - elems(unit))
                    }
                };
                // A block's backward: `block` its own bytes (`unit_backward`), `kept_below` what
                // the blocks below it keep, beside the embeddings' (kept gathered with them, or
                // gathered again after), the head's input, and the gradients of the units above
                // `grads_below`.
                let block_phase =
                    |phase, kept_below: usize, block: usize, grads_below: &[Slot], backward| {
                        PhaseBytes::new(
                            phase,
                            params
                                + state
                                + compute_copy
                                + embed_kept
                                + embed_gathered
                                + head_input
                                + kept_below
                                + block
                                + grads_above(grads_below).max(accumulated)
                                + tied_table_grads,
                            backward,
                        )
                    };
                // Where graphs are kept above recomputed blocks: the highest of these recomputed,
                // the graphs above it gone and their gradients come in, the inputs of the
                // recomputed blocks below it still kept.
                if graph_depth > 0 && graphs_from > frozen_below + 1 {
                    let below: Vec<Slot> = trained.blocks[..graphs_from].concat();
                    let inputs_below = (graphs_from - frozen_below - 1) * checkpoint_kept;
                    let recomputed = unit_backward(
                        block_slots,
                        unit_copy(block),
                        rerun_alone + probe.held_input,
                        rerun_backward,
                    );
                    phases.push(block_phase(
                        Phase::BackwardRecomputed,
                        inputs_below,
                        recomputed,
                        &below,
                        rerun_backward,
                    ));
                }
                phases.push(block_phase(
                    Phase::BackwardBottom,
                    0,
                    bottom_block,
                    block_slots,
                    bottom_backward,
                ));
                // The embeddings, as a block: gathered again (or kept gathered) under zero3 (else the
                // root's compute copy serves), recomputed unless kept, backward through them.
                let embed_copy = match gathers {
                    true => c * units.embeddings(),
                    false => 0,
                };
                let embeddings = unit_backward(
                    &trained.embedding_slots,
                    embed_copy,
                    probe.embed,
                    probe.embed_backward,
                );
                if embeddings_train {
                    phases.push(PhaseBytes::new(
                        Phase::Embeddings,
                        params
                            + state
                            + compute_copy
                            + grads_above(&[]).max(accumulated)
                            + tied_table_grads
                            + head_input
                            + embeddings,
                        probe.embed_backward,
                    ));
                }
                // The last reduction: per unit the embeddings', beside every other unit's shards;
                // else every bucket of the whole sums.
                let grads_reduced = match per_unit {
                    true => grads_above(&[]),
                    false => full_grads,
                };
                phases.push(PhaseBytes::new(
                    Phase::Reduce,
                    params + state + compute_copy + grads_reduced.max(accumulated) + buffers,
                    0,
                ));
            }
            (phases, compute_copy, gathered_unit)
        };
        // Accumulating whole sums (DDP, ZeRO-1) without checkpointing or sharded parameters,
        // the first micro-step (no sums yet) is plain and the later ones go block by block
        // beside the sums, as the engine runs them: each phase at the larger of the two.
        let (mut phases, compute_copy, gathered_unit) = micro_step(blockwise);
        if whole_sums && !blockwise {
            for later in micro_step(true).0 {
                match phases.iter_mut().find(|p| p.phase == later.phase) {
                    Some(p) if p.bytes >= later.bytes => {}
                    Some(p) => *p = later,
                    None => phases.push(later),
                }
            }
        }
        // The step keeps the gradients of what this rank steps (its shards where the optimizer
        // state is sharded: ZeRO-1 reduce-scatters too).
        let step_grads = match sharding.optimizer_state {
            true => sharded_grads,
            false => full_grads,
        };
        // ZeRO-1/2 step a copy of their shards, then, the gradients gone, gather the result
        // back into the replica bucket by bucket.
        let (shard_copy, gather) = if sharding.optimizer_state && !sharding.parameters {
            (w * units.shard_numel(), units.gathered_after_step(w))
        } else {
            (0, 0)
        };
        // The step's temporaries scale with the largest tensor stepped (a shard's rows).
        let largest_stepped = match sharding.optimizer_state {
            true => trained
                .slots
                .iter()
                .map(Slot::shard_numel)
                .max()
                .unwrap_or(0),
            false => trained.largest_param(),
        };
        // In u128: bytes times elements passes u64 at a billion-element parameter.
        let step_temporaries = (probe.step as u128 * largest_stepped as u128
            / probe.step_elems.max(1) as u128) as usize;
        phases.push(PhaseBytes::new(
            Phase::Step,
            params + optimizer + (step_grads + shard_copy + step_temporaries).max(gather),
            0,
        ));
        // An evaluation runs on the model states a unit at a time: gathered under ZeRO-3 (the
        // root as its units), else cast by a mixed replica (the root whole).
        if probe.eval > 0 {
            let (root, block_elems) = (units.embeddings() + units.head, units.largest_block());
            let eval_unit = match (gathers, mixed) {
                (true, _) => c * block_elems.max(units.head_unit()).max(units.embeddings()),
                (false, true) => c * root.max(block_elems),
                (false, false) => 0,
            };
            phases.push(PhaseBytes::new(
                Phase::Evaluation,
                params + optimizer + eval_unit + probe.eval,
                probe.eval,
            ));
        }
        let (peak_phase, rank_peak) = phases
            .iter()
            .map(|p| (p.phase, p.bytes))
            .max_by_key(|&(_, b)| b)
            .expect("a plan has phases");
        // Thread ranks' peaks meet, backward's temporaries included: the collectives keep
        // them in step through backward (ZeRO-3's gathers unit by unit, the buckets'
        // reductions). 4 ranks of ZeRO-3 with checkpointing measured 17-19% above a plan that
        // counted one rank's temporaries at a time (21-24% in bf16-true), and measure 1% above
        // to 3% below this one (9-13% below in bf16-true; ddp 4-8% below): ranks that run apart
        // between collectives miss part of each other's temporaries.
        let process_peak = probe.baseline + ranks_in_process * (probe.task + rank_peak);
        Ok(Self {
            world,
            ranks_in_process,
            params,
            optimizer,
            grads: step_grads,
            compute_copy,
            gathered_unit,
            gathered_kept,
            activations,
            activations_checkpointed,
            buffers,
            step_temporaries,
            probe,
            peak_phase,
            rank_peak,
            process_peak,
            phases,
        })
    }

    /// The process's peak per rank it hosts: what `--memory-budget` holds a rank to.
    pub fn rank_share(&self) -> usize {
        self.process_peak.div_ceil(self.ranks_in_process.max(1))
    }

    /// The plan as a table, printed before the first step.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![
            ("parameters".into(), human_bytes(self.params)),
            ("gradients (at the step)".into(), human_bytes(self.grads)),
            ("optimizer state".into(), human_bytes(self.optimizer)),
            ("16-bit compute copy".into(), human_bytes(self.compute_copy)),
            (
                "largest gathered unit".into(),
                human_bytes(self.gathered_unit),
            ),
            (
                "kept gathered through forward".into(),
                human_bytes(self.gathered_kept),
            ),
            (
                "activations per block".into(),
                format!(
                    "{} ({} checkpointed, {} selectively)",
                    human_bytes(self.probe.block),
                    human_bytes(self.probe.block_output),
                    human_bytes(self.probe.block_output + self.probe.block_tape)
                ),
            ),
            (
                "activations kept by forward".into(),
                format!(
                    "{} ({} checkpointed)",
                    human_bytes(self.activations),
                    human_bytes(self.activations_checkpointed)
                ),
            ),
            ("collective buffers".into(), human_bytes(self.buffers)),
            (
                "optimizer step temporaries".into(),
                human_bytes(self.step_temporaries),
            ),
        ];
        for p in &self.phases {
            rows.push((
                format!("phase {:?}", p.phase),
                format!(
                    "{} (of which {} temporaries)",
                    human_bytes(p.bytes),
                    human_bytes(p.transient)
                ),
            ));
        }
        rows.push((
            "peak per rank".into(),
            format!("{} ({:?})", human_bytes(self.rank_peak), self.peak_phase),
        ));
        rows.push((
            "peak of this process".into(),
            format!(
                "{} ({} rank(s), each with a {} copy of the task, + {} outside the model)",
                human_bytes(self.process_peak),
                self.ranks_in_process,
                human_bytes(self.probe.task),
                human_bytes(self.probe.baseline)
            ),
        ));
        aligned(&rows)
    }
}

fn elems(slots: &[Slot]) -> usize {
    slots.iter().map(Slot::numel).sum()
}

fn shard_elems(slots: &[Slot]) -> usize {
    slots.iter().map(Slot::shard_numel).sum()
}

/// The most the gradients of `slots` (in visit order; `c` bytes an element, the compute dtype)
/// take while the engine moves them one parameter at a time into its (empty) sums (`w` bytes
/// each): cast where the dtypes differ.
fn grads_moved_in(slots: &[Slot], c: usize, w: usize) -> usize {
    let n = elems(slots);
    let (mut done, mut most) = (0, 0);
    for p in slots.iter().map(Slot::numel) {
        let rest = c * (n - done - p);
        // Both dtypes at once while one is cast; the same bytes moved where they agree.
        let moved = if c != w { c * p + w * p } else { w * p };
        most = most.max(rest + w * done + moved);
        done += p;
    }
    most
}

/// Backward's top: through the head and loss (`through_head`), or the top block's backward
/// beside the head's gradients, the head's activations freed (`top_block`), whichever holds
/// more; `block_backward` is the probe's for the way the block runs.
fn backward_top(
    through_head: usize,
    top_block: usize,
    probe: &Probe,
    block_backward: usize,
) -> PhaseBytes {
    match through_head > top_block {
        true => PhaseBytes::new(Phase::BackwardTop, through_head, probe.head_backward),
        false => PhaseBytes::new(Phase::BackwardTop, top_block, block_backward),
    }
}

/// How many of `world`'s ranks are threads of this process (and so share its peak): all of
/// them, or one under mpirun.
pub fn ranks_in_process(world: usize) -> usize {
    match burnscale_collective::launched_by_mpirun() {
        true => 1,
        false => world,
    }
}

/// How far a `planned` peak is from the `measured` one, as a signed fraction of it.
pub fn off(planned: usize, measured: usize) -> f64 {
    planned as f64 / measured.max(1) as f64 - 1.0
}

/// The optimizer state one rank holds in memory: every stepped parameter's (its shard's
/// when `sharded`; none for those at the `unreached` paths), none under `--offload-dir`.
fn optimizer_bytes<M: Module>(
    model: &M,
    args: &TrainArgs,
    units: &Units,
    sharded: bool,
    unreached: &BTreeSet<String>,
) -> usize {
    if args.offload_dir.is_some() {
        return 0;
    }
    let eight_bit = optim::eight_bit_paths(model, args);
    let weight = DType::from(args.precision.param_dtype()).size();
    units
        .slots
        .iter()
        .filter(|slot| !unreached.contains(&slot.path))
        .map(|slot| {
            let held = match sharded {
                true => slot.shard_dims(),
                false => slot.dims.clone(),
            };
            optim::state_bytes_of(args, &held, weight, eight_bit.contains(&slot.path))
        })
        .sum()
}
