//! Data parallelism and ZeRO sharding, applied to a [`BlockModel`] from outside: the model
//! code knows nothing of it.
//!
//! | strategy | parameters | gradients | optimizer state | collectives per step |
//! |---|---|---|---|---|
//! | `ddp` | full | full, all-reduced | full | all-reduce |
//! | `zero1` | full | full, reduce-scattered on the last micro-step | this rank's shard | reduce-scatter, all-gather |
//! | `zero2` | full | this rank's shard (after the reduce-scatter) | this rank's shard | reduce-scatter every micro-step (per unit, as its backward ends, when checkpointing), all-gather |
//! | `zero3` (FSDP) | this rank's shard | this rank's shard | this rank's shard | all-gather per unit (forward and backward), reduce-scatter per unit every micro-step |
//!
//! DDP, ZeRO-1 and ZeRO-2 move 2Ψ bytes a step (an all-reduce counts twice, ZeRO-1/2's
//! all-gather of the updated parameters leaves out frozen ones), ZeRO-3 up to 3Ψ (each unit
//! gathered for forward and again for backward; a token table tied to the decoder a third
//! time, for the head: BERT-base's masked LM moves about 3.2Ψ), the ZeRO paper's volumes;
//! accumulating,
//! ZeRO-2 and ZeRO-3 reduce-scatter (and ZeRO-3 gathers) on every micro-step. The runner
//! reports them (`burnscale_collective::Counted`).
//!
//! Shards are per parameter along dim 0 ([`layout`]). ZeRO-3's units are the model's blocks
//! plus two root units (the embeddings', and the head's): a unit's full parameters exist only
//! while it runs (resharded after forward, its linears' weights; the small rest, biases and
//! norms' gains, stays with its graph until its backward; not resharded, all of them from its
//! forward to the end of its backward), and its full gradients until its reduce-scatter, on
//! every micro-step (so too
//! under ZeRO-2 with checkpointing, whose backward also runs block by block; a decoder tied to
//! the token table leaves the table's whole gradient until the embeddings' reduce-scatter,
//! the last). Burn's autodiff graph keeps every weight a forward used alive until backward, so
//! the blocks' linears run through [`burnscale_nn::regather`] when resharded after forward: a
//! block's graph keeps its activations, not its weights, and backward stages the weights
//! gathered again for the linears' backward, as FSDP does (nothing recomputed; the embeddings,
//! a lookup, run again). With [`Sharding::reshard_after_forward`] off each unit stays
//! gathered, with its graph, from its forward to the end of its backward.
//!
//! [`BlockModel`]: burnscale_nn::BlockModel

mod engine;
pub mod host;
pub mod layout;
pub mod params;
mod share;
mod step_grads;

pub use engine::{BUCKET_ELEMS, Sharded, StepOutcome};
pub use share::Share;
pub use step_grads::StepGrads;

use burnscale_collective::CollectiveError;

/// How the model states are split over the ranks (see the table above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Ddp,
    Zero1,
    Zero2,
    Zero3,
}

impl Strategy {
    /// What the strategy shards over the ranks: ZeRO's stages as data, one flag per model
    /// state; sharded parameters are resharded after forward, as FSDP2's default.
    pub const fn sharding(self) -> Sharding {
        let (optimizer_state, gradients, parameters) = match self {
            Strategy::Ddp => (false, false, false),
            Strategy::Zero1 => (true, false, false),
            Strategy::Zero2 => (true, true, false),
            Strategy::Zero3 => (true, true, true),
        };
        Sharding {
            optimizer_state,
            gradients,
            parameters,
            reshard_after_forward: parameters,
        }
    }
}

/// Which blocks keep only their input in forward and are recomputed in backward (per-block
/// activation checkpointing); the others keep their graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpointing {
    #[default]
    None,
    /// Every block.
    All,
    /// The lowest `n` blocks (Megatron's `--recompute-method block --recompute-num-layers
    /// n`): a memory between none and all, each block above recomputing nothing.
    Lowest(usize),
}

impl Checkpointing {
    /// How many blocks, from the lowest, of a model of `depth` blocks are checkpointed; `n`
    /// above `depth` is an error.
    pub fn blocks(self, depth: usize) -> Result<usize, ShardError> {
        match self {
            Checkpointing::None => Ok(0),
            Checkpointing::All => Ok(depth),
            Checkpointing::Lowest(n) if n <= depth => Ok(n),
            Checkpointing::Lowest(n) => Err(ShardError::CheckpointedBlocks { n, depth }),
        }
    }
}

