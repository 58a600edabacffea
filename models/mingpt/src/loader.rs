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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use safetensors::{Dtype, SafeTensors};

use crate::{Gpt, GptConfig, GptError};

const LM_HEAD: &str = "lm_head.weight";
const WTE: &str = "wte.weight";

/// The burnscale path of an HF key, or `None` for a buffer that carries no weight.
fn hf_to_burn(key: &str) -> Option<String> {
    let key = key.strip_prefix("transformer.").unwrap_or(key);
    if key.ends_with(".attn.bias") || key.ends_with(".attn.masked_bias") {
        return None;
    }
    let renamed = match key.rsplit_once('.') {
        Some((module, "weight")) if is_layer_norm(module) => format!("{module}.gamma"),
        Some((module, "bias")) if is_layer_norm(module) => format!("{module}.beta"),
        _ => key.to_string(),
    };
    Some(renamed)
}

/// The HF key of a burnscale parameter path (`h.0.ln_1.gamma` -> `transformer.h.0.ln_1.weight`).
pub fn burn_to_hf(path: &str) -> String {
    let hf = match path.rsplit_once('.') {
        Some((module, "gamma")) => format!("{module}.weight"),
        Some((module, "beta")) => format!("{module}.bias"),
        _ => path.to_string(),
    };
    if hf == LM_HEAD {
        hf
    } else {
        format!("transformer.{hf}")
    }
}

fn is_layer_norm(module: &str) -> bool {
    module.ends_with("ln_1") || module.ends_with("ln_2") || module == "ln_f"
}

/// A weight read from disk, in Burn's layout.
struct Loaded {
    hf_key: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// Loads a GPT-2-layout safetensors file into a model built from `config`.
///
/// Every weight of the model must be in the file and every tensor of the file must be used;
/// `lm_head.weight` may be absent (GPT-2 ties it to `wte`).
pub fn load(path: &Path, config: &GptConfig, device: &Device) -> Result<Gpt, GptError> {
    let model = Gpt::new(config, device)?;
    let bytes = std::fs::read(path).map_err(|source| GptError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut weights = read_tensors(path, &bytes)?;
    if !weights.contains_key(LM_HEAD)
        && let Some(wte) = weights.get(WTE)
    {
        let tied = Loaded {
            hf_key: format!("{} (tied)", wte.hf_key),
            shape: wte.shape.clone(),
            values: wte.values.clone(),
        };
        weights.insert(LM_HEAD.to_string(), tied);
    }
    if let Some(head) = weights.get_mut(LM_HEAD) {
        transpose(head);
    }

    let mut mapper = LoadMapper {
        path: Vec::new(),
        weights,
        device: device.clone(),
        missing: Vec::new(),
        shape_error: None,
        file: path,
    };
    let model = model.map(&mut mapper);
    if let Some(err) = mapper.shape_error {
        return Err(err);
    }
    if !mapper.missing.is_empty() {
        return Err(GptError::MissingKeys {
            path: path.to_path_buf(),
            keys: mapper.missing,
        });
    }
    if !mapper.weights.is_empty() {
        let mut keys: Vec<String> = mapper.weights.into_values().map(|w| w.hf_key).collect();
        keys.sort();
        return Err(GptError::UnexpectedKeys {
            path: path.to_path_buf(),
            keys,
        });
    }
    Ok(model)
}

/// Writes `model` as a GPT-2-layout safetensors file (with an explicit `lm_head.weight`).
pub fn save(model: &Gpt, path: &Path) -> Result<(), GptError> {
    let mut collector = Collector::default();
    model.visit(&mut collector);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = collector
        .tensors
        .iter()
        .map(|(key, (shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map_err(|e| GptError::Save {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })?;
            Ok((key.clone(), view))
        })
        .collect::<Result<_, GptError>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| GptError::Save {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn read_tensors(path: &Path, bytes: &[u8]) -> Result<HashMap<String, Loaded>, GptError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| GptError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut weights = HashMap::new();
    for (key, view) in file.tensors() {
        let Some(burn_path) = hf_to_burn(&key) else {
            continue;
        };
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(GptError::Dtype {
                    path: path.to_path_buf(),
                    key,
                    dtype: format!("{other:?}"),
                });
            }
        };
        let shape = view.shape().to_vec();
        weights.insert(
            burn_path,
            Loaded {
                hf_key: key,
                shape,
                values,
            },
        );
    }
    Ok(weights)
}

fn transpose(w: &mut Loaded) {
    if let [rows, cols] = w.shape[..] {
        let mut out = vec![0.0; w.values.len()];
        for r in 0..rows {
            for c in 0..cols {
                out[c * rows + r] = w.values[r * cols + c];
            }
        }
        w.values = out;
        w.shape = vec![cols, rows];
    }
}

/// Swaps every parameter of a freshly built model for the loaded weight of the same path.
struct LoadMapper<'a> {
    path: Vec<String>,
    weights: HashMap<String, Loaded>,
    device: Device,
    missing: Vec<String>,
    shape_error: Option<GptError>,
    file: &'a Path,
}

impl ModuleMapper for LoadMapper<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        let expected = param.lazy_shape().dims::<D>().to_vec();
        let Some(loaded) = self.weights.remove(&path) else {
            self.missing.push(burn_to_hf(&path));
            return param;
        };
        if loaded.shape != expected {
            let hint = match path.as_str() {
                WTE | LM_HEAD => " (vocabulary size differs from the checkpoint's)",
                "wpe.weight" => " (block size differs from the checkpoint's)",
                _ => "",
            };
            self.shape_error.get_or_insert(GptError::Shape {
                path: self.file.to_path_buf(),
                key: loaded.hf_key,
                expected,
                found: loaded.shape,
                hint: hint.to_string(),
            });
            return param;
        }
        let tensor =
            Tensor::<D>::from_data(TensorData::new(loaded.values, loaded.shape), &self.device);
        let mut loaded_param = Param::from_tensor(tensor);
        loaded_param.id = param.id;
        loaded_param
    }
}

/// Every float parameter as HF key -> (shape, little-endian f32 bytes).
#[derive(Default)]
struct Collector {
    path: Vec<String>,
    tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
}

impl ModuleVisitor for Collector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let path = self.path.join(".");
        let mut tensor = param.val();
        let mut shape = tensor.dims().to_vec();
        if path == LM_HEAD {
            tensor = tensor.transpose();
            shape.reverse();
        }
        let values: Vec<f32> = tensor
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap_or_default();
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensors.insert(burn_to_hf(&path), (shape, bytes));
    }
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
}
