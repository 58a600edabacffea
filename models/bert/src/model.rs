use burn::module::{Param, ParamId, list_param_ids};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear};
use burn::prelude::*;
use burn::tensor::activation::relu;
use burnscale_nn::autocast;
use burnscale_nn::init::{INITIALIZER_RANGE, linear, normal};
use burnscale_nn::{
    BlockModel, Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Mask, RootWeights, attention,
    device_cache, regather,
};

use crate::{Activation, BertConfig, BertError, BertHead, Layout};

/// A padded batch of token sequences.
#[derive(Debug, Clone)]
pub struct BertInput {
    pub input_ids: Tensor<2, Int>,      // [batch, seq]
    pub token_type_ids: Tensor<2, Int>, // [batch, seq]
    /// 1 for tokens, 0 for padding.
    pub attention_mask: Tensor<2, Int>, // [batch, seq]
}

/// Word, position and token-type embeddings, summed, layer-normed and dropped out (BigBird's:
/// dropped out, then layer-normed).
#[derive(Module, Debug)]
pub struct Embeddings {
    pub word_embeddings: Embedding,
    pub position_embeddings: Embedding,
    /// Absent in DistilBERT.
    pub token_type_embeddings: Option<Embedding>,
    pub layer_norm: LayerNorm,
    dropout: Dropout,
    #[module(skip)]
    dropout_before_norm: bool,
}

impl Embeddings {
    pub fn new(config: &BertConfig, device: &Device) -> Self {
        let embedding = |n, d| {
            EmbeddingConfig::new(n, d)
                .with_initializer(normal(INITIALIZER_RANGE))
                .init(device)
        };
        let d = config.hidden_size;
        Self {
            word_embeddings: embedding(config.vocab_size, d),
            position_embeddings: embedding(config.max_position_embeddings, d),
            token_type_embeddings: (config.type_vocab_size > 0)
                .then(|| embedding(config.type_vocab_size, d)),
            layer_norm: layer_norm(config, device),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
            dropout_before_norm: false,
        }
    }

    /// HF's `BigBirdEmbeddings`, which drop out the sum before the layer norm.
    pub fn bigbird(config: &BertConfig, device: &Device) -> Self {
        Self {
            dropout_before_norm: true,
            ..Self::new(config, device)
        }
    }

