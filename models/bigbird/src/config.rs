use burnscale_bert::{Activation, BertConfig, BertError, BertHead, Layout};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionType {
    OriginalFull,
    BlockSparse,
}

/// BigBird hyper-parameters: the encoder's (as [`BertConfig`]) and the sparsity pattern.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BigBirdConfig {
    pub encoder: BertConfig,
    pub attention_type: AttentionType,
    pub block_size: usize,
    pub num_random_blocks: usize,
    /// Classes of the classification head; `None` for the bare model.
    pub num_labels: Option<usize>,
}

impl BigBirdConfig {
    pub const PRESETS: [&'static str; 2] = ["bigbird-roberta-base", "tiny"];

    /// `google/bigbird-roberta-base`: 128M parameters (with its pooler).
    pub fn bigbird_roberta_base() -> Self {
        Self {
            encoder: BertConfig {
                vocab_size: 50358,
                max_position_embeddings: 4096,
                hidden_act: Activation::GeluNew,
                ..BertConfig::bert_base()
            },
            attention_type: AttentionType::BlockSparse,
            block_size: 64,
            num_random_blocks: 3,
            num_labels: None,
        }
    }

    /// A two-layer model for tests: block-sparse from 57 tokens on.
    pub fn tiny() -> Self {
        Self {
            encoder: BertConfig {
                max_position_embeddings: 128,
                hidden_act: Activation::GeluNew,
                ..BertConfig::tiny()
            },
            attention_type: AttentionType::BlockSparse,
            block_size: 8,
            num_random_blocks: 1,
            num_labels: None,
        }
    }

    pub fn preset(name: &str) -> Result<Self, BertError> {
        match name.replace('_', "-").as_str() {
            "bigbird-roberta-base" => Ok(Self::bigbird_roberta_base()),
            "tiny" => Ok(Self::tiny()),
            _ => Err(BertError::UnknownPreset(name.to_string())),
        }
    }

    pub fn with_num_labels(self, num_labels: usize) -> Self {
        Self {
            num_labels: Some(num_labels),
            ..self
        }
    }

    /// The encoder's dropout (hidden, attention and classifier: BERT's), `p` for each.
    pub fn with_dropout(self, p: f64) -> Self {
        Self {
            encoder: self.encoder.with_dropout(p),
            ..self
        }
    }

    pub fn with_attention(self, attention_type: AttentionType) -> Self {
        Self {
            attention_type,
            ..self
        }
    }

    /// The shortest sequence that attends block-sparsely; shorter ones attend fully, as HF
    /// switches to `original_full` when `seq_len <= (5 + 2 r) · block_size`.
    pub fn min_sparse_len(&self) -> usize {
        (5 + 2 * self.num_random_blocks) * self.block_size + 1
    }

    pub fn validate(&self) -> Result<(), BertError> {
        self.encoder.validate()?;
        let invalid = |m: &str| Err(BertError::InvalidConfig(m.to_string()));
        if self.encoder.layout != Layout::Bert || self.encoder.head != BertHead::Base {
            return invalid("BigBird's encoder is BERT-layout with no BERT head");
        }
        if self.block_size == 0 {
            return invalid("block_size must be positive");
        }
        if self.num_labels == Some(0) {
            return invalid("a classification head needs at least one label");
        }
        Ok(())
    }

    /// Parameters of the model this config builds.
    pub fn num_params(&self) -> usize {
        let d = self.encoder.hidden_size;
        let head = self.num_labels.map_or(0, |n| d * d + d + d * n + n);
        self.encoder.num_params() + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_size_matches_the_reference() {
        // google/bigbird-roberta-base: 127.5M with its pooler (the "128M" of the model card).
        assert_eq!(
            BigBirdConfig::bigbird_roberta_base().num_params(),
            127_468_800
        );
    }
}
