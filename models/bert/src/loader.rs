//! Hugging Face BERT and DistilBERT safetensors <-> [`Bert`]. Keys may carry the model
//! prefix (`bert.`, `distilbert.`) or not (a bare `BertModel` file, as sentence-transformers
//! ships). `{i}` is the layer index; `Linear` weights are stored `[out, in]` and transposed.
//!
//! | BERT key                                          | DistilBERT key                          | burnscale path |
//! |---------------------------------------------------|-----------------------------------------|----------------|
//! | `embeddings.word_embeddings.weight`               | same                                    | `embeddings.word_embeddings.weight` |
//! | `embeddings.position_embeddings.weight`           | same                                    | `embeddings.position_embeddings.weight` |
//! | `embeddings.token_type_embeddings.weight`         | —                                       | `embeddings.token_type_embeddings.weight` |
//! | `embeddings.LayerNorm.{weight,bias}`              | same                                    | `embeddings.layer_norm.{gamma,beta}` |
//! | `encoder.layer.{i}.attention.self.{query,key,value}.*` | `transformer.layer.{i}.attention.{q,k,v}_lin.*` | `layer.{i}.attention.{query,key,value}.*` |
//! | `encoder.layer.{i}.attention.output.dense.*`      | `transformer.layer.{i}.attention.out_lin.*` | `layer.{i}.attention_output.*` |
//! | `encoder.layer.{i}.attention.output.LayerNorm.*`  | `transformer.layer.{i}.sa_layer_norm.*` | `layer.{i}.attention_norm.*` |
//! | `encoder.layer.{i}.intermediate.dense.*`          | `transformer.layer.{i}.ffn.lin1.*`      | `layer.{i}.intermediate.*` |
//! | `encoder.layer.{i}.output.dense.*`                | `transformer.layer.{i}.ffn.lin2.*`      | `layer.{i}.output.*` |
//! | `encoder.layer.{i}.output.LayerNorm.*`            | `transformer.layer.{i}.output_layer_norm.*` | `layer.{i}.output_norm.*` |
//! | `pooler.dense.*`                                  | —                                       | `pooler.*` |
//! | —                                                 | `pre_classifier.*`                      | `classifier.pre_classifier.*` |
//! | `classifier.*`                                    | `classifier.*`                          | `classifier.classifier.*` |
//! | `cls.predictions.transform.dense.*`               | `vocab_transform.*`                     | `mlm.transform.*` |
//! | `cls.predictions.transform.LayerNorm.*`           | `vocab_layer_norm.*`                    | `mlm.layer_norm.*` |
//! | `cls.predictions.bias`                            | `vocab_projector.bias`                  | `mlm.bias` |
//! | `cls.predictions.decoder.{weight,bias}`, `embeddings.position_ids` | `vocab_projector.weight` | — (tied to the word embeddings / `mlm.bias`; a buffer) |
//! | `cls.seq_relationship.*`                          | —                                       | — (`BertForPreTraining`'s next-sentence head, which no model here has) |
//!
//! With [`Head::Fresh`] the parameters the labels size (`classifier.classifier.*`, and a
//! masked-LM head) are left initialised; DistilBERT's `pre_classifier` loads where the file
//! has it, as transformers keeps it for a new number of labels.
//!
//! LayerNorm parameters named `gamma` and `beta` (bert-base-uncased's file, from the
//! TensorFlow port) are read as `weight` and `bias`, as transformers renames them.

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
pub use burnscale_nn::weights::Head;
use burnscale_nn::weights::{self, KeyMap, KeyTable, Saved, Weight};

use burn::module::Module;
use burnscale_nn::weights::WeightError;

use crate::{Bert, BertConfig, BertError, BertHead, Layout};

/// The word embeddings' parameter path.
const WORD_EMBEDDINGS: &str = "embeddings.word_embeddings.weight";