    /// `Ok` if a sequence of these token ids fits the position table and the vocabulary:
    /// for data on the host, checked once where it is loaded (the runner's `TrainTask::check`).
    /// Reads shapes only, so a lazily initialised model stays uninitialised.
    pub fn check_ids(&self, ids: &[i64]) -> Result<(), BertError> {
        self.check_len(ids.len())?;
        let [vocab, _] = self.word_embeddings.weight.lazy_shape().dims();
        match ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
            Some(&id) => Err(BertError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// [`Embeddings::check_ids`] for a batch already on the device (reads its ids and token
    /// types back), and the token types and the mask in the ids' shape.
    pub fn check_input(&self, input: &BertInput) -> Result<(), BertError> {
        let expected = input.input_ids.dims();
        for (what, found) in [
            ("token_type_ids", input.token_type_ids.dims()),
            ("attention_mask", input.attention_mask.dims()),
        ] {
            if found != expected {
                return Err(BertError::InputShape {
                    what,
                    found,
                    expected,
                });
            }
        }
        // A read that fails is said (empty ids would pass every check).
        let host = |ids: &Tensor<2, Int>| -> Result<Vec<i64>, BertError> {
            ids.try_to_vec_as()
                .map_err(|e| BertError::InputRead(e.to_string()))
        };
        let t = expected[1];
        self.check_len(t)?;
        host(&input.input_ids)?
            .chunks(t)
            .try_for_each(|row| self.check_ids(row))?;
        // DistilBERT has no token types and reads none.
        let Some(types) = &self.token_type_embeddings else {
            return Ok(());
        };
        let [types, _] = types.weight.lazy_shape().dims();
        match host(&input.token_type_ids)?
            .into_iter()
            .find(|&id| id < 0 || id as usize >= types)
        {
            Some(id) => Err(BertError::TokenTypeOutOfRange { id, types }),
            None => Ok(()),
        }
    }

    fn check_len(&self, len: usize) -> Result<(), BertError> {
        let [max, _] = self.position_embeddings.weight.lazy_shape().dims();
        match len {
            0 => Err(BertError::EmptySequence),
            len if len > max => Err(BertError::SequenceTooLong { len, max }),
            _ => Ok(()),
        }
    }

    /// The embeddings and the padding mask every layer applies. Panics on a batch longer than
    /// the position table. Token ids are not checked here, which would read them back from
    /// the device at every forward: check them where they are made ([`Embeddings::check_ids`]).
    pub fn embed(&self, input: BertInput) -> (Tensor<3>, Mask) {
        let [_, t] = input.input_ids.dims();
        if let Err(e) = self.check_len(t) {
            panic!("{e}");
        }
        let x = self.forward(input.input_ids, input.token_type_ids);
        let [b, t] = input.attention_mask.dims();
        // HF's extended attention mask: the dtype's minimum where a key is padding.
        let padding = input
            .attention_mask
            .equal_elem(0)
            .float()
            .reshape([b, 1, 1, t]);
        let bias = padding * autocast::lowest(&x);
        (x.clone(), Some(autocast::like(bias, &x)))
    }

    pub fn forward(&self, input_ids: Tensor<2, Int>, token_type_ids: Tensor<2, Int>) -> Tensor<3> {
        let [_, t] = input_ids.dims();
        let positions = device_cache::positions(t, &input_ids.device()); // [1, t]
        let mut x =
            self.word_embeddings.forward(input_ids) + self.position_embeddings.forward(positions); // [b, t, d]
        if let Some(types) = &self.token_type_embeddings {
            x = x + types.forward(token_type_ids);
        }
        match self.dropout_before_norm {
            true => autocast::layer_norm(&self.layer_norm, self.dropout.forward(x)),
            false => self
                .dropout
                .forward(autocast::layer_norm(&self.layer_norm, x)),
        }
    }
}

/// Multi-head self-attention over unpadded keys.
#[derive(Module, Debug)]
pub struct SelfAttention {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    dropout: Dropout,
    num_heads: usize,
}

impl SelfAttention {
    fn new(config: &BertConfig, device: &Device) -> Self {
        let d = config.hidden_size;
        Self {
            query: linear(d, d, INITIALIZER_RANGE, device),
            key: linear(d, d, INITIALIZER_RANGE, device),
            value: linear(d, d, INITIALIZER_RANGE, device),
            dropout: DropoutConfig::new(config.attention_probs_dropout_prob).init(),
            num_heads: config.num_attention_heads,
        }
    }

    /// Projects to heads, lets `kernel` attend, and merges the heads back.
    pub fn forward(&self, x: Tensor<3>, mask: &Mask, kernel: Kernel) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let hd = d / self.num_heads;
        let heads = |x: Tensor<3>| x.reshape([b, t, self.num_heads, hd]).swap_dims(1, 2);
        let q = heads(regather::linear(&self.query, x.clone())) * (1.0 / (hd as f64).sqrt()); // [b, nh, t, hd]
        let k = heads(regather::linear(&self.key, x.clone()));
        let v = heads(regather::linear(&self.value, x));
        let y = kernel(q, k, v, mask, &self.dropout); // [b, nh, t, hd]
        y.swap_dims(1, 2).reshape([b, t, d])
    }
}

/// How attention combines scaled queries, keys and values (`[b, heads, t, head_dim]`) under a
/// padding mask, with the attention-probability dropout. BERT attends to every key
/// ([`full_attention`]); BigBird plugs in its block-sparse pattern.
pub type Kernel<'a> = &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>, &Mask, &Dropout) -> Tensor<4>;

/// Softmax attention over every unpadded key.
pub fn full_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &Mask,
    dropout: &Dropout,
) -> Tensor<4> {
    attention(q, k, v, mask.clone(), dropout) // [b, nh, t, hd]
}

