use std::path::PathBuf;

use burnscale_nn::weights::WeightError;

/// Everything that can go wrong building a BERT, loading its weights or tokenizer, or
/// feeding it a batch.
#[derive(Debug, thiserror::Error)]
pub enum BertError {
    #[error("invalid BERT config: {0}")]
    InvalidConfig(String),
    #[error("unknown BERT preset `{0}`; choose one of: {presets}", presets = crate::BertConfig::PRESETS.join(", "))]
    UnknownPreset(String),
    #[error("{path}: {reason}")]
    ConfigFile { path: PathBuf, reason: String },
    #[error(
        "a sequence of {len} tokens is longer than the position table ({max} positions); truncate it"
    )]
    SequenceTooLong { len: usize, max: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { id: i64, vocab: usize },
    #[error("an empty sequence: every sequence needs at least one token")]
    EmptySequence,
    #[error("token type {id} is outside the model's {types} token types (type_vocab_size)")]
    TokenTypeOutOfRange { id: i64, types: usize },
    #[error(
        "the batch's {what} is {found:?} and its input_ids {expected:?}: they must have one shape"
    )]
    InputShape {
        what: &'static str,
        found: [usize; 2],
        expected: [usize; 2],
    },
    #[error("cannot read the batch's ids back from the device to check them: {0}")]
    InputRead(String),
    #[error("{path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error(
        "{path} has {found} tokens but the model's vocabulary {expected} (the same, or padded by fewer than 64): a tokenizer for another model?"
    )]
    VocabMismatch {
        path: PathBuf,
        found: usize,
        expected: usize,
    },
    #[error(
        "{path}: `{decoder}` is not the word embeddings: this model's masked-LM head reads the word embeddings (tied, as BERT's and DistilBERT's are), so an untied decoder would be dropped"
    )]
    UntiedDecoder { path: PathBuf, decoder: String },
    #[error(transparent)]
    Weights(#[from] WeightError),
}
