//! Hugging Face ViT safetensors (`ViTForImageClassification` / `ViTModel`) <-> [`Vit`].
//!
//! | HF key                                                   | burnscale path                        | note |
//! |----------------------------------------------------------|---------------------------------------|------|
//! | `vit.embeddings.cls_token`                               | `embeddings.cls_token`                | `[1, 1, d]` |
//! | `vit.embeddings.position_embeddings`                     | `embeddings.position_embeddings`      | resampled bicubically when the file's grid differs |
//! | `vit.embeddings.patch_embeddings.projection.weight/bias` | `embeddings.projection.weight/bias`   | conv `[d, c, p, p]`, same layout |
//! | `vit.encoder.layer.{i}.layernorm_before.weight/bias`     | `layer.{i}.layernorm_before.gamma/beta` | |
//! | `vit.encoder.layer.{i}.attention.attention.{query,key,value}.*` | `layer.{i}.attention.{query,key,value}.*` | `nn.Linear` weights transposed |
//! | `vit.encoder.layer.{i}.attention.output.dense.*`         | `layer.{i}.attention.output.*`        | transposed |
//! | `vit.encoder.layer.{i}.layernorm_after.weight/bias`      | `layer.{i}.layernorm_after.gamma/beta` | |
//! | `vit.encoder.layer.{i}.intermediate.dense.*`             | `layer.{i}.intermediate.*`            | transposed |
//! | `vit.encoder.layer.{i}.output.dense.*`                   | `layer.{i}.output.*`                  | transposed |
//! | `vit.layernorm.weight/bias`                              | `layernorm.gamma/beta`                | |
//! | `classifier.weight/bias`                                 | `classifier.weight/bias`              | transposed; with [`Head::Fresh`] ignored and left initialised |
//! | `vit.pooler.dense.*`                                     | —                                     | `ViTModel`'s pooler, unused by classification: skipped |
//!
//! transformers 5's in-memory names (`vit.layers.{i}.attention.{q,k,v,o}_proj`, `.mlp.fc1/fc2`)
//! are read as the rows above; saving writes the checkpoint names of the table.

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
pub use burnscale_nn::weights::Head;
use burnscale_nn::weights::{self, KeyMap, Saved, Weight};

use crate::{Vit, VitConfig, VitError};

/// Prefix renames (HF, burnscale) at the top level and inside an encoder layer; the longest
/// matching prefix wins, in either direction.
const TOP_RENAMES: [(&str, &str); 1] = [(
    "embeddings.patch_embeddings.projection.",
    "embeddings.projection.",
)];
const LAYER_RENAMES: [(&str, &str); 4] = [
    ("attention.attention.", "attention."),
    ("attention.output.dense.", "attention.output."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
];
/// transformers 5 names the same weights differently in memory (`vit.layers.{i}...`); files it
/// loaded and saved may carry these names, so they are read too. Saving writes the names above.
const LAYER_RENAMES_V5: [(&str, &str); 6] = [
    ("attention.q_proj.", "attention.query."),
    ("attention.k_proj.", "attention.key."),
    ("attention.v_proj.", "attention.value."),
    ("attention.o_proj.", "attention.output."),
    ("mlp.fc1.", "intermediate."),
    ("mlp.fc2.", "output."),
];

const POSITIONS: &str = "embeddings.position_embeddings";
const CLASSIFIER: &str = "classifier.";

/// `name` with its longest prefix among `table`'s `from` sides replaced by the `to` side.
fn rename(name: &str, table: &[(&str, &str)], forward: bool) -> String {
    table
        .iter()
        .map(|&(hf, burn)| if forward { (hf, burn) } else { (burn, hf) })
        .filter(|(from, _)| name.starts_with(from))
        .max_by_key(|(from, _)| from.len())
        .map(|(from, to)| format!("{to}{}", &name[from.len()..]))
        .unwrap_or_else(|| name.to_string())
}

/// `(layer prefix, rest)` of a name inside encoder layer `i`.
fn split_layer<'a>(name: &'a str, prefix: &str) -> Option<(&'a str, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let (index, rest) = rest.split_once('.')?;
    index.parse::<usize>().ok()?;
    Some((&name[..prefix.len() + index.len() + 1], rest))
}