/// BERT's encoder (embeddings, layers, pooler); BigBird's too.
#[rustfmt::skip]
pub const BERT_ENCODER: KeyTable = KeyTable(&[
    ("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight"),
    ("embeddings.LayerNorm.weight", "embeddings.layer_norm.gamma"),
    ("embeddings.LayerNorm.bias", "embeddings.layer_norm.beta"),
    ("encoder.layer.{i}.attention.self.query.weight", "layer.{i}.attention.query.weight"),
    ("encoder.layer.{i}.attention.self.query.bias", "layer.{i}.attention.query.bias"),
    ("encoder.layer.{i}.attention.self.key.weight", "layer.{i}.attention.key.weight"),
    ("encoder.layer.{i}.attention.self.key.bias", "layer.{i}.attention.key.bias"),
    ("encoder.layer.{i}.attention.self.value.weight", "layer.{i}.attention.value.weight"),
    ("encoder.layer.{i}.attention.self.value.bias", "layer.{i}.attention.value.bias"),
    ("encoder.layer.{i}.attention.output.dense.weight", "layer.{i}.attention_output.weight"),
    ("encoder.layer.{i}.attention.output.dense.bias", "layer.{i}.attention_output.bias"),
    ("encoder.layer.{i}.attention.output.LayerNorm.weight", "layer.{i}.attention_norm.gamma"),
    ("encoder.layer.{i}.attention.output.LayerNorm.bias", "layer.{i}.attention_norm.beta"),
    ("encoder.layer.{i}.intermediate.dense.weight", "layer.{i}.intermediate.weight"),
    ("encoder.layer.{i}.intermediate.dense.bias", "layer.{i}.intermediate.bias"),
    ("encoder.layer.{i}.output.dense.weight", "layer.{i}.output.weight"),
    ("encoder.layer.{i}.output.dense.bias", "layer.{i}.output.bias"),
    ("encoder.layer.{i}.output.LayerNorm.weight", "layer.{i}.output_norm.gamma"),
    ("encoder.layer.{i}.output.LayerNorm.bias", "layer.{i}.output_norm.beta"),
    ("pooler.dense.weight", "pooler.weight"),
    ("pooler.dense.bias", "pooler.bias"),
    ("embeddings.position_ids", ""),
]);

/// BERT's task heads.
#[rustfmt::skip]
pub const BERT_HEADS: KeyTable = KeyTable(&[
    ("classifier.weight", "classifier.classifier.weight"),
    ("classifier.bias", "classifier.classifier.bias"),
    ("cls.predictions.transform.dense.weight", "mlm.transform.weight"),
    ("cls.predictions.transform.dense.bias", "mlm.transform.bias"),
    ("cls.predictions.transform.LayerNorm.weight", "mlm.layer_norm.gamma"),
    ("cls.predictions.transform.LayerNorm.bias", "mlm.layer_norm.beta"),
    ("cls.predictions.bias", "mlm.bias"),
    ("cls.predictions.decoder.weight", ""),
    ("cls.predictions.decoder.bias", ""),
    ("cls.seq_relationship.weight", ""),
    ("cls.seq_relationship.bias", ""),
]);

#[rustfmt::skip]
pub const DISTILBERT: KeyTable = KeyTable(&[
    ("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    ("embeddings.LayerNorm.weight", "embeddings.layer_norm.gamma"),
    ("embeddings.LayerNorm.bias", "embeddings.layer_norm.beta"),
    ("transformer.layer.{i}.attention.q_lin.weight", "layer.{i}.attention.query.weight"),
    ("transformer.layer.{i}.attention.q_lin.bias", "layer.{i}.attention.query.bias"),
    ("transformer.layer.{i}.attention.k_lin.weight", "layer.{i}.attention.key.weight"),
    ("transformer.layer.{i}.attention.k_lin.bias", "layer.{i}.attention.key.bias"),
    ("transformer.layer.{i}.attention.v_lin.weight", "layer.{i}.attention.value.weight"),
    ("transformer.layer.{i}.attention.v_lin.bias", "layer.{i}.attention.value.bias"),
    ("transformer.layer.{i}.attention.out_lin.weight", "layer.{i}.attention_output.weight"),
    ("transformer.layer.{i}.attention.out_lin.bias", "layer.{i}.attention_output.bias"),
    ("transformer.layer.{i}.sa_layer_norm.weight", "layer.{i}.attention_norm.gamma"),
    ("transformer.layer.{i}.sa_layer_norm.bias", "layer.{i}.attention_norm.beta"),
    ("transformer.layer.{i}.ffn.lin1.weight", "layer.{i}.intermediate.weight"),
    ("transformer.layer.{i}.ffn.lin1.bias", "layer.{i}.intermediate.bias"),
    ("transformer.layer.{i}.ffn.lin2.weight", "layer.{i}.output.weight"),
    ("transformer.layer.{i}.ffn.lin2.bias", "layer.{i}.output.bias"),
    ("transformer.layer.{i}.output_layer_norm.weight", "layer.{i}.output_norm.gamma"),
    ("transformer.layer.{i}.output_layer_norm.bias", "layer.{i}.output_norm.beta"),
    ("pre_classifier.weight", "classifier.pre_classifier.weight"),
    ("pre_classifier.bias", "classifier.pre_classifier.bias"),
    ("classifier.weight", "classifier.classifier.weight"),
    ("classifier.bias", "classifier.classifier.bias"),
    ("vocab_transform.weight", "mlm.transform.weight"),
    ("vocab_transform.bias", "mlm.transform.bias"),
    ("vocab_layer_norm.weight", "mlm.layer_norm.gamma"),
    ("vocab_layer_norm.bias", "mlm.layer_norm.beta"),
    ("vocab_projector.bias", "mlm.bias"),
    ("vocab_projector.weight", ""),
]);

/// How an HF encoder checkpoint maps onto a model: its key table, the model prefix its
/// encoder keys may carry, and which parameter paths belong to the task head (those sit
/// beside the prefix, and [`Head::Fresh`] leaves them initialised).
#[derive(Debug, Clone, Copy)]
pub struct Checkpoint {
    /// Tried in order.
    pub tables: &'static [KeyTable],
    pub prefix: &'static str,
    pub heads: &'static [&'static str],
    /// The head's parameters (prefixes) that [`Head::Fresh`] initialises again: those the
    /// labels size. The rest of a head (a d x d dense layer) loads where the file has it, as
    /// transformers keeps what fits a new number of labels.
    pub fresh: &'static [&'static str],
    pub head: Head,
    /// The file key of a decoder tied to the word embeddings, which saving writes out.
    pub tied_decoder: Option<&'static str>,
    /// Parameter paths (prefixes) a file may hold that this model does not have, dropped as
    /// transformers drops them: the pooler of a pretraining file, loaded as a masked LM.
    pub unused: &'static [&'static str],
}