/// One post-LN encoder layer: the unit that sharding and checkpointing wrap.
#[derive(Module, Debug)]
pub struct Layer {
    pub attention: SelfAttention,
    pub attention_output: Linear,
    pub attention_norm: LayerNorm,
    pub intermediate: Linear,
    pub output: Linear,
    pub output_norm: LayerNorm,
    dropout: Dropout,
    /// BERT drops out the attention output before its residual sum; DistilBERT does not.
    #[module(skip)]
    attention_output_dropout: bool,
    #[module(skip)]
    activation: Activation,
}

impl Layer {
    pub fn new(config: &BertConfig, device: &Device) -> Self {
        let (d, f) = (config.hidden_size, config.intermediate_size);
        Self {
            attention: SelfAttention::new(config, device),
            attention_output: linear(d, d, INITIALIZER_RANGE, device),
            attention_norm: layer_norm(config, device),
            intermediate: linear(d, f, INITIALIZER_RANGE, device),
            output: linear(f, d, INITIALIZER_RANGE, device),
            output_norm: layer_norm(config, device),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
            attention_output_dropout: config.layout == Layout::Bert,
            activation: config.hidden_act,
        }
    }

    pub fn forward(&self, x: Tensor<3>, mask: &Mask, kernel: Kernel) -> Tensor<3> {
        let a = regather::linear(
            &self.attention_output,
            self.attention.forward(x.clone(), mask, kernel),
        );
        let a = match self.attention_output_dropout {
            true => self.dropout.forward(a),
            false => a,
        };
        let x = autocast::layer_norm(&self.attention_norm, x + a);
        let h = self
            .activation
            .forward(regather::linear(&self.intermediate, x.clone())); // [b, t, f]
        autocast::layer_norm(
            &self.output_norm,
            x + self.dropout.forward(regather::linear(&self.output, h)),
        )
    }
}

/// Sequence classification from the first token: BERT through its pooler, DistilBERT
/// through `pre_classifier` and a ReLU.
#[derive(Module, Debug)]
pub struct Classifier {
    pub pre_classifier: Option<Linear>,
    pub classifier: Linear,
    dropout: Dropout,
}

/// Masked-LM logits: transform, GELU, layer norm, then the word embeddings (tied) plus a bias.
#[derive(Module, Debug)]
pub struct MaskedLmHead {
    pub transform: Linear,
    pub layer_norm: LayerNorm,
    pub bias: Param<Tensor<1>>, // [vocab]
    #[module(skip)]
    activation: Activation,
}

#[derive(Module, Debug)]
pub struct Bert {
    pub embeddings: Embeddings,
    pub layer: Vec<Layer>,
    /// BERT's `[CLS]` dense + tanh; absent in DistilBERT.
    pub pooler: Option<Linear>,
    pub classifier: Option<Classifier>,
    pub mlm: Option<MaskedLmHead>,
    /// Whose checkpoint names and heads the model follows (for saving).
    #[module(skip)]
    pub layout: Layout,
}