/// The burnscale path of an HF key, or `None` for a weight classification does not use.
fn hf_to_burn(key: &str) -> Option<String> {
    if key.starts_with("vit.pooler.") || key.starts_with("pooler.") {
        return None;
    }
    let key = key.strip_prefix("vit.").unwrap_or(key);
    let path = match split_layer(key, "encoder.layer.") {
        Some((layer, rest)) => format!(
            "{}{}",
            layer.replacen("encoder.", "", 1),
            rename(rest, &LAYER_RENAMES, true)
        ),
        None => match split_layer(key, "layers.") {
            Some((layer, rest)) => format!(
                "{}{}",
                layer.replacen("layers.", "layer.", 1),
                rename(rest, &LAYER_RENAMES_V5, true)
            ),
            None => rename(key, &TOP_RENAMES, true),
        },
    };
    Some(weights::layer_norm_from_torch(&path, is_layer_norm))
}

/// The HF key of a burnscale parameter path.
pub fn burn_to_hf(path: &str) -> String {
    let path = weights::layer_norm_to_torch(path);
    if path.starts_with(CLASSIFIER) {
        return path;
    }
    match split_layer(&path, "layer.") {
        Some((layer, rest)) => {
            format!("vit.encoder.{layer}{}", rename(rest, &LAYER_RENAMES, false))
        }
        None => format!("vit.{}", rename(&path, &TOP_RENAMES, false)),
    }
}

fn is_layer_norm(module: &str) -> bool {
    module.ends_with("layernorm")
        || module.ends_with("layernorm_before")
        || module.ends_with("layernorm_after")
}

/// `nn.Linear` weights, stored `[out, in]` by PyTorch and `[in, out]` by Burn.
fn is_linear_weight(path: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && path.ends_with(".weight")
}

/// HF ViT's names and layouts (`nn.Linear` weights stored transposed).
#[derive(Debug, Clone, Copy)]
pub struct VitKeys {
    pub head: Head,
}

impl KeyMap for VitKeys {
    fn file_key(&self, path: &str) -> String {
        burn_to_hf(path)
    }

    fn saved_as(&self, path: &str, dims: &[usize]) -> Vec<Saved> {
        vec![Saved {
            key: burn_to_hf(path),
            transposed: is_linear_weight(path, dims),
        }]
    }

    fn may_stay_initialised(&self, path: &str) -> bool {
        self.head == Head::Fresh && path.starts_with(CLASSIFIER)
    }

    fn shape_hint(&self, path: &str) -> &'static str {
        if path.starts_with(CLASSIFIER) {
            " (another number of classes: load with a fresh head to finetune)"
        } else if path.starts_with("embeddings.projection") {
            " (another patch size or channel count)"
        } else {
            " (weights for another ViT size?)"
        }
    }
}

/// Loads an HF ViT safetensors file into a model built from `config`.
pub fn load(path: &Path, config: &VitConfig, head: Head, device: &Device) -> Result<Vit, VitError> {
    load_weights(weights::read_safetensors(path)?, path, config, head, device)
}

/// Loads HF-ViT-keyed tensors (read from `file`) into a model built from `config`.
pub fn load_weights(
    tensors: Vec<Weight>,
    file: &Path,
    config: &VitConfig,
    head: Head,
    device: &Device,
) -> Result<Vit, VitError> {
    let model = Vit::new(config, device)?;
    let mut weights = HashMap::new();
    for w in tensors {
        let Some(path) = hf_to_burn(&w.key) else {
            continue;
        };
        if head == Head::Fresh && path.starts_with(CLASSIFIER) {
            continue;
        }
        let w = if is_linear_weight(&path, &w.shape) {
            w.transposed()
        } else if path == POSITIONS {
            resample_positions(w, config, device)
        } else {
            w
        };
        weights::insert_once(&mut weights, path, w, file)?;
    }
    Ok(weights::apply(
        model,
        weights,
        &VitKeys { head },
        file,
        device,
    )?)
}