/// What a checkpointed block keeps of its forward for its re-run in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckpointMode {
    /// Its input alone: backward runs its whole forward again.
    #[default]
    Full,
    /// Its input and its linear layers' outputs ([`burnscale_nn::selective`]: selective
    /// checkpointing by op): backward runs all but their products again.
    Selective,
}

/// Which model states each rank keeps only its shard of. Optimizer state is sharded whenever
/// gradients are, and gradients whenever parameters are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// Each rank steps only its shard of the parameters (ZeRO-1).
    pub optimizer_state: bool,
    /// Gradients are reduce-scattered and each rank keeps only its shards' (ZeRO-2): unit by
    /// unit as backward leaves each when the blocks are checkpointed or the parameters
    /// sharded, else in buckets after the whole backward.
    pub gradients: bool,
    /// Each rank holds only its parameter shards between uses; a unit is gathered for its
    /// forward and again for its backward, or once for both ([`Sharding::reshard_after_forward`])
    /// (ZeRO-3, FSDP).
    pub parameters: bool,
    /// With sharded parameters: each unit's gathered parameters are dropped after its
    /// forward and gathered again for its backward (the blocks keep their graphs without
    /// their weights: [`burnscale_nn::regather`]), FSDP2's default. When false, a unit
    /// gathered for forward stays gathered, with its graph, until its backward ends: one
    /// all-gather per unit a micro-step (a head tied to the token table reads the embeddings'
    /// kept copy), for the whole model's parameters held during forward and backward (FSDP2's
    /// `reshard_after_forward=False`, FSDP1's `SHARD_GRAD_OP`).
    pub reshard_after_forward: bool,
}

impl Sharding {
    /// This sharding as it acts on a rank of `world`, computing in a dtype of its own when
    /// `cast` (the mixed policies), its shards on the host between uses when `offloaded`. A
    /// unit it gathers is a copy of its shards when gathered from other ranks, cast, or moved
    /// from the host; else (a rank alone, computing in its parameters' dtype on the device
    /// they live on) it computes with its shards as they are, its whole parameters: there is
    /// nothing to gather or to drop after forward. Such a rank acts as a replica: one graph
    /// for the whole model, as a plain step has, its gradients and optimizer state still its
    /// shards (whole too).
    pub const fn acting_on(self, world: usize, cast: bool, offloaded: bool) -> Self {
        match world > 1 || cast || offloaded {
            true => self,
            false => Sharding {
                parameters: false,
                reshard_after_forward: false,
                ..self
            },
        }
    }

    /// Whether sharded parameters are dropped after each unit's forward, so that backward
    /// gathers them again (for the blocks' linears, or to recompute the embeddings).
    pub const fn reshards(self) -> bool {
        self.parameters && self.reshard_after_forward
    }

    /// Whether sharded parameters stay gathered from a unit's forward to its backward.
    pub const fn keeps_gathered(self) -> bool {
        self.parameters && !self.reshard_after_forward
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("rank {rank}: the ranks' models differ: {detail}")]
    ModelMismatch { rank: usize, detail: String },
    /// An option for sharded parameters (zero3) on a strategy that keeps them whole.
    #[error("{0}, but this strategy keeps whole parameters")]
    NotSharded(&'static str),
    /// A model whose every parameter is frozen (`require_grad` false).
    #[error(
        "every parameter of the model is frozen (require_grad false): there is nothing to train"
    )]
    AllFrozen,
    /// [`Sharded::step`] while a micro-step's gradients wait for their reduction.
    #[error(
        "step called with gradients not yet reduced over the ranks: an optimizer step's last micro-step must pass last = true (and none may follow it)"
    )]
    UnreducedGradients,
    /// [`Sharded::micro_step`] given [`Share::Even`]`(0)`: a share of 1/0.
    #[error(
        "Share::Even(0): an optimizer step of no micro-batches gives each an infinite share of its loss; give the step's number of micro-batches"
    )]
    NoMicroBatches,
    /// [`Sharded::set_held_parameters`] given a value it cannot hold.
    #[error("cannot set the held parameters: {0}")]
    HeldValues(String),
    #[error("{n} blocks to checkpoint, but the model has {depth}")]
    CheckpointedBlocks { n: usize, depth: usize },
    #[error(transparent)]
    Precision(#[from] burnscale_precision::PrecisionError),
    #[error(
        "`{second}` is the same parameter as `{first}` (tied weights): the engine shards, reduces and steps a parameter once for each place it appears, which would lose part of its gradient and untie it after one step; give each place a parameter of its own"
    )]
    SharedParameter { first: String, second: String },
    #[error(
        "`{path}` has no elements (shape {dims:?}): the engine splits parameters by rows and cannot hold an empty one; leave it out of the model (an `Option`) or give it a size"
    )]
    EmptyParameter { path: String, dims: Vec<usize> },
}
