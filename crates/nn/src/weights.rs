//! Checkpoint tensors <-> a module's parameters, by parameter path. Each model's `loader.rs`
//! owns its key-mapping table and any layout changes (transposes, folds, resampling); this
//! file only reads and writes safetensors and swaps parameters in, checking every name and
//! shape on the way.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use safetensors::{Dtype, SafeTensors};

/// Everything that can go wrong reading, applying or writing weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("cannot read weights file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} is not a valid {format} file ({reason}); is it truncated? re-download or re-export it"
    )]
    Format {
        path: PathBuf,
        format: &'static str,
        reason: String,
    },
    #[error("{path}: tensor `{key}` has shape {found:?}, the config expects {expected:?}{hint}")]
    Shape {
        path: PathBuf,
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
        hint: String,
    },
    #[error("{path}: tensor `{key}` has dtype {dtype}; only F32, F16, BF16 (and I64 buffers) load")]
    Dtype {
        path: PathBuf,
        key: String,
        dtype: String,
    },
    #[error("{path} is missing {} weight(s): {}", keys.len(), keys.join(", "))]
    MissingKeys { path: PathBuf, keys: Vec<String> },
    #[error("{path} has {} weight(s) this model does not use: {} (weights for another architecture?)", keys.len(), keys.join(", "))]
    UnexpectedKeys { path: PathBuf, keys: Vec<String> },
    #[error("cannot write {path}: {reason}")]
    Save { path: PathBuf, reason: String },
}

/// One checkpoint tensor as f32, under the key it has in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct Weight {
    pub key: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Weight {
    /// `[rows, cols]` -> `[cols, rows]` (PyTorch `nn.Linear` <-> Burn `Linear`).
    pub fn transposed(mut self) -> Self {
        if let [rows, cols] = self.shape[..] {
            let mut out = vec![0.0; self.values.len()];
            for r in 0..rows {
                for c in 0..cols {
                    out[c * rows + r] = self.values[r * cols + c];
                }
            }
            self.values = out;
            self.shape = vec![cols, rows];
        }
        self
    }
}

/// Every tensor of a safetensors file, converted to f32.
pub fn read_safetensors(path: &Path) -> Result<Vec<Weight>, WeightError> {
    let bytes = std::fs::read(path).map_err(|source| WeightError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| WeightError::Format {
        path: path.to_path_buf(),
        format: "safetensors",
        reason: e.to_string(),
    })?;
    file.tensors()
        .into_iter()
        .map(|(key, view)| {
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
                // Integer buffers (BERT's `position_ids`) and test inputs; exact below 2^24.
                Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                    .collect(),
                other => {
                    return Err(WeightError::Dtype {
                        path: path.to_path_buf(),
                        key,
                        dtype: format!("{other:?}"),
                    });
                }
            };
            Ok(Weight {
                shape: view.shape().to_vec(),
                key,
                values,
            })
        })
        .collect()
}

