use burn::module::{Param, ParamId, list_param_ids};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Initializer, Linear};
use burn::prelude::*;
use burn::tensor::activation::gelu;
use burnscale_nn::autocast;
use burnscale_nn::init::{INITIALIZER_RANGE, linear, normal};
use burnscale_nn::{
    BlockModel, Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Mask, RootWeights, attention,
    regather,
};

use crate::{VitConfig, VitError};

/// Patches, class token and position embeddings: the input of the first block.
#[derive(Module, Debug)]
pub struct Embeddings {
    pub cls_token: Param<Tensor<3>>,           // [1, 1, d]
    pub position_embeddings: Param<Tensor<3>>, // [1, 1 + grid², d]
    /// A `patch_size` convolution with stride `patch_size`: one linear map per patch.
    pub projection: Conv2d,
    dropout: Dropout,
}

impl Embeddings {
    fn new(config: &VitConfig, device: &Device) -> Self {
        let d = config.hidden_size;
        let p = config.patch_size;
        let normal = normal(INITIALIZER_RANGE);
        let mut projection = Conv2dConfig::new([config.num_channels, d], [p, p])
            .with_stride([p, p])
            .with_initializer(normal.clone())
            .init(device);
        projection.bias = Some(Initializer::Zeros.init([d], device));
        Self {
            cls_token: normal.init([1, 1, d], device),
            position_embeddings: normal.init([1, config.seq_len(), d], device),
            projection,
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
        }
    }

    pub fn forward(&self, pixels: Tensor<4>) -> Tensor<3> {
        let pixels = autocast::like(pixels, &self.projection.weight.val());
        let patches = self.projection.forward(pixels); // [b, d, grid, grid]
        let [b, d, gh, gw] = patches.dims();
        let patches = patches.reshape([b, d, gh * gw]).swap_dims(1, 2); // [b, grid², d]
        let cls = self.cls_token.val().expand([b, 1, d]);
        let x = Tensor::cat(vec![cls, patches], 1); // [b, 1 + grid², d]
        self.dropout.forward(x + self.position_embeddings.val())
    }
}

/// Multi-head self-attention with separate q/k/v projections, as HF `ViTSelfAttention`.
#[derive(Module, Debug)]
pub struct Attention {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    /// HF's `attention.output.dense`.
    pub output: Linear,
    attn_dropout: Dropout,
    dropout: Dropout,
    num_heads: usize,
}

impl Attention {
    fn new(config: &VitConfig, device: &Device) -> Self {
        let d = config.hidden_size;
        Self {
            query: linear(d, d, INITIALIZER_RANGE, device),
            key: linear(d, d, INITIALIZER_RANGE, device),
            value: linear(d, d, INITIALIZER_RANGE, device),
            output: linear(d, d, INITIALIZER_RANGE, device),
            attn_dropout: DropoutConfig::new(config.attention_probs_dropout_prob).init(),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
            num_heads: config.num_attention_heads,
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let hd = d / self.num_heads;
        let heads = |x: Tensor<3>| x.reshape([b, t, self.num_heads, hd]).swap_dims(1, 2);
        let q = heads(regather::linear(&self.query, x.clone())) * (1.0 / (hd as f64).sqrt()); // [b, nh, t, hd]
        let k = heads(regather::linear(&self.key, x.clone()));
        let v = heads(regather::linear(&self.value, x));
        let y = attention(q, k, v, None, &self.attn_dropout); // [b, nh, t, hd]
        let y = y.swap_dims(1, 2).reshape([b, t, d]);
        self.dropout.forward(regather::linear(&self.output, y))
    }
}

/// One pre-LN encoder layer: the unit that sharding and checkpointing wrap.
#[derive(Module, Debug)]
pub struct Layer {
    pub layernorm_before: LayerNorm,
    pub attention: Attention,
    pub layernorm_after: LayerNorm,
    /// HF's `intermediate.dense`.
    pub intermediate: Linear,
    /// HF's `output.dense`.
    pub output: Linear,
    dropout: Dropout,
}

impl Layer {
    fn new(config: &VitConfig, device: &Device) -> Self {
        let (d, f) = (config.hidden_size, config.intermediate_size);
        Self {
            layernorm_before: layer_norm(config, device),
            attention: Attention::new(config, device),
            layernorm_after: layer_norm(config, device),
            intermediate: linear(d, f, INITIALIZER_RANGE, device),
            output: linear(f, d, INITIALIZER_RANGE, device),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone()
            + self
                .attention
                .forward(autocast::layer_norm(&self.layernorm_before, x));
        let h = gelu(regather::linear(
            &self.intermediate,
            autocast::layer_norm(&self.layernorm_after, x.clone()),
        )); // [b, t, f]
        x + self.dropout.forward(regather::linear(&self.output, h))
    }
}

/// ViT with a classification head on the class token.
#[derive(Module, Debug)]
pub struct Vit {
    pub embeddings: Embeddings,
    pub layer: Vec<Layer>,
    pub layernorm: LayerNorm,
    pub classifier: Linear,
    num_channels: usize,
    image_size: usize,
}

impl Vit {
    /// A freshly initialised model (HF's `_init_weights`: N(0, 0.02) weights, zero biases).
    pub fn new(config: &VitConfig, device: &Device) -> Result<Self, VitError> {
        config.validate()?;
        Ok(Self {
            embeddings: Embeddings::new(config, device),
            layer: (0..config.num_hidden_layers)
                .map(|_| Layer::new(config, device))
                .collect(),
            layernorm: layer_norm(config, device),
            classifier: linear(
                config.hidden_size,
                config.num_labels,
                INITIALIZER_RANGE,
                device,
            ),
            num_channels: config.num_channels,
            image_size: config.image_size,
        })
    }