/// Writes `model` as an HF `ViTForImageClassification` safetensors file.
pub fn save(model: &Vit, path: &Path) -> Result<(), VitError> {
    Ok(weights::save(model, &VitKeys { head: Head::Load }, path)?)
}

/// Position embeddings for another grid, resampled bicubically (PyTorch's `bicubic`,
/// `align_corners=False`, as HF's `interpolate_pos_encoding` and timm do); the class token's
/// position is kept. Other shapes pass through, for [`weights::apply`] to report.
pub fn resample_positions(w: Weight, config: &VitConfig, device: &Device) -> Weight {
    let [1, n, d] = w.shape[..] else {
        return w;
    };
    if n < 2 {
        return w;
    }
    let from = ((n - 1) as f64).sqrt().round() as usize;
    let to = config.grid();
    if from * from + 1 != n || from == to || d != config.hidden_size {
        return w;
    }
    let all = Tensor::<3>::from_data(TensorData::new(w.values, w.shape), device);
    let cls = all.clone().narrow(1, 0, 1); // [1, 1, d]
    let grid = all
        .narrow(1, 1, n - 1)
        .reshape([1, from, from, d])
        .permute([0, 3, 1, 2]); // [1, d, from, from]
    let options = InterpolateOptions::new(InterpolateMode::Bicubic)
        .with_align_corners(false)
        .with_output_size([to, to]);
    let grid = interpolate(grid, options)
        .permute([0, 2, 3, 1])
        .reshape([1, to * to, d]);
    let resampled = Tensor::cat(vec![cls, grid], 1);
    Weight {
        key: w.key,
        dtype: w.dtype,
        shape: vec![1, to * to + 1, d],
        values: resampled
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("an f32 tensor converts to f32"),
    }
}

/// transformers' `ViTImageProcessor` defaults (`IMAGENET_STANDARD_MEAN` and `_STD`).
pub const HF_MEAN_STD: ([f32; 3], [f32; 3]) = ([0.5; 3], [0.5; 3]);

/// The per-channel mean and std `weights`' images are normalised with: those a burnscale run
/// recorded beside them ([`weights::config_path`], written by `vit_finetune --save` and
/// `consolidate`), else those of the `preprocessor_config.json` beside them (an HF model
/// directory's), else `ViTImageProcessor`'s defaults ([`HF_MEAN_STD`], google/vit-*'s).
pub fn image_normalization(weights: &Path) -> Result<([f32; 3], [f32; 3]), VitError> {
    let recorded = weights::config_path(weights);
    let preprocessor = weights.with_file_name("preprocessor_config.json");
    for (path, recorded) in [(recorded, true), (preprocessor, false)] {
        let error = |reason: String| VitError::Preprocessor {
            path: path.clone(),
            reason,
        };
        // Only a file that is not there falls through: one that cannot be read would
        // otherwise normalise the images another way without a word.
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(error(format!("cannot read it: {e}"))),
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| error(format!("not JSON: {e}")))?;
        // A run's configuration without them is another program's (or an older run's).
        if recorded && json.get(IMAGE_MEAN).is_none() {
            continue;
        }
        let channels = |key: &str, default: [f32; 3]| -> Result<[f32; 3], VitError> {
            let Some(value) = json.get(key) else {
                return Ok(default);
            };
            let values: Option<Vec<f32>> = value
                .as_array()
                .and_then(|a| a.iter().map(|v| v.as_f64().map(|x| x as f32)).collect());
            values
                .and_then(|v| <[f32; 3]>::try_from(v).ok())
                .ok_or_else(|| error(format!("`{key}` is {value}, not three numbers")))
        };
        let (mean, std) = HF_MEAN_STD;
        let (mean, std) = (channels(IMAGE_MEAN, mean)?, channels(IMAGE_STD, std)?);
        // Images are divided by it: 0 or a negative or non-finite value breaks every pixel.
        if !(mean.iter().all(|m| m.is_finite()) && std.iter().all(|s| *s > 0.0 && s.is_finite())) {
            return Err(error(format!(
                "`{IMAGE_MEAN}` {mean:?} and `{IMAGE_STD}` {std:?}: the means must be finite and the deviations positive"
            )));
        }
        return Ok((mean, std));
    }
    Ok(HF_MEAN_STD)
}

