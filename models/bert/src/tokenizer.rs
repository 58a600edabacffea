//! WordPiece tokenization with the `tokenizers` crate, from a `tokenizer.json` or a BERT
//! `vocab.txt`, into padded [`BertInput`] batches.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;
use tokenizers::{Tokenizer, TruncationParams};

use crate::{BertConfig, BertError, BertInput};

pub struct BertTokenizer {
    inner: Tokenizer,
    pad_id: i64,
    /// The file it was read from, which its errors name.
    path: PathBuf,
}

impl BertTokenizer {
    /// A `tokenizer.json` as saved by HF tokenizers, or a `vocab.txt` (one WordPiece per line,
    /// BERT's `[CLS]`/`[SEP]`/`[PAD]`/`[UNK]` among them), lower-cased if `lowercase`.
    pub fn from_file(path: &Path, lowercase: bool) -> Result<Self, BertError> {
        let error = |reason: String| BertError::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        let inner = if path.extension().is_some_and(|e| e == "json") {
            Tokenizer::from_file(path).map_err(|e| error(e.to_string()))?
        } else {
            let vocab = path
                .to_str()
                .ok_or_else(|| error("not a UTF-8 path".into()))?;
            let wordpiece = WordPiece::from_file(vocab)
                .unk_token("[UNK]".into())
                .build()
                .map_err(|e| error(e.to_string()))?;
            let mut tokenizer = Tokenizer::new(wordpiece);
            let id = |token: &str| {
                tokenizer
                    .token_to_id(token)
                    .ok_or_else(|| error(format!("the vocabulary has no {token}")))
            };
            let (cls, sep) = (id("[CLS]")?, id("[SEP]")?);
            tokenizer
                .with_normalizer(Some(BertNormalizer::new(true, true, None, lowercase)))
                .with_pre_tokenizer(Some(BertPreTokenizer))
                .with_post_processor(Some(BertProcessing::new(
                    ("[SEP]".into(), sep),
                    ("[CLS]".into(), cls),
                )));
            tokenizer
        };
        let pad_id = inner
            .token_to_id("[PAD]")
            .ok_or_else(|| error("the vocabulary has no [PAD]".into()))?
            as i64;
        Ok(Self {
            inner,
            pad_id,
            path: path.to_path_buf(),
        })
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// `Ok` if this tokenizer's ids are the model's vocabulary: its size, or padded by fewer
    /// than 64 rows (transformers' `resize_token_embeddings(pad_to_multiple_of=..)`). A
    /// smaller vocabulary by more is another model's (bert-base-cased's 28,996 tokens in
    /// uncased's 30,522 rows would read other rows).
    pub fn check_vocab(&self, config: &BertConfig, path: &Path) -> Result<(), BertError> {
        if (0..64).contains(&config.vocab_size.wrapping_sub(self.vocab_size())) {
            Ok(())
        } else {
            Err(BertError::VocabMismatch {
                path: path.to_path_buf(),
                found: self.vocab_size(),
                expected: config.vocab_size,
            })
        }
    }

    /// Each of `texts` as token ids with `[CLS]`/`[SEP]`, truncated to `max_len` tokens when
    /// given (else whole).
    pub fn ids(&self, texts: &[&str], max_len: Option<usize>) -> Result<Vec<Vec<i64>>, BertError> {
        Ok(self
            .encodings(texts, max_len)?
            .iter()
            .map(|e| e.get_ids().iter().map(|&id| id as i64).collect())
            .collect())
    }

    /// The `[PAD]` token's id.
    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }

    fn encodings(
        &self,
        texts: &[&str],
        max_len: Option<usize>,
    ) -> Result<Vec<tokenizers::Encoding>, BertError> {
        let error = |e: tokenizers::Error| BertError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        let mut tokenizer = self.inner.clone();
        tokenizer
            .with_truncation(max_len.map(|max_length| TruncationParams {
                max_length,
                ..Default::default()
            }))
            .map_err(error)?;
        tokenizer.with_padding(None);
        tokenizer.encode_batch(texts.to_vec(), true).map_err(error)
    }

    /// `texts` with `[CLS]`/`[SEP]`, truncated to `max_len` tokens and padded to the longest.
    pub fn encode(
        &self,
        texts: &[&str],
        max_len: usize,
        device: &Device,
    ) -> Result<BertInput, BertError> {
        let encodings = self.encodings(texts, Some(max_len))?;
        let b = encodings.len();
        let t = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
        let (mut ids, mut types, mut mask) = (
            vec![self.pad_id; b * t],
            vec![0i64; b * t],
            vec![0i64; b * t],
        );
        for (row, e) in encodings.iter().enumerate() {
            for (col, (&id, &ty)) in e.get_ids().iter().zip(e.get_type_ids()).enumerate() {
                ids[row * t + col] = id as i64;
                types[row * t + col] = ty as i64;
                mask[row * t + col] = 1;
            }
        }
        let tensor = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [b, t]), device);
        Ok(BertInput {
            input_ids: tensor(ids),
            token_type_ids: tensor(types),
            attention_mask: tensor(mask),
        })
    }
}