/// Writes f32 tensors as a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[Weight]) -> Result<(), WeightError> {
    let save_error = |reason: String| WeightError::Save {
        path: path.to_path_buf(),
        reason,
    };
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|w| w.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(w, bytes)| {
            safetensors::tensor::TensorView::new(Dtype::F32, w.shape.clone(), bytes)
                .map(|view| (w.key.clone(), view))
                .map_err(|e| save_error(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| save_error(e.to_string()))
}

/// A loader's key-mapping table: rows of (file key, parameter path) templates, where `{i}`
/// stands for a block index. A row with an empty path names a file tensor the model does not
/// load (a buffer, or a weight tied to another).
#[derive(Debug, Clone, Copy)]
pub struct KeyTable(pub &'static [(&'static str, &'static str)]);

impl KeyTable {
    /// The parameter path of a file key: `Some("")` for a skipped tensor, `None` for a key
    /// the table does not know.
    pub fn to_path(&self, key: &str) -> Option<String> {
        self.0
            .iter()
            .find_map(|(file, path)| fill(path, matches(file, key)?))
    }

    /// The file key of a parameter path.
    pub fn to_key(&self, path: &str) -> Option<String> {
        self.0
            .iter()
            .filter(|(_, p)| !p.is_empty())
            .find_map(|(file, p)| fill(file, matches(p, path)?))
    }
}

/// `Some(index)` if `name` fits `template` (`index` is `{i}`'s value, if any).
fn matches(template: &str, name: &str) -> Option<Option<usize>> {
    match template.split_once("{i}") {
        None => (template == name).then_some(None),
        Some((head, tail)) => {
            let digits = name.strip_prefix(head)?.strip_suffix(tail)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(Some(digits.parse().ok()?))
        }
    }
}

fn fill(template: &str, index: Option<usize>) -> Option<String> {
    Some(match index {
        Some(i) => template.replacen("{i}", &i.to_string(), 1),
        None => template.to_string(),
    })
}

/// How a model's loader names things, for [`apply`]'s checks and messages.
pub trait KeyMap {
    /// The file key of a parameter path, for "missing" messages.
    fn file_key(&self, path: &str) -> String;
    /// Whether a parameter may keep its fresh initialisation when the file lacks it (a new
    /// classification head, when finetuning).
    fn may_stay_initialised(&self, _path: &str) -> bool {
        false
    }
    /// Extra words for a shape mismatch of this parameter ("vocabulary size differs").
    fn shape_hint(&self, _path: &str) -> &'static str {
        ""
    }
}

/// Swaps every parameter of `model` for the weight under its path in `weights`. Every
/// parameter must be there (unless the key map lets it stay initialised), with its shape,
/// and every weight must be used.
pub fn apply<M: Module>(
    model: M,
    weights: HashMap<String, Weight>,
    keys: &dyn KeyMap,
    file: &Path,
    device: &Device,
) -> Result<M, WeightError> {
    let mut mapper = LoadMapper {
        path: Vec::new(),
        weights,
        keys,
        device: device.clone(),
        missing: Vec::new(),
        shape_error: None,
        file,
    };
    let model = model.map(&mut mapper);
    // Names before shapes: unknown tensors say "another architecture" most directly.
    if !mapper.weights.is_empty() {
        let mut keys: Vec<String> = mapper.weights.into_values().map(|w| w.key).collect();
        keys.sort();
        return Err(WeightError::UnexpectedKeys {
            path: file.to_path_buf(),
            keys,
        });
    }
    if !mapper.missing.is_empty() {
        return Err(WeightError::MissingKeys {
            path: file.to_path_buf(),
            keys: mapper.missing,
        });
    }
    if let Some(err) = mapper.shape_error {
        return Err(err);
    }
    Ok(model)
}

/// Every float parameter of `model`, keyed by parameter path, as f32.
pub fn collect<M: Module>(model: &M) -> BTreeMap<String, Weight> {
    let mut collector = Collector::default();
    model.visit(&mut collector);
    collector.tensors
}

struct LoadMapper<'a> {
    path: Vec<String>,
    weights: HashMap<String, Weight>,
    keys: &'a dyn KeyMap,
    device: Device,
    missing: Vec<String>,
    shape_error: Option<WeightError>,
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
        let Some(weight) = self.weights.remove(&path) else {
            if !self.keys.may_stay_initialised(&path) {
                self.missing.push(self.keys.file_key(&path));
            }
            return param;
        };
        if weight.shape != expected {
            self.shape_error.get_or_insert(WeightError::Shape {
                path: self.file.to_path_buf(),
                hint: self.keys.shape_hint(&path).to_string(),
                key: weight.key,
                expected,
                found: weight.shape,
            });
            return param;
        }
        let tensor =
            Tensor::<D>::from_data(TensorData::new(weight.values, weight.shape), &self.device);
        let mut loaded = Param::from_tensor(tensor);
        loaded.id = param.id;
        loaded
    }
}

#[derive(Default)]
struct Collector {
    path: Vec<String>,
    tensors: BTreeMap<String, Weight>,
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
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        let values: Vec<f32> = tensor
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap_or_default();
        self.tensors.insert(
            path.clone(),
            Weight {
                key: path,
                shape,
                values,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: KeyTable = KeyTable(&[
        (
            "encoder.layer.{i}.output.LayerNorm.weight",
            "layer.{i}.output_norm.gamma",
        ),
        ("pooler.dense.weight", "pooler.weight"),
        ("embeddings.position_ids", ""),
    ]);

    #[test]
    fn key_tables_map_both_ways() {
        assert_eq!(
            TABLE
                .to_path("encoder.layer.11.output.LayerNorm.weight")
                .as_deref(),
            Some("layer.11.output_norm.gamma")
        );
        assert_eq!(
            TABLE.to_key("layer.3.output_norm.gamma").as_deref(),
            Some("encoder.layer.3.output.LayerNorm.weight")
        );
        assert_eq!(
            TABLE.to_path("pooler.dense.weight").as_deref(),
            Some("pooler.weight")
        );
        assert_eq!(
            TABLE.to_path("embeddings.position_ids").as_deref(),
            Some("")
        );
        assert_eq!(
            TABLE.to_path("encoder.layer.x.output.LayerNorm.weight"),
            None
        );
        assert_eq!(TABLE.to_path("classifier.weight"), None);
    }
}
