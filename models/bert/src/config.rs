use std::path::Path;

use burn::prelude::*;
use burn::tensor::activation::gelu;
use serde::{Deserialize, Serialize};

use crate::BertError;

/// Which checkpoint layout (key names, heads, token types) the model follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    Bert,
    DistilBert,
}

/// The feed-forward activation (HF's `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// Exact (erf) GELU: `gelu`.
    Gelu,
    /// The tanh approximation: `gelu_new` (BigBird-RoBERTa, GPT-2).
    GeluNew,
}

impl Activation {
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "gelu" => Some(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Some(Self::GeluNew),
            _ => None,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Gelu => gelu(x),
            Self::GeluNew => burnscale_nn::gelu_tanh(x),
        }
    }
}

/// The head on top of the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BertHead {
    /// `BertModel` (with its pooler) / `DistilBertModel`: hidden states only.
    Base,
    /// `*ForSequenceClassification`: logits from the first (`[CLS]`) token.
    SequenceClassification { num_labels: usize },
    /// `*ForMaskedLM`: vocabulary logits per token, decoder tied to the word embeddings.
    MaskedLm,
}

/// BERT hyper-parameters, named as Hugging Face's `BertConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    pub layout: Layout,
    pub head: BertHead,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    /// 0 for DistilBERT, which has no token types.
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_dropout_prob: f64,
    pub attention_probs_dropout_prob: f64,
    /// Dropout before the classifier: HF's `classifier_dropout`, `hidden_dropout_prob`
    /// unless set (DistilBERT's `seq_classif_dropout`).
    pub classifier_dropout_prob: f64,
}

impl BertConfig {
    pub const PRESETS: [&'static str; 5] = [
        "bert-base",
        "bert-large",
        "distilbert-base",
        "minilm-l6",
        "tiny",
    ];

    fn bert(hidden: usize, layers: usize, heads: usize) -> Self {
        Self {
            layout: Layout::Bert,
            head: BertHead::Base,
            vocab_size: 30522,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: 4 * hidden,
            hidden_act: Activation::Gelu,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            classifier_dropout_prob: 0.1,
        }
    }

    /// `bert-base-uncased`: 110M parameters.
    pub fn bert_base() -> Self {
        Self::bert(768, 12, 12)
    }

    /// `bert-large-uncased`: 335M parameters.
    pub fn bert_large() -> Self {
        Self::bert(1024, 24, 16)
    }

    /// `distilbert-base-uncased`: 66M parameters, DistilBERT's layout and key names.
    pub fn distilbert_base() -> Self {
        Self {
            layout: Layout::DistilBert,
            type_vocab_size: 0,
            classifier_dropout_prob: 0.2,
            ..Self::bert(768, 6, 12)
        }
    }

    /// all-MiniLM-L6-v2 (`nreimers/MiniLM-L6-H384-uncased`): BERT layout, 22.7M parameters.
    pub fn minilm_l6() -> Self {
        Self {
            intermediate_size: 1536,
            ..Self::bert(384, 6, 12)
        }
    }

