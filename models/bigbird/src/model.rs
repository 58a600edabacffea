use burn::module::{ParamId, list_param_ids};
use burn::nn::Linear;
use burn::prelude::*;
use burnscale_bert::{BertInput, Embeddings, Layer, first_token, full_attention};
use burnscale_nn::init::{INITIALIZER_RANGE, linear};
use burnscale_nn::{BlockModel, Dropout, DropoutConfig, Mask, RootWeights};

use crate::attention::block_sparse;
use crate::{AttentionType, BigBirdConfig};

/// HF's `BigBirdClassificationHead`: the first token through dense, activation, out_proj.
#[derive(Module, Debug)]
pub struct ClassificationHead {
    pub dense: Linear,
    pub out_proj: Linear,
    dropout: Dropout,
}

#[derive(Module, Debug)]
pub struct BigBird {
    pub embeddings: Embeddings,
    pub layer: Vec<Layer>,
    /// HF's `BigBirdModel` pooler (dense + tanh on the first token); the classification head
    /// does not read it, but checkpoints carry it.
    pub pooler: Linear,
    pub classifier: Option<ClassificationHead>,
    #[module(skip)]
    config: BigBirdConfig,
}

impl BigBird {
    pub fn new(config: &BigBirdConfig, device: &Device) -> Result<Self, burnscale_bert::BertError> {
        config.validate()?;
        let enc = &config.encoder;
        let d = enc.hidden_size;
        Ok(Self {
            embeddings: Embeddings::bigbird(enc, device),
            layer: (0..enc.num_hidden_layers)
                .map(|_| Layer::new(enc, device))
                .collect(),
            pooler: linear(d, d, INITIALIZER_RANGE, device),
            classifier: config.num_labels.map(|n| ClassificationHead {
                dense: linear(d, d, INITIALIZER_RANGE, device),
                out_proj: linear(d, n, INITIALIZER_RANGE, device),
                dropout: DropoutConfig::new(enc.classifier_dropout_prob).init(),
            }),
            config: *config,
        })
    }

    pub fn config(&self) -> &BigBirdConfig {
        &self.config
    }

    /// Whether a sequence of `len` tokens attends block-sparsely (else fully, as HF).
    pub fn is_sparse(&self, len: usize) -> bool {
        self.config.attention_type == AttentionType::BlockSparse
            && len >= self.config.min_sparse_len()
    }

    /// `Ok` if the batch fits the position table and the vocabulary.
    pub fn check_input(&self, input: &BertInput) -> Result<(), burnscale_bert::BertError> {
        self.embeddings.check_input(input)
    }

    /// The last hidden state (HF's `last_hidden_state`).
    pub fn hidden_states(&self, input: BertInput) -> Tensor<3> {
        let (x, mask) = self.embeddings.embed(input);
        self.layer
            .iter()
            .fold(x, |x, layer| self.block_forward(layer, x, &mask)) // [b, t, d]
    }

    /// Class logits `[b, labels]`. Panics without a classification head.
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<2> {
        let head = self
            .classifier
            .as_ref()
            .expect("a bare BigBird has no classification head: build it with num_labels");
        let x = head.dropout.forward(first_token(hidden));
        let x = self
            .config
            .encoder
            .hidden_act
            .forward(head.dense.forward(x));
        head.out_proj.forward(head.dropout.forward(x))
    }
}

impl BlockModel for BigBird {
    type Block = Layer;
    type Input = BertInput;
    /// Class ids `[b]`.
    type Target = Tensor<1, Int>;
    type Logits = Tensor<2>;

    fn embed(&self, input: BertInput) -> (Tensor<3>, Mask) {
        self.embeddings.embed(input)
    }

    /// Padding included: every block runs it.
    fn extent(&self, input: &BertInput) -> [usize; 2] {
        input.input_ids.dims()
    }