impl Checkpoint {
    fn for_layout(layout: Layout, head: Head) -> Self {
        let (tables, prefix): (&'static [KeyTable], _) = match layout {
            Layout::Bert => (&[BERT_ENCODER, BERT_HEADS], "bert."),
            Layout::DistilBert => (&[DISTILBERT], "distilbert."),
        };
        Self {
            tables,
            prefix,
            heads: &["classifier.", "mlm."],
            fresh: &["classifier.classifier.", "mlm."],
            head,
            tied_decoder: None,
            unused: &[],
        }
    }

    fn is_head(&self, path: &str) -> bool {
        self.heads.iter().any(|h| path.starts_with(h))
    }

    fn is_fresh(&self, path: &str) -> bool {
        self.fresh.iter().any(|h| path.starts_with(h))
    }

    /// Swaps `model`'s parameters for `tensors` (HF keys, read from `file`), checking names
    /// and shapes.
    pub fn load_into<M: Module>(
        &self,
        model: M,
        tensors: Vec<Weight>,
        file: &Path,
        device: &Device,
    ) -> Result<M, WeightError> {
        let mut weights = HashMap::new();
        for w in tensors {
            let bare = current_name(w.key.strip_prefix(self.prefix).unwrap_or(&w.key));
            match self.tables.iter().find_map(|t| t.to_path(&bare)) {
                // Unknown keys stay in the map under their own name, for `apply` to report.
                None => {
                    weights.insert(format!("?{}", w.key), w);
                }
                Some(path) if path.is_empty() => {}
                Some(path) if self.head == Head::Fresh && self.is_fresh(&path) => {}
                Some(path) if self.unused.iter().any(|u| path.starts_with(u)) => {}
                Some(path) => {
                    let w = if is_linear(&path, &w.shape) {
                        w.transposed()
                    } else {
                        w
                    };
                    weights::insert_once(&mut weights, path, w, file)?;
                }
            }
        }
        weights::apply(model, weights, self, file, device)
    }
}

impl KeyMap for Checkpoint {
    fn file_key(&self, path: &str) -> String {
        let key = self
            .tables
            .iter()
            .find_map(|t| t.to_key(path))
            .unwrap_or_else(|| path.to_string());
        // Heads sit beside the model prefix, as in `BertForSequenceClassification`.
        if self.is_head(path) {
            key
        } else {
            format!("{}{key}", self.prefix)
        }
    }

    /// With a fresh head, the head and the pooler: a masked-LM file (`BertForMaskedLM` is built
    /// without a pooler) finetunes as a classifier with a fresh pooler, as transformers does.
    fn may_stay_initialised(&self, path: &str) -> bool {
        self.head == Head::Fresh && (self.is_head(path) || path.starts_with("pooler."))
    }

