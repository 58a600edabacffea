//! GPT-2 Hugging Face safetensors <-> [`Gpt`].
//!
//! | HF GPT-2 key (optional `transformer.` prefix) | burnscale path              | note |
//! |-----------------------------------------------|-----------------------------|------|
//! | `wte.weight`                                  | `wte.weight`                | `[vocab, n_embd]` |
//! | `wpe.weight`                                  | `wpe.weight`                | `[block_size, n_embd]` |
//! | `h.{i}.ln_1.weight` / `.bias`                 | `h.{i}.ln_1.gamma` / `.beta` | |
//! | `h.{i}.attn.c_attn.weight` / `.bias`          | same                        | Conv1D `[in, out]` = Burn's Linear layout |
//! | `h.{i}.attn.c_proj.weight` / `.bias`          | same                        | Conv1D |
//! | `h.{i}.ln_2.weight` / `.bias`                 | `h.{i}.ln_2.gamma` / `.beta` | |
//! | `h.{i}.mlp.c_fc.weight` / `.bias`             | same                        | Conv1D |
//! | `h.{i}.mlp.c_proj.weight` / `.bias`           | same                        | Conv1D |
//! | `ln_f.weight` / `.bias`                       | `ln_f.gamma` / `.beta`      | |
//! | `lm_head.weight`                              | `lm_head.weight`            | `nn.Linear` `[vocab, n_embd]`, transposed; absent in GPT-2 files, where it is tied to `wte` |
//! | `h.{i}.attn.bias`, `h.{i}.attn.masked_bias`   | —                           | GPT-2's causal-mask buffers, skipped |

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
use burnscale_nn::weights::{self, KeyMap, Saved, Weight};

use crate::{Gpt, GptConfig, GptError};

const LM_HEAD: &str = "lm_head.weight";
const WTE: &str = "wte.weight";

/// The burnscale path of an HF key, or `None` for a buffer that carries no weight.
fn hf_to_burn(key: &str) -> Option<String> {
    let key = key.strip_prefix("transformer.").unwrap_or(key);
    if key.ends_with(".attn.bias") || key.ends_with(".attn.masked_bias") {
        return None;
    }
    Some(weights::layer_norm_from_torch(key, is_layer_norm))
}

/// The HF key of a burnscale parameter path (`h.0.ln_1.gamma` -> `transformer.h.0.ln_1.weight`).
pub fn burn_to_hf(path: &str) -> String {
    let hf = weights::layer_norm_to_torch(path);
    if hf == LM_HEAD {
        hf
    } else {
        format!("transformer.{hf}")
    }
}

fn is_layer_norm(module: &str) -> bool {
    module.ends_with("ln_1") || module.ends_with("ln_2") || module == "ln_f"
}

/// GPT-2's HF names and layouts (the language-model head stored transposed).
#[derive(Debug, Clone, Copy)]
pub struct Gpt2Keys;

impl KeyMap for Gpt2Keys {
    fn file_key(&self, path: &str) -> String {
        burn_to_hf(path)
    }

    fn saved_as(&self, path: &str, _dims: &[usize]) -> Vec<Saved> {
        vec![Saved {
            key: burn_to_hf(path),
            transposed: path == LM_HEAD,
        }]
    }

    fn shape_hint(&self, path: &str) -> &'static str {
        match path {
            WTE | LM_HEAD => " (vocabulary size differs from the checkpoint's)",
            "wpe.weight" => " (block size differs from the checkpoint's)",
            _ => "",
        }
    }
}

/// Loads a GPT-2-layout safetensors file into a model built from `config`.
///
/// Every weight of the model must be in the file and every tensor of the file must be used;
/// `lm_head.weight` may be absent (GPT-2 ties it to `wte`).
pub fn load(path: &Path, config: &GptConfig, device: &Device) -> Result<Gpt, GptError> {
    let model = Gpt::new(config, device)?;
    let mut weights: HashMap<String, Weight> = HashMap::new();
    for w in weights::read_safetensors(path)? {
        if let Some(param) = hf_to_burn(&w.key) {
            weights::insert_once(&mut weights, param, w, path)?;
        }
    }
    if !weights.contains_key(LM_HEAD)
        && let Some(wte) = weights.get(WTE)
    {
        let tied = Weight {
            key: format!("{} (tied)", wte.key),
            ..wte.clone()
        };
        weights.insert(LM_HEAD.to_string(), tied);
    }
    if let Some(head) = weights.remove(LM_HEAD) {
        weights.insert(LM_HEAD.to_string(), head.transposed());
    }
    Ok(weights::apply(model, weights, &Gpt2Keys, path, device)?)
}

/// Writes `model` as a GPT-2-layout safetensors file (with an explicit `lm_head.weight`).
pub fn save(model: &Gpt, path: &Path) -> Result<(), GptError> {
    Ok(weights::save(model, &Gpt2Keys, path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_table_round_trips() {
        for (hf, burn) in [
            ("transformer.wte.weight", "wte.weight"),
            ("transformer.h.3.ln_1.weight", "h.3.ln_1.gamma"),
            ("transformer.h.3.ln_2.bias", "h.3.ln_2.beta"),
            (
                "transformer.h.0.attn.c_attn.weight",
                "h.0.attn.c_attn.weight",
            ),
            ("transformer.h.0.mlp.c_proj.bias", "h.0.mlp.c_proj.bias"),
            ("transformer.ln_f.weight", "ln_f.gamma"),
            ("lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_to_burn(hf).as_deref(), Some(burn));
            assert_eq!(burn_to_hf(burn), hf);
        }
        assert_eq!(
            hf_to_burn("h.1.ln_f.weight").as_deref(),
            Some("h.1.ln_f.weight")
        );
        assert_eq!(hf_to_burn("h.0.attn.masked_bias"), None);
        assert_eq!(hf_to_burn("wte.weight").as_deref(), Some("wte.weight"));
    }

    #[test]
    fn two_names_of_one_parameter_are_an_error() {
        let config = GptConfig::tiny();
        let path = std::env::temp_dir().join(format!("burnscale-dup-{}.st", std::process::id()));
        let device = Device::default();
        save(&Gpt::new(&config, &device).unwrap(), &path).unwrap();
        let mut tensors = weights::read_safetensors(&path).unwrap();
        let wte = tensors.iter().find(|w| w.key == "transformer.wte.weight");
        let bare = Weight {
            key: "wte.weight".into(),
            ..wte.unwrap().clone()
        };
        tensors.push(bare);
        weights::write_safetensors(&path, &tensors).unwrap();
        let err = load(&path, &config, &device).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(
            err.contains("`transformer.wte.weight` and `wte.weight`")
                || err.contains("`wte.weight` and `transformer.wte.weight`"),
            "{err}"
        );
    }
}