    /// The classification head reads the first position; the pooler is not read.
    fn root_weights(&self) -> Vec<RootWeights> {
        RootWeights::of(&self.classifier, false)
    }

    fn attention_width(&self) -> usize {
        self.layer.len() * self.config.encoder.hidden_size
    }

    /// Block-sparse, as [`block_sparse`] computes it over the sequence padded to whole
    /// blocks: the two global query blocks score every key block, each other query block
    /// `5 + r` gathered ones (blocks 1 and n-2, with one block fewer in the table, one of
    /// them masked).
    fn attended_keys(&self, seq: usize) -> f64 {
        if !self.is_sparse(seq) {
            return seq as f64;
        }
        let (block, random) = (self.config.block_size, self.config.num_random_blocks);
        let n = seq.div_ceil(block);
        let key_blocks = 2 * n + (n - 2) * (5 + random);
        (block * block * key_blocks) as f64 / seq as f64
    }

    fn block_forward(&self, layer: &Layer, x: Tensor<3>, mask: &Mask) -> Tensor<3> {
        let [_, t, _] = x.dims();
        if !self.is_sparse(t) {
            return layer.forward(x, mask, &full_attention);
        }
        let (block, random) = (self.config.block_size, self.config.num_random_blocks);
        let sparse =
            move |q, k, v, m: &Mask, d: &Dropout| block_sparse(q, k, v, m, d, block, random);
        layer.forward(x, mask, &sparse)
    }

    fn head_loss(&self, x: Tensor<3>, target: Tensor<1, Int>) -> Tensor<1> {
        burnscale_nn::cross_entropy(self.logits(x), target)
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        BigBird::logits(self, x)
    }

    fn embedding_params(&self) -> Vec<ParamId> {
        list_param_ids(&self.embeddings)
    }

    fn head_params(&self) -> Vec<ParamId> {
        [
            list_param_ids(&self.pooler),
            list_param_ids(&self.classifier),
        ]
        .concat()
    }

    burnscale_nn::block_list!(layer);

    fn checkpoint_keys(&self) -> Box<dyn burnscale_nn::weights::KeyMap> {
        Box::new(crate::loader::checkpoint_keys())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HF's `BigBirdEmbeddings` drop out before the layer norm (BERT's after it): with a fresh
    /// norm (gain 1, bias 0) every element comes out normalised, none a dropped zero.
    #[test]
    fn embeddings_drop_out_before_the_norm() {
        let device = Device::default().autodiff();
        let mut config = BigBirdConfig::tiny();
        config.encoder.hidden_dropout_prob = 0.5;
        let ids = Tensor::<2, Int>::from_data([[1i64, 2, 3, 4]], &device);
        let zeros = |embeddings: &Embeddings| {
            let x = embeddings.forward(ids.clone(), ids.zeros_like());
            x.equal_elem(0.0).int().sum().into_scalar::<i64>()
        };
        let bigbird = BigBird::new(&config, &device).unwrap();
        assert_eq!(zeros(&bigbird.embeddings), 0);
        assert!(zeros(&Embeddings::new(&config.encoder, &device)) > 0);
    }

    /// bigbird-roberta-base (blocks of 64, 3 random) at 4096 tokens, 64 blocks: 2 query
    /// blocks score all 64 key blocks, the 62 others the 8 they gather (3 window, 2 global,
    /// 3 random), so a query scores 624 keys on average; a sequence too short for
    /// block-sparse attention scores all of its own.
    #[test]
    fn queries_score_the_key_blocks_they_gather() {
        let config = BigBirdConfig::bigbird_roberta_base();
        let model = BigBird::new(&config, &Device::default()).unwrap(); // lazy: nothing drawn
        let key_blocks = 2 * 64 + 62 * 8;
        assert_eq!(
            model.attended_keys(4096),
            (64 * 64 * key_blocks / 4096) as f64
        );
        let short = config.min_sparse_len() - 1;
        assert_eq!(model.attended_keys(short), short as f64);
    }
}