    /// A two-layer model for tests.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 99,
            max_position_embeddings: 40,
            intermediate_size: 64,
            ..Self::bert(32, 2, 4)
        }
    }

    pub fn preset(name: &str) -> Result<Self, BertError> {
        match name.replace('_', "-").as_str() {
            "bert-base" => Ok(Self::bert_base()),
            "bert-large" => Ok(Self::bert_large()),
            "distilbert-base" => Ok(Self::distilbert_base()),
            "minilm-l6" => Ok(Self::minilm_l6()),
            "tiny" => Ok(Self::tiny()),
            _ => Err(BertError::UnknownPreset(name.to_string())),
        }
    }

    pub fn with_head(self, head: BertHead) -> Self {
        Self { head, ..self }
    }

    pub fn with_dropout(self, p: f64) -> Self {
        Self {
            hidden_dropout_prob: p,
            attention_probs_dropout_prob: p,
            classifier_dropout_prob: p,
            ..self
        }
    }

    /// Reads an HF `config.json` (`model_type` `bert` or `distilbert`).
    pub fn from_hf_json(path: &Path) -> Result<Self, BertError> {
        let error = |reason: String| BertError::ConfigFile {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| error(format!("not JSON: {e}")))?;
        let int = |key: &str| -> Result<usize, BertError> {
            json.get(key)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| error(format!("no integer `{key}`")))
        };
        // A field may be absent (or null, as HF writes unset ones), but not of another type.
        let float = |key: &str, default: f64| -> Result<f64, BertError> {
            match json.get(key) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| error(format!("`{key}` is {v}, not a number"))),
            }
        };
        let act = |key: &str| -> Result<Activation, BertError> {
            match json.get(key).and_then(|v| v.as_str()) {
                None => Ok(Activation::Gelu),
                Some(name) => Activation::from_hf(name).ok_or_else(|| {
                    error(format!("{key} `{name}` is not supported (gelu, gelu_new)"))
                }),
            }
        };
        let config = match json.get("model_type").and_then(|v| v.as_str()) {
            Some("bert") => Self {
                vocab_size: int("vocab_size")?,
                hidden_size: int("hidden_size")?,
                num_hidden_layers: int("num_hidden_layers")?,
                num_attention_heads: int("num_attention_heads")?,
                intermediate_size: int("intermediate_size")?,
                hidden_act: act("hidden_act")?,
                max_position_embeddings: int("max_position_embeddings")?,
                type_vocab_size: int("type_vocab_size")?,
                layer_norm_eps: float("layer_norm_eps", 1e-12)?,
                hidden_dropout_prob: float("hidden_dropout_prob", 0.1)?,
                attention_probs_dropout_prob: float("attention_probs_dropout_prob", 0.1)?,
                // HF's BertForSequenceClassification: hidden_dropout_prob unless set.
                classifier_dropout_prob: float(
                    "classifier_dropout",
                    float("hidden_dropout_prob", 0.1)?,
                )?,
                ..Self::bert_base()
            },
            Some("distilbert") => Self {
                vocab_size: int("vocab_size")?,
                hidden_size: int("dim")?,
                num_hidden_layers: int("n_layers")?,
                num_attention_heads: int("n_heads")?,
                intermediate_size: int("hidden_dim")?,
                hidden_act: act("activation")?,
                max_position_embeddings: int("max_position_embeddings")?,
                hidden_dropout_prob: float("dropout", 0.1)?,
                attention_probs_dropout_prob: float("attention_dropout", 0.1)?,
                classifier_dropout_prob: float("seq_classif_dropout", 0.2)?,
                ..Self::distilbert_base()
            },
            other => {
                return Err(error(format!(
                    "model_type {other:?} is not bert or distilbert"
                )));
            }
        };
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), BertError> {
        use burnscale_nn::config::{
            check_heads, check_layer_norm_eps, check_positive, check_probabilities,
        };
        check_positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ])
        .and_then(|()| {
            check_heads(
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
            )
        })
        .and_then(|()| {
            check_probabilities(&[
                ("hidden_dropout_prob", self.hidden_dropout_prob),
                (
                    "attention_probs_dropout_prob",
                    self.attention_probs_dropout_prob,
                ),
                ("classifier_dropout_prob", self.classifier_dropout_prob),
            ])
        })
        .and_then(|()| check_layer_norm_eps(self.layer_norm_eps))
        .and_then(|()| match (self.layout, self.head) {
            (Layout::DistilBert, _) if self.type_vocab_size != 0 => {
                Err("DistilBERT has no token types: type_vocab_size must be 0".into())
            }
            (_, BertHead::SequenceClassification { num_labels: 0 }) => {
                Err("a classification head needs at least one label".into())
            }
            _ => Ok(()),
        })
        .map_err(BertError::InvalidConfig)
    }

    /// BERT's pooler exists except under a masked-LM head (as HF's `BertForMaskedLM`).
    pub fn has_pooler(&self) -> bool {
        self.layout == Layout::Bert && self.head != BertHead::MaskedLm
    }

    /// Parameters of the model this config builds (what `Module::num_params` counts).
    pub fn num_params(&self) -> usize {
        let (d, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * d + 2 * d;
        let layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d;
        let pooler = if self.has_pooler() { d * d + d } else { 0 };
        let head = match (self.head, self.layout) {
            (BertHead::Base, _) => 0,
            (BertHead::SequenceClassification { num_labels }, Layout::Bert) => {
                d * num_labels + num_labels
            }
            (BertHead::SequenceClassification { num_labels }, Layout::DistilBert) => {
                d * d + d + d * num_labels + num_labels
            }
            // Transform, layer norm and the output bias; the decoder is the word embeddings.
            (BertHead::MaskedLm, _) => d * d + d + 2 * d + v,
        };
        embeddings + self.num_hidden_layers * layer + pooler + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_sizes_match_the_references() {
        assert_eq!(BertConfig::bert_base().num_params(), 109_482_240);
        assert_eq!(BertConfig::bert_large().num_params(), 335_141_888);
        assert_eq!(BertConfig::distilbert_base().num_params(), 66_362_880);
        assert_eq!(BertConfig::minilm_l6().num_params(), 22_713_216);
    }

    #[test]
    fn bad_configs_are_named() {
        let heads = BertConfig {
            num_attention_heads: 5,
            ..BertConfig::tiny()
        };
        assert!(
            heads
                .validate()
                .unwrap_err()
                .to_string()
                .contains("divisible")
        );
        assert!(BertConfig::preset("roberta").is_err());
        let eps = BertConfig {
            layer_norm_eps: f64::NAN,
            ..BertConfig::tiny()
        };
        let err = eps.validate().unwrap_err().to_string();
        assert!(err.contains("layer_norm_eps"), "{err}");
    }

    #[test]
    fn a_config_json_field_of_another_type_is_an_error() {
        let path = std::env::temp_dir().join(format!("burnscale-bert-{}.json", std::process::id()));
        let json = |extra: &str| {
            format!(
                r#"{{"model_type": "bert", "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 40,
                "type_vocab_size": 2, "classifier_dropout": null{extra}}}"#
            )
        };
        let read = |extra: &str| {
            std::fs::write(&path, json(extra)).unwrap();
            BertConfig::from_hf_json(&path).map_err(|e| e.to_string())
        };
        assert_eq!(read("").unwrap().layer_norm_eps, 1e-12);
        let err = read(r#", "hidden_dropout_prob": "0.1""#).unwrap_err();
        assert!(
            err.contains("`hidden_dropout_prob` is \"0.1\", not a number"),
            "{err}"
        );
        let err = read(r#", "num_hidden_layers": 2.5"#).unwrap_err();
        assert!(err.contains("num_hidden_layers"), "{err}");
        assert_eq!(read("").unwrap().classifier_dropout_prob, 0.1);
        let set = read(r#", "classifier_dropout": 0.3"#).unwrap();
        assert_eq!(set.classifier_dropout_prob, 0.3);
        std::fs::remove_file(&path).unwrap();
    }
}