/// The keys of the normalisation, as HF's `preprocessor_config.json` names them (and a run's
/// recorded configuration, after it).
pub const IMAGE_MEAN: &str = "image_mean";
pub const IMAGE_STD: &str = "image_std";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_normalised_as_the_weights_were_trained() {
        let dir = std::env::temp_dir().join(format!("burnscale-vit-pre-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let weights = dir.join("model.safetensors");
        assert_eq!(image_normalization(&weights).unwrap(), HF_MEAN_STD);
        let config = dir.join("preprocessor_config.json");
        let imagenet =
            r#"{"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}"#;
        std::fs::write(&config, imagenet).unwrap();
        let (mean, std) = image_normalization(&weights).unwrap();
        assert_eq!((mean[0], std[2]), (0.485, 0.225));
        // A run's own record beside the weights comes first; one without it is passed over.
        let recorded = weights::config_path(&weights);
        std::fs::write(&recorded, r#"{"hidden_size": 384}"#).unwrap();
        assert_eq!(image_normalization(&weights).unwrap().0[0], 0.485);
        let run =
            r#"{"hidden_size": 384, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]}"#;
        std::fs::write(&recorded, run).unwrap();
        assert_eq!(
            image_normalization(&weights).unwrap(),
            ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
        );
        std::fs::remove_file(&recorded).unwrap();
        std::fs::write(&config, r#"{"image_mean": [0.5, 0.5]}"#).unwrap();
        let err = image_normalization(&weights).unwrap_err().to_string();
        assert!(
            err.contains("image_mean") && err.contains("three numbers"),
            "{err}"
        );
        // A deviation images cannot be divided by, and a file that is there but unreadable
        // (a directory here), are errors, not another normalisation.
        std::fs::write(&config, r#"{"image_std": [0.5, 0.5, 0]}"#).unwrap();
        let err = image_normalization(&weights).unwrap_err().to_string();
        assert!(err.contains("the deviations positive"), "{err}");
        std::fs::remove_file(&config).unwrap();
        std::fs::create_dir(&config).unwrap();
        let err = image_normalization(&weights).unwrap_err().to_string();
        assert!(err.contains("cannot read it"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn key_table_round_trips() {
        for (hf, burn) in [
            ("vit.embeddings.cls_token", "embeddings.cls_token"),
            (
                "vit.embeddings.patch_embeddings.projection.weight",
                "embeddings.projection.weight",
            ),
            (
                "vit.encoder.layer.3.layernorm_before.weight",
                "layer.3.layernorm_before.gamma",
            ),
            (
                "vit.encoder.layer.0.attention.attention.query.weight",
                "layer.0.attention.query.weight",
            ),
            (
                "vit.encoder.layer.0.attention.output.dense.bias",
                "layer.0.attention.output.bias",
            ),
            (
                "vit.encoder.layer.11.intermediate.dense.weight",
                "layer.11.intermediate.weight",
            ),
            (
                "vit.encoder.layer.11.output.dense.weight",
                "layer.11.output.weight",
            ),
            ("vit.layernorm.bias", "layernorm.beta"),
            ("classifier.weight", "classifier.weight"),
        ] {
            assert_eq!(hf_to_burn(hf).as_deref(), Some(burn), "{hf}");
            assert_eq!(burn_to_hf(burn), hf, "{burn}");
        }
        assert_eq!(hf_to_burn("vit.pooler.dense.weight"), None);
        for (v5, burn) in [
            (
                "vit.layers.1.attention.o_proj.bias",
                "layer.1.attention.output.bias",
            ),
            ("vit.layers.1.mlp.fc2.weight", "layer.1.output.weight"),
            (
                "vit.layers.0.layernorm_after.weight",
                "layer.0.layernorm_after.gamma",
            ),
        ] {
            assert_eq!(hf_to_burn(v5).as_deref(), Some(burn), "{v5}");
        }
    }
}