    /// `Ok` if `dims` is a batch of images this model takes.
    pub fn check_images(&self, dims: [usize; 4]) -> Result<(), VitError> {
        let [_, c, h, w] = dims;
        if c == self.num_channels && h == self.image_size && w == self.image_size {
            Ok(())
        } else {
            Err(VitError::ImageShape {
                found: dims.to_vec(),
                channels: self.num_channels,
                size: self.image_size,
            })
        }
    }

    /// The last hidden state after the final layer norm (HF `ViTModel`'s `last_hidden_state`).
    pub fn features(&self, pixels: Tensor<4>) -> Tensor<3> {
        autocast::layer_norm(&self.layernorm, self.encode(pixels)) // [b, 1 + grid², d]
    }

    /// Class logits.
    pub fn forward(&self, pixels: Tensor<4>) -> Tensor<2> {
        self.head(self.encode(pixels)) // [b, labels]
    }

    /// Embeddings, then every layer.
    fn encode(&self, pixels: Tensor<4>) -> Tensor<3> {
        self.layer
            .iter()
            .fold(self.embed(pixels), |x, layer| layer.forward(x))
    }

    /// Patch, class and position embeddings. Panics on images of another shape; data
    /// loaders check with [`Vit::check_images`] first.
    pub fn embed(&self, pixels: Tensor<4>) -> Tensor<3> {
        if let Err(e) = self.check_images(pixels.dims()) {
            panic!("{e}");
        }
        self.embeddings.forward(pixels)
    }

    /// Logits from the last layer's output: the class token after the final layer norm.
    pub fn head(&self, x: Tensor<3>) -> Tensor<2> {
        let [b, _, d] = x.dims();
        let cls = autocast::layer_norm(&self.layernorm, x.narrow(1, 0, 1)).reshape([b, d]); // [b, d]
        self.classifier.forward(cls) // [b, labels]
    }
}

fn layer_norm(config: &VitConfig, device: &Device) -> LayerNorm {
    LayerNormConfig::new(config.hidden_size)
        .with_epsilon(config.layer_norm_eps)
        .init(device)
}

impl BlockModel for Vit {
    type Block = Layer;
    type Input = Tensor<4>;
    type Target = Tensor<1, Int>;
    type Logits = Tensor<2>;

    /// Every patch is visible.
    fn embed(&self, pixels: Tensor<4>) -> (Tensor<3>, Mask) {
        (Vit::embed(self, pixels), None)
    }

    /// Each image's patches and its class token.
    fn extent(&self, pixels: &Tensor<4>) -> [usize; 2] {
        let [b, _, h, w] = pixels.dims();
        let [ph, pw] = self.embeddings.projection.stride;
        [b, 1 + (h / ph) * (w / pw)]
    }

    /// The patch projection counts at the class token too (one position in 197 at 224 px);
    /// the head reads the class token alone.
    fn root_weights(&self) -> Vec<RootWeights> {
        [
            RootWeights::of(&self.embeddings.projection, true),
            RootWeights::of(&self.layernorm, false),
            RootWeights::of(&self.classifier, false),
        ]
        .concat()
    }

    fn attention_width(&self) -> usize {
        self.layer.len() * self.embeddings.cls_token.lazy_shape()[2]
    }

    fn block_forward(&self, layer: &Layer, x: Tensor<3>, _mask: &Mask) -> Tensor<3> {
        layer.forward(x)
    }

    fn head_loss(&self, x: Tensor<3>, labels: Tensor<1, Int>) -> Tensor<1> {
        burnscale_nn::cross_entropy(self.head(x), labels)
    }

    fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        Vit::head(self, x)
    }

    fn embedding_params(&self) -> Vec<ParamId> {
        list_param_ids(&self.embeddings)
    }

    fn head_params(&self) -> Vec<ParamId> {
        [
            list_param_ids(&self.layernorm),
            list_param_ids(&self.classifier),
        ]
        .concat()
    }

    burnscale_nn::block_list!(layer);

    fn checkpoint_keys(&self) -> Box<dyn burnscale_nn::weights::KeyMap> {
        Box::new(crate::loader::VitKeys {
            head: crate::loader::Head::Load,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HF's `_init_weights`: the patch projection as every linear layer, N(0, 0.02) weights
    /// and a zero bias (Burn's convolution default is Kaiming-uniform, std 0.14 here).
    #[test]
    fn the_patch_projection_starts_as_hf_initialises_it() {
        let device = Device::default();
        let vit = Vit::new(&VitConfig::tiny(), &device).unwrap();
        let projection = &vit.embeddings.projection;
        let bias = projection.bias.as_ref().expect("a bias").val();
        assert!(bias.equal_elem(0.0).all().into_scalar::<bool>());
        let weight = projection.weight.val(); // [32, 3, 8, 8]: 6144 draws
        let std = weight.reshape([-1]).var(0).sqrt().into_scalar::<f32>();
        assert!((0.018..0.022).contains(&std), "std {std}");
    }
}
