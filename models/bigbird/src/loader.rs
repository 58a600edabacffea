//! Hugging Face BigBird safetensors (`BigBirdModel`, `BigBirdForSequenceClassification`) <->
//! [`BigBird`]. The encoder's keys are BERT's (see `burnscale_bert::loader::BERT_ENCODER`,
//! under the `bert.` prefix); the head's:
//!
//! | HF key                  | burnscale path          | note |
//! |-------------------------|-------------------------|------|
//! | `pooler.{weight,bias}`  | `pooler.*`              | a bare `Linear` (BERT's is `pooler.dense`, also read) |
//! | `classifier.dense.*`    | `classifier.dense.*`    | transposed |
//! | `classifier.out_proj.*` | `classifier.out_proj.*` | transposed; with [`Head::Fresh`] left initialised |
//!
//! Since the encoder is BERT's, a BERT checkpoint (all-MiniLM-L6-v2) loads as a BigBird of
//! its size. A pretraining checkpoint's heads (`cls.*`, BERT's names) load with [`Head::Fresh`]
//! only: they are left out.

use std::path::Path;

use burn::prelude::*;
use burnscale_bert::BertError;
pub use burnscale_bert::loader::Head;
use burnscale_bert::loader::{BERT_ENCODER, BERT_HEADS, Checkpoint};
use burnscale_nn::weights::{self, KeyTable, Weight};

use crate::{BigBird, BigBirdConfig};

/// What BigBird names unlike BERT; tried before BERT's table.
#[rustfmt::skip]
pub const BIGBIRD: KeyTable = KeyTable(&[
    ("pooler.weight", "pooler.weight"),
    ("pooler.bias", "pooler.bias"),
    ("classifier.dense.weight", "classifier.dense.weight"),
    ("classifier.dense.bias", "classifier.dense.bias"),
    ("classifier.out_proj.weight", "classifier.out_proj.weight"),
    ("classifier.out_proj.bias", "classifier.out_proj.bias"),
]);

fn checkpoint(head: Head) -> Checkpoint {
    Checkpoint {
        tables: &[BIGBIRD, BERT_ENCODER, BERT_HEADS],
        prefix: "bert.",
        // `mlm.`: the masked-LM head of `BigBirdForPreTraining` files (google/bigbird-roberta-base),
        // which no BigBird here has: left out with a fresh head, as is the one-layer classifier
        // of a `BertForSequenceClassification` file (`classifier.classifier.` by BERT's table).
        heads: &["classifier.", "mlm."],
        fresh: &["classifier.out_proj.", "classifier.classifier.", "mlm."],
        head,
        tied_decoder: None,
        unused: &[],
    }
}

/// Loads an HF BigBird (or BERT-layout) safetensors file into a model built from `config`.
pub fn load(
    path: &Path,
    config: &BigBirdConfig,
    head: Head,
    device: &Device,
) -> Result<BigBird, BertError> {
    load_weights(weights::read_safetensors(path)?, path, config, head, device)
}

/// Loads HF-keyed tensors (read from `path`) into a model built from `config`.
pub fn load_weights(
    tensors: Vec<Weight>,
    path: &Path,
    config: &BigBirdConfig,
    head: Head,
    device: &Device,
) -> Result<BigBird, BertError> {
    let model = BigBird::new(config, device)?;
    Ok(checkpoint(head).load_into(model, tensors, path, device)?)
}

/// Writes `model` as an HF BigBird safetensors file, one parameter at a time.
pub fn save(model: &BigBird, path: &Path) -> Result<(), BertError> {
    Ok(weights::save(model, &checkpoint_keys(), path)?)
}

/// How a BigBird model is saved: HF BigBird's names.
pub fn checkpoint_keys() -> Checkpoint {
    checkpoint(Head::Load)
}