    fn saved_as(&self, path: &str, dims: &[usize]) -> Vec<Saved> {
        let saved = Saved {
            key: self.file_key(path),
            transposed: is_linear(path, dims),
        };
        match self.tied_decoder {
            Some(decoder) if path == WORD_EMBEDDINGS => vec![
                saved.clone(),
                Saved {
                    key: decoder.to_string(),
                    ..saved
                },
            ],
            _ => vec![saved],
        }
    }

    fn shape_hint(&self, path: &str) -> &'static str {
        match path {
            "embeddings.word_embeddings.weight" | "mlm.bias" => " (another vocabulary size)",
            "embeddings.position_embeddings.weight" => " (another max_position_embeddings)",
            p if self.is_head(p) => {
                " (another number of labels: load with a fresh head to finetune)"
            }
            _ => " (weights for another model size?)",
        }
    }
}

/// Loads an HF BERT/DistilBERT safetensors file into a model built from `config`.
pub fn load(
    path: &Path,
    config: &BertConfig,
    head: Head,
    device: &Device,
) -> Result<Bert, BertError> {
    load_weights(weights::read_safetensors(path)?, path, config, head, device)
}

/// Loads HF-keyed tensors (read from `path`) into a model built from `config`.
pub fn load_weights(
    tensors: Vec<Weight>,
    path: &Path,
    config: &BertConfig,
    head: Head,
    device: &Device,
) -> Result<Bert, BertError> {
    // Only a masked LM loading its head reads the decoder (as the word embeddings).
    if config.head == BertHead::MaskedLm && head == Head::Load {
        check_tied_decoder(&tensors, path)?;
    }
    let model = Bert::new(config, device)?;
    let mut keys = Checkpoint::for_layout(config.layout, head);
    // `BertForMaskedLM` is built without the pooler that pretraining files hold.
    if config.layout == Layout::Bert && !config.has_pooler() {
        keys.unused = &["pooler."];
    }
    Ok(keys.load_into(model, tensors, path, device)?)
}

/// `Ok` unless the file's masked-LM decoder is a matrix of its own (`tie_word_embeddings:
/// false`): the model ties it to the word embeddings, and the key tables drop the decoder.
/// Compared bit for bit (a NaN is the same value twice).
fn check_tied_decoder(tensors: &[Weight], path: &Path) -> Result<(), BertError> {
    let named = |suffix: &str| tensors.iter().find(|w| w.key.ends_with(suffix));
    let Some(embeddings) = named("embeddings.word_embeddings.weight") else {
        return Ok(());
    };
    let bits = |w: &Weight| w.values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for decoder in ["cls.predictions.decoder.weight", "vocab_projector.weight"] {
        if let Some(w) = named(decoder)
            && (w.shape != embeddings.shape || bits(w) != bits(embeddings))
        {
            return Err(BertError::UntiedDecoder {
                path: path.to_path_buf(),
                decoder: w.key.clone(),
            });
        }
    }
    Ok(())
}

/// Writes `model` as an HF safetensors file of its layout (`*ForSequenceClassification`,
/// `*ForMaskedLM` or the base model, by its head), with the tied decoder written out; one
/// parameter at a time.
pub fn save(model: &Bert, path: &Path) -> Result<(), BertError> {
    Ok(weights::save(model, &checkpoint_keys(model), path)?)
}

/// How `model` is saved: its layout's HF names, with the masked-LM decoder (tied to the word
/// embeddings) written out when it has that head.
pub fn checkpoint_keys(model: &Bert) -> Checkpoint {
    let mut keys = Checkpoint::for_layout(model.layout, Head::Load);
    if model.mlm.is_some() {
        keys.tied_decoder = Some(match model.layout {
            Layout::Bert => "cls.predictions.decoder.weight",
            Layout::DistilBert => "vocab_projector.weight",
        });
    }
    keys
}

/// `key` with LayerNorm's `gamma` and `beta` named `weight` and `bias`.
fn current_name(key: &str) -> String {
    for (old, new) in [
        ("LayerNorm.gamma", "LayerNorm.weight"),
        ("LayerNorm.beta", "LayerNorm.bias"),
    ] {
        if let Some(stem) = key.strip_suffix(old) {
            return format!("{stem}{new}");
        }
    }
    key.to_string()
}

/// `nn.Linear` weights, stored `[out, in]` by PyTorch (embeddings are not transposed).
fn is_linear(path: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && path.ends_with(".weight") && !path.starts_with("embeddings.")
}