impl Bert {
    /// A freshly initialised model (HF's `_init_weights`: N(0, 0.02), zero biases).
    pub fn new(config: &BertConfig, device: &Device) -> Result<Self, BertError> {
        config.validate()?;
        let d = config.hidden_size;
        let classifier = match config.head {
            BertHead::SequenceClassification { num_labels } => Some(Classifier {
                pre_classifier: (config.layout == Layout::DistilBert)
                    .then(|| linear(d, d, INITIALIZER_RANGE, device)),
                classifier: linear(d, num_labels, INITIALIZER_RANGE, device),
                dropout: DropoutConfig::new(config.classifier_dropout_prob).init(),
            }),
            _ => None,
        };
        let mlm = (config.head == BertHead::MaskedLm).then(|| MaskedLmHead {
            transform: linear(d, d, INITIALIZER_RANGE, device),
            layer_norm: layer_norm(config, device),
            bias: Initializer::Zeros.init([config.vocab_size], device),
            activation: config.hidden_act,
        });
        Ok(Self {
            embeddings: Embeddings::new(config, device),
            layer: (0..config.num_hidden_layers)
                .map(|_| Layer::new(config, device))
                .collect(),
            pooler: config
                .has_pooler()
                .then(|| linear(d, d, INITIALIZER_RANGE, device)),
            classifier,
            mlm,
            layout: config.layout,
        })
    }

    /// `Ok` if the batch fits the position table and the vocabulary.
    pub fn check_input(&self, input: &BertInput) -> Result<(), BertError> {
        self.embeddings.check_input(input)
    }

    /// The last hidden state (HF's `last_hidden_state`).
    pub fn hidden_states(&self, input: BertInput) -> Tensor<3> {
        let (x, mask) = self.embed(input);
        self.layer
            .iter()
            .fold(x, |x, layer| layer.forward(x, &mask, &full_attention)) // [b, t, d]
    }

    /// BERT's pooled `[CLS]` representation (HF's `pooler_output`); `None` for DistilBERT.
    pub fn pooled(&self, hidden: Tensor<3>) -> Option<Tensor<2>> {
        let pooler = self.pooler.as_ref()?;
        Some(pooler.forward(first_token(hidden)).tanh()) // [b, d]
    }

    /// Head logits: `[b, labels]` for classification, `[b·t, vocab]` for masked LM, and the
    /// hidden states `[b·t, d]` for a base model.
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<2> {
        let [b, t, d] = hidden.dims();
        if let Some(head) = &self.classifier {
            let x = match (&head.pre_classifier, self.pooled(hidden.clone())) {
                (Some(pre), _) => relu(pre.forward(first_token(hidden))),
                (None, Some(pooled)) => pooled,
                (None, None) => first_token(hidden),
            };
            return head.classifier.forward(head.dropout.forward(x)); // [b, labels]
        }
        let x = hidden.reshape([b * t, d]);
        match &self.mlm {
            Some(head) => {
                let h = autocast::layer_norm(
                    &head.layer_norm,
                    head.activation.forward(head.transform.forward(x)),
                );
                let words = self.embeddings.word_embeddings.weight.val(); // [vocab, d]
                h.matmul(words.transpose()) + head.bias.val().unsqueeze() // [b·t, vocab]
            }
            None => x,
        }
    }

    /// Embeddings and the padding mask, as every layer reads them.
    pub fn embed(&self, input: BertInput) -> (Tensor<3>, Mask) {
        self.embeddings.embed(input)
    }
}

pub fn first_token(hidden: Tensor<3>) -> Tensor<2> {
    let [b, _, d] = hidden.dims();
    hidden.narrow(1, 0, 1).reshape([b, d])
}

fn layer_norm(config: &BertConfig, device: &Device) -> LayerNorm {
    LayerNormConfig::new(config.hidden_size)
        .with_epsilon(config.layer_norm_eps)
        .init(device)
}

impl BlockModel for Bert {
    type Block = Layer;
    type Input = BertInput;
    /// Class ids `[b]` for classification; token ids `[b·t]` for masked LM, -1 where a
    /// position is not predicted.
    type Target = Tensor<1, Int>;
    type Logits = Tensor<2>;

    fn embed(&self, input: BertInput) -> (Tensor<3>, Mask) {
        Bert::embed(self, input)
    }

    /// Padding included: every block runs it.
    fn extent(&self, input: &BertInput) -> [usize; 2] {
        input.input_ids.dims()
    }

