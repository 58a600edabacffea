//! A model as wrap policies see it: the repeated blocks, and the root around them (embeddings
//! before, the head and loss after). Sharding and activation checkpointing iterate over
//! this split; nothing model-specific lives in them.

use burn::module::{Module, ParamId, list_param_ids};
use burn::prelude::*;

use crate::flops::{Flops, RootWeights};
use crate::weights::{KeyMap, OwnNames};

/// What blocks read besides the activations: an additive attention bias `[batch, 1, 1, seq]`
/// (0 for keys that may be attended, the dtype's most negative finite value for padding:
/// [`crate::autocast::lowest`]), or `None` when every key is visible.
pub type Mask = Option<Tensor<4>>;

pub trait BlockModel: Module {
    type Block: Module;
    /// What the embeddings read (token ids, pixels).
    type Input: Clone + Send;
    /// What the loss compares against.
    type Target: Clone + Send;
    /// What the head makes of the last block's output: the logits that
    /// [`BlockModel::head_loss`] scores and an evaluation reads.
    type Logits;

    /// Activations entering the first block, and the mask every block applies.
    fn embed(&self, input: Self::Input) -> (Tensor<3>, Mask); // [batch, seq, d_model]
    /// The sequences in `input` and the positions every block runs for each (`[batch, seq]` of
    /// [`BlockModel::embed`]'s output: tokens, or patches and a class token), read from
    /// shapes and configuration.
    fn extent(&self, input: &Self::Input) -> [usize; 2];
    /// What a forward and backward pass costs ([`crate::flops`]), from the whole model's
    /// parameters: asked before they are sharded. Every block's weights run at every
    /// position; outside the blocks, [`BlockModel::root_weights`] says which count and how.
    fn flops(&self) -> Flops {
        let blocks = self.blocks().iter().map(Module::num_params).sum();
        Flops::new(blocks, &self.root_weights(), self.attention_width())
    }
    /// The parameters outside the blocks that [`BlockModel::flops`] counts, each as it runs
    /// (what a frozen one leaves undone).
    fn root_weights(&self) -> Vec<RootWeights>;
    /// The blocks' attention widths summed (layers · d_model; 0 without attention).
    fn attention_width(&self) -> usize;
    /// The keys a query scores, on average, in a sequence of `seq` positions: all of them
    /// unless attention is sparse.
    fn attended_keys(&self, seq: usize) -> f64 {
        seq as f64
    }
    /// Model FLOPs of a forward and backward pass on `input`, with `flops` the whole model's
    /// ([`BlockModel::flops`]); reads shapes and configuration only.
    fn train_flops(&self, flops: &Flops, input: &Self::Input) -> f64 {
        let [batch, seq] = self.extent(input);
        flops.of(batch, seq, self.attended_keys(seq))
    }
    /// One block, run by its model (which may hold what every block shares, as an attention
    /// pattern); the model's own block list may be taken out meanwhile. It may read the
    /// model's configuration but not its parameters: under ZeRO-3 those are shards then. A
    /// block's linears go through [`crate::regather::linear`]: resharded ZeRO-3 drops the
    /// weights that it read after the block's forward, and a graph through anything else keeps
    /// its gathered weights to the end of the block's backward.
    fn block_forward(&self, block: &Self::Block, x: Tensor<3>, mask: &Mask) -> Tensor<3>;
    /// Mean loss of the last block's output against `target`.
    fn head_loss(&self, x: Tensor<3>, target: Self::Target) -> Tensor<1>;
    /// The logits of the last block's output.
    fn logits(&self, x: Tensor<3>) -> Self::Logits;
    /// The items [`BlockModel::head_loss`] averages over in `target` (`[1]`, f32), for a loss
    /// whose batches can count differently (ignored targets: padding, unmasked tokens), so
    /// that a step's loss is the mean over all its items however they fall on ranks and
    /// micro-batches (transformers' `num_items_in_batch`); `None` (the default) when every
    /// batch counts alike. Reads the configuration, not the parameters.
    fn loss_items(&self, _target: &Self::Target) -> Option<Tensor<1>> {
        None
    }

    /// The parameters [`BlockModel::embed`] reads, and those [`BlockModel::head_loss`] reads:
    /// under ZeRO-3 the root is sharded as two units (the embeddings', and the rest), each
    /// gathered only around its use. By default both read the whole root (one unit).
    fn embedding_params(&self) -> Vec<ParamId> {
        self.root_params()
    }
    fn head_params(&self) -> Vec<ParamId> {
        self.root_params()
    }

    /// Every parameter outside the blocks.
    fn root_params(&self) -> Vec<ParamId> {
        let blocks: Vec<ParamId> = self.blocks().iter().flat_map(list_param_ids).collect();
        list_param_ids(self)
            .into_iter()
            .filter(|id| !blocks.contains(id))
            .collect()
    }

    fn blocks(&self) -> &[Self::Block];
    /// Moves the blocks out, leaving the root.
    fn take_blocks(&mut self) -> Vec<Self::Block>;
    fn set_blocks(&mut self, blocks: Vec<Self::Block>);

    /// The plain forward: embeddings, every block, head.
    fn loss(&self, input: Self::Input, target: Self::Target) -> Tensor<1> {
        self.head_loss(self.last_hidden(input), target)
    }

    /// The plain forward to the logits.
    fn logits_of(&self, input: Self::Input) -> Self::Logits {
        self.logits(self.last_hidden(input))
    }

    /// The names and layouts the model is saved under (its checkpoint's, as its loader
    /// reads them back); by default its own parameter paths.
    fn checkpoint_keys(&self) -> Box<dyn KeyMap> {
        Box::new(OwnNames)
    }

    /// The last block's output.
    fn last_hidden(&self, input: Self::Input) -> Tensor<3> {
        let (x, mask) = self.embed(input);
        self.blocks()
            .iter()
            .fold(x, |x, block| self.block_forward(block, x, &mask))
    }
}

/// Implements [`BlockModel`]'s `blocks`, `take_blocks` and `set_blocks` for a model whose
/// blocks are the `Vec` field `$field`.
#[macro_export]
macro_rules! block_list {
    ($field:ident) => {
        fn blocks(&self) -> &[Self::Block] {
            &self.$field
        }

        fn take_blocks(&mut self) -> Vec<Self::Block> {
            std::mem::take(&mut self.$field)
        }

        fn set_blocks(&mut self, blocks: Vec<Self::Block>) {
            self.$field = blocks;
        }
    };
}