    /// A classifier (and BERT's pooler) reads the first position; the masked-LM head every
    /// position, through the word embeddings as its decoder.
    fn root_weights(&self) -> Vec<RootWeights> {
        let mut root = [
            RootWeights::of(&self.pooler, false),
            RootWeights::of(&self.classifier, false),
            RootWeights::of(&self.mlm, true),
        ]
        .concat();
        if self.mlm.is_some() {
            root.extend(RootWeights::of(&self.embeddings.word_embeddings, true));
        }
        root
    }

    fn attention_width(&self) -> usize {
        self.layer.len() * self.embeddings.word_embeddings.weight.lazy_shape()[1]
    }

    fn block_forward(&self, layer: &Layer, x: Tensor<3>, mask: &Mask) -> Tensor<3> {
        layer.forward(x, mask, &full_attention)
    }

    fn head_loss(&self, x: Tensor<3>, target: Tensor<1, Int>) -> Tensor<1> {
        assert!(
            self.classifier.is_some() || self.mlm.is_some(),
            "a base BERT has no head to train: build it with a classification or masked-LM head"
        );
        burnscale_nn::cross_entropy(self.logits(x), target)
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        Bert::logits(self, x)
    }

    /// Masked LM scores only the masked positions (the others' targets are -1); a classifier
    /// scores every sequence.
    fn loss_items(&self, target: &Tensor<1, Int>) -> Option<Tensor<1>> {
        self.mlm
            .as_ref()
            .map(|_| burnscale_nn::scored_items(target.clone()))
    }

    fn embedding_params(&self) -> Vec<ParamId> {
        list_param_ids(&self.embeddings)
    }

    /// The masked-LM decoder reads the word embeddings too.
    fn head_params(&self) -> Vec<ParamId> {
        let mut ids = [
            list_param_ids(&self.pooler),
            list_param_ids(&self.classifier),
            list_param_ids(&self.mlm),
        ]
        .concat();
        if self.mlm.is_some() {
            ids.extend(list_param_ids(&self.embeddings.word_embeddings));
        }
        ids
    }

    burnscale_nn::block_list!(layer);

    fn checkpoint_keys(&self) -> Box<dyn burnscale_nn::weights::KeyMap> {
        Box::new(crate::loader::checkpoint_keys(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burnscale_nn::dropout;

    /// A training layer draws one mask for the attention probabilities and one per residual
    /// branch it drops out: HF's `BertLayer` both, DistilBERT's `TransformerBlock` only the
    /// feed-forward's.
    #[test]
    fn distilbert_adds_its_attention_output_undropped() {
        let device = Device::default().autodiff();
        let draws = |layout| {
            let config = BertConfig {
                layout,
                ..BertConfig::tiny()
            };
            let layer = Layer::new(&config, &device);
            let x = Tensor::<3>::ones([1, 4, config.hidden_size], &device);
            let before = dropout::position();
            let _ = layer.forward(x, &None, &full_attention);
            dropout::position().1 - before.1
        };
        assert_eq!(draws(Layout::Bert), 3);
        assert_eq!(draws(Layout::DistilBert), 2);
    }

    /// Masked LM's loss scores the masked positions only, which a step's mean must count; a
    /// classifier's every sequence alike.
    #[test]
    fn masked_lm_counts_the_masked_positions() {
        let device = Device::default();
        let target = Tensor::<1, Int>::from_ints([-1, 7, -1, -1, 3, 0], &device);
        let model = |head| Bert::new(&BertConfig::tiny().with_head(head), &device).unwrap();
        let items = model(BertHead::MaskedLm)
            .loss_items(&target)
            .map(|n| n.into_scalar::<f32>());
        assert_eq!(items, Some(3.0));
        assert!(
            model(BertHead::SequenceClassification { num_labels: 2 })
                .loss_items(&target)
                .is_none()
        );
    }
}
