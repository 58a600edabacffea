//! Checkpoint tensors <-> a module's parameters, by parameter path. Each model's `loader.rs`
//! owns its key-mapping table and any layout changes (transposes, folds, resampling); this
//! file only reads and writes safetensors and swaps parameters in, checking every name and
//! shape on the way.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

/// Where the configuration a run recorded (the model's, with what a program adds, such as
/// minGPT's characters or ViT's image normalisation) is written beside a weights file
/// (`--save`, `consolidate`): `FILE` with the extension `config.json`, as a Hugging Face
/// directory keeps its `config.json` beside its weights.
pub fn config_path(weights: &Path) -> PathBuf {
    weights.with_extension("config.json")
}

/// Everything that can go wrong reading, applying or writing weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("cannot read weights file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write weights file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} looks like a PyTorch checkpoint (torch.save's zip or pickle), which is not read here: save it as safetensors (transformers' save_pretrained, or safetensors.torch.save_model, which keeps tied weights) and give that file"
    )]
    PyTorch { path: PathBuf },
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
    #[error(
        "{path}: tensor `{key}` has dtype {dtype}; only F32, F16, BF16 and I64, I32, I8, U8, BOOL buffers load"
    )]
    Dtype {
        path: PathBuf,
        key: String,
        dtype: String,
    },
    #[error(
        "{path}: tensor `{key}` holds {dtype} values where the model has a float parameter (a quantized file's integer codes?): dequantize it to F32, F16 or BF16 first"
    )]
    NotFloat {
        path: PathBuf,
        key: String,
        dtype: String,
    },
    #[error(
        "{path} holds {found} layer(s) where the config has {expected} (the model's `{prefix}.N`): weights of a model of another depth (give the config the file's layer count, or this model's file)"
    )]
    Depth {
        path: PathBuf,
        prefix: String,
        found: usize,
        expected: usize,
    },
    #[error("{path} is missing {} weight(s): {}", keys.len(), listed(keys, ", "))]
    MissingKeys { path: PathBuf, keys: Vec<String> },
    #[error("{path} has {} weight(s) this model does not use: {} (weights for another architecture?)", keys.len(), listed(keys, ", "))]
    UnexpectedKeys { path: PathBuf, keys: Vec<String> },
    #[error("cannot write {path}: {reason}")]
    Save { path: PathBuf, reason: String },
    #[error(
        "{path} holds `{first}` and `{second}`, which are both the model's `{param}`: keep one"
    )]
    DuplicateKeys {
        path: PathBuf,
        param: String,
        first: String,
        second: String,
    },
}

/// The first of `items` and how many more, joined by `separator`: a file of another model
/// differs in every one of its hundreds of tensors, which a message naming them all would
/// bury.
pub fn listed(items: &[String], separator: &str) -> String {
    const SHOWN: usize = 8;
    match items.len() > SHOWN {
        true => format!(
            "{}{separator}and {} more",
            items[..SHOWN].join(separator),
            items.len() - SHOWN
        ),
        false => items.join(separator),
    }
}

/// One checkpoint tensor as f32, under the key it has in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct Weight {
    pub key: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    /// The type the values had in their file: an integer or bool tensor (a buffer, test
    /// input, or a quantized file's codes) never loads as a float parameter.
    pub dtype: Dtype,
}

impl Weight {
    /// A tensor of f32 values (computed, or read from an f32 source).
    pub fn new(key: String, shape: Vec<usize>, values: Vec<f32>) -> Self {
        Self {
            key,
            shape,
            values,
            dtype: Dtype::F32,
        }
    }

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
    let file = SafeTensors::deserialize(&bytes).map_err(|e| {
        // torch.save's zip (PyTorch >= 1.6) or pickle (protocol 2 to 5), not a damaged
        // safetensors file, whose JSON header opens at byte 8 (its little-endian length
        // before it may itself start 80 02..05).
        let pickle = bytes.len() > 1 && bytes[0] == 0x80 && (2..=5).contains(&bytes[1]);
        let header = bytes.get(8) == Some(&b'{');
        match (bytes.starts_with(b"PK\x03\x04") || pickle) && !header {
            true => WeightError::PyTorch {
                path: path.to_path_buf(),
            },
            false => WeightError::Format {
                path: path.to_path_buf(),
                format: "safetensors",
                reason: e.to_string(),
            },
        }
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
                // Integer buffers (BERT's `position_ids`, GPT-2's causal mask as uint8 or
                // bool in older transformers' files, which the loaders skip) and test
                // inputs; exact below 2^24.
                Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                    .collect(),
                Dtype::I32 => data
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32)
                    .collect(),
                Dtype::U8 | Dtype::BOOL => data.iter().map(|&b| f32::from(b)).collect(),
                Dtype::I8 => data.iter().map(|&b| f32::from(b as i8)).collect(),
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
                dtype: view.dtype(),
            })
        })
        .collect()
}

/// Writes f32 tensors as a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[Weight]) -> Result<(), WeightError> {
    let plan: Vec<(String, Vec<usize>)> = tensors
        .iter()
        .map(|w| (w.key.clone(), w.shape.clone()))
        .collect();
    let mut writer = SafetensorsWriter::create(path, &plan)?;
    for w in tensors {
        writer.write(&w.key, &w.values)?;
    }
    writer.finish()
}

/// Where a file is written before it is renamed to `path`, whole (`<path>.partial`): an
/// interrupted write never leaves a file at `path` that looks whole.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// A safetensors file (f32) written one tensor at a time, in any order: the header is fixed
/// up front from every tensor's key and shape, so nothing waits in memory for the tensors
/// before it. The bytes go to `<path>.partial`, renamed to `path` by [`finish`] once every
/// tensor is there and synced: an interrupted save never leaves a file that looks whole.
///
/// [`finish`]: SafetensorsWriter::finish
pub struct SafetensorsWriter {
    path: PathBuf,
    partial: PathBuf,
    file: Option<File>,
    data_start: u64,
    entries: HashMap<String, Entry>,
}

/// A tensor a [`SafetensorsWriter`] will write.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub key: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Where a planned tensor goes in the data, and whether it was written.
struct Entry {
    dtype: Dtype,
    bytes: usize,
    offset: u64,
    written: bool,
}

impl SafetensorsWriter {
    /// Starts `path` for the f32 tensors `plan` names (key, shape), laid out in that order,
    /// with HF's `{"format": "pt"}` metadata.
    pub fn create(path: &Path, plan: &[(String, Vec<usize>)]) -> Result<Self, WeightError> {
        let plan: Vec<Planned> = plan
            .iter()
            .map(|(key, shape)| Planned {
                key: key.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
            })
            .collect();
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        Self::create_with(path, &plan, metadata)
    }

    /// Starts `path` for the tensors `plan` names, laid out in that order, with `metadata`
    /// in the header.
    pub fn create_with(
        path: &Path,
        plan: &[Planned],
        metadata: HashMap<String, String>,
    ) -> Result<Self, WeightError> {
        let save_error = |reason: String| WeightError::Save {
            path: path.to_path_buf(),
            reason,
        };
        // Found now, not by the rename after every tensor is written.
        if path.is_dir() {
            return Err(save_error(
                "it is a directory: give a file's name (model.safetensors)".into(),
            ));
        }
        let mut infos = Vec::with_capacity(plan.len());
        let mut entries = HashMap::with_capacity(plan.len());
        let mut offset = 0;
        for Planned { key, dtype, shape } in plan {
            let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
            let entry = Entry {
                dtype: *dtype,
                bytes,
                offset: offset as u64,
                written: false,
            };
            if entries.insert(key.clone(), entry).is_some() {
                return Err(save_error(format!("tensor `{key}` is planned twice")));
            }
            let info = TensorInfo {
                dtype: *dtype,
                shape: shape.clone(),
                data_offsets: (offset, offset + bytes),
            };
            infos.push((key.clone(), info));
            offset += bytes;
        }
        let header = Metadata::new(Some(metadata), infos)
            .map_err(|e| save_error(e.to_string()))
            .and_then(|m| serde_json::to_vec(&m).map_err(|e| save_error(e.to_string())))?;
        // Data starts 8-byte aligned, as safetensors' own writer pads it.
        let mut header = header;
        header.resize(header.len().next_multiple_of(8), b' ');
        let partial = partial_path(path);
        let io = |source| WeightError::Write {
            path: partial.clone(),
            source,
        };
        let mut file = File::create(&partial).map_err(io)?;
        file.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|_| file.write_all(&header))
            .map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            data_start: 8 + header.len() as u64,
            partial,
            file: Some(file),
            entries,
        })
    }

    /// Writes the values of the planned f32 tensor `key` (row-major, its planned count).
    pub fn write(&mut self, key: &str, values: &[f32]) -> Result<(), WeightError> {
        if let Some(entry) = self.entries.get(key).filter(|e| e.dtype != Dtype::F32) {
            return Err(self.error(format!("tensor `{key}` is planned as {:?}", entry.dtype)));
        }
        self.write_with(key, values.len() * 4, |out| {
            values
                .iter()
                .try_for_each(|v| out.write_all(&v.to_le_bytes()))
        })
    }

    /// Writes the planned tensor `key` as raw little-endian `bytes` of its dtype.
    pub fn write_bytes(&mut self, key: &str, bytes: &[u8]) -> Result<(), WeightError> {
        self.write_with(key, bytes.len(), |out| out.write_all(bytes))
    }

    fn error(&self, reason: String) -> WeightError {
        WeightError::Save {
            path: self.path.clone(),
            reason,
        }
    }

    /// Checks `len` bytes fit `key`'s plan, and has `fill` write them at its offset.
    fn write_with(
        &mut self,
        key: &str,
        len: usize,
        fill: impl FnOnce(&mut BufWriter<&mut File>) -> std::io::Result<()>,
    ) -> Result<(), WeightError> {
        let Some(entry) = self.entries.get(key) else {
            return Err(self.error(format!("tensor `{key}` is not in the file's plan")));
        };
        if len != entry.bytes || entry.written {
            let size = entry.dtype.bitsize() / 8;
            return Err(self.error(format!(
                "tensor `{key}`: {} values for {} planned{}",
                len / size,
                entry.bytes / size,
                if entry.written {
                    ", written before"
                } else {
                    ""
                }
            )));
        }
        let offset = self.data_start + entry.offset;
        let partial = self.partial.clone();
        let io = |source| WeightError::Write {
            path: partial.clone(),
            source,
        };
        let file = self.file.as_mut().expect("open until finished");
        file.seek(SeekFrom::Start(offset)).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        fill(&mut out).and_then(|()| out.flush()).map_err(io)?;
        if let Some(entry) = self.entries.get_mut(key) {
            entry.written = true;
        }
        Ok(())
    }

    /// Checks every planned tensor was written, syncs the file and moves it to its path.
    pub fn finish(mut self) -> Result<(), WeightError> {
        let mut missing: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, entry)| !entry.written)
            .map(|(key, _)| key.clone())
            .collect();
        if !missing.is_empty() {
            missing.sort();
            return Err(WeightError::Save {
                path: self.path.clone(),
                reason: format!("never written: {}", missing.join(", ")),
            });
        }
        let file = self.file.take().expect("open until finished");
        file.sync_all().map_err(|source| WeightError::Write {
            path: self.partial.clone(),
            source,
        })?;
        drop(file);
        std::fs::rename(&self.partial, &self.path).map_err(|source| {
            // A file the size of the model, under no name a run reads.
            let _ = std::fs::remove_file(&self.partial);
            WeightError::Write {
                path: self.path.clone(),
                source,
            }
        })
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        // Unfinished: the partial file is no checkpoint.
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

/// One file tensor a parameter is saved as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub key: String,
    /// Stored `[cols, rows]` (PyTorch's `nn.Linear` layout).
    pub transposed: bool,
}

/// Saves a model's parameters under its loader's names and layouts (the HF checkpoint's, as
/// [`KeyMap::saved_as`] says), as they arrive: one parameter's values at a time.
pub struct Saver<'k> {
    writer: SafetensorsWriter,
    keys: &'k dyn KeyMap,
}

impl<'k> Saver<'k> {
    /// Starts `path` for the parameters `params` names (path, dims), in that order.
    pub fn create(
        path: &Path,
        keys: &'k dyn KeyMap,
        params: &[(String, Vec<usize>)],
    ) -> Result<Self, WeightError> {
        let plan: Vec<(String, Vec<usize>)> = params
            .iter()
            .flat_map(|(param, dims)| {
                keys.saved_as(param, dims).into_iter().map(|saved| {
                    let mut shape = dims.clone();
                    if saved.transposed {
                        shape.reverse();
                    }
                    (saved.key, shape)
                })
            })
            .collect();
        Ok(Self {
            writer: SafetensorsWriter::create(path, &plan)?,
            keys,
        })
    }

    /// Writes the parameter at `path` (its `dims`, row-major `values`).
    pub fn put(&mut self, path: &str, dims: &[usize], values: Vec<f32>) -> Result<(), WeightError> {
        let weight = Weight::new(String::new(), dims.to_vec(), values);
        let saved = self.keys.saved_as(path, dims);
        let transposed = saved
            .iter()
            .any(|s| s.transposed)
            .then(|| weight.clone().transposed());
        for s in saved {
            let w = match s.transposed {
                true => transposed.as_ref().expect("transposed above"),
                false => &weight,
            };
            self.writer.write(&s.key, &w.values)?;
        }
        Ok(())
    }

    /// Completes the file (see [`SafetensorsWriter::finish`]).
    pub fn finish(self) -> Result<(), WeightError> {
        self.writer.finish()
    }
}

/// Writes every float parameter of `model` to `path` under `keys`' names and layouts, one
/// parameter at a time.
pub fn save<M: Module>(model: &M, keys: &dyn KeyMap, path: &Path) -> Result<(), WeightError> {
    let mut saver = Saver::create(path, keys, &param_shapes(model))?;
    let mut result = Ok(());
    for_each_param(model, |param, dims, values| {
        if result.is_ok() {
            result = saver.put(param, &dims, values);
        }
    });
    result?;
    saver.finish()
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

/// `key` with a layer norm's PyTorch parameter names (`weight`, `bias`) as burnscale's
/// [`crate::LayerNorm`] names them (`gamma`, `beta`), for the modules `is_layer_norm` picks.
pub fn layer_norm_from_torch(key: &str, is_layer_norm: impl Fn(&str) -> bool) -> String {
    match key.rsplit_once('.') {
        Some((module, "weight")) if is_layer_norm(module) => format!("{module}.gamma"),
        Some((module, "bias")) if is_layer_norm(module) => format!("{module}.beta"),
        _ => key.to_string(),
    }
}

/// `path` with [`crate::LayerNorm`]'s `gamma` and `beta` under PyTorch's names.
pub fn layer_norm_to_torch(path: &str) -> String {
    match path.rsplit_once('.') {
        Some((module, "gamma")) => format!("{module}.weight"),
        Some((module, "beta")) => format!("{module}.bias"),
        _ => path.to_string(),
    }
}

/// Whether a file's task head is loaded or a fresh one is kept (finetuning on other labels or
/// classes, or from a pretraining checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Load,
    Fresh,
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
    /// The file tensors the parameter at `path` (of `dims`) is saved as: usually one, under
    /// its file key; a weight the file repeats (a tied decoder) more.
    fn saved_as(&self, path: &str, _dims: &[usize]) -> Vec<Saved> {
        vec![Saved {
            key: self.file_key(path),
            transposed: false,
        }]
    }
}

/// Parameter paths as file keys, unchanged: a model saved in its own names.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnNames;

impl KeyMap for OwnNames {
    fn file_key(&self, path: &str) -> String {
        path.to_string()
    }
}

/// Puts `w` in `weights` under the model's parameter `param`, unless another key of `file`
/// (a checkpoint's alternative name for it) is there already: one would be dropped unread.
pub fn insert_once(
    weights: &mut HashMap<String, Weight>,
    param: String,
    w: Weight,
    file: &Path,
) -> Result<(), WeightError> {
    if let Some(first) = weights.get(&param) {
        return Err(WeightError::DuplicateKeys {
            path: file.to_path_buf(),
            first: first.key.clone(),
            second: w.key,
            param,
        });
    }
    weights.insert(param, w);
    Ok(())
}

/// Swaps every parameter of `model` for the weight under its path in `weights`. Every
/// parameter must be there (unless the key map lets it stay initialised), with its shape and
/// a float dtype (never a file's integer codes), and every weight must be used; a file of
/// another depth is named by its layer count.
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
        params: Vec::new(),
        loaded: Vec::new(),
        dtype_error: None,
        shape_error: None,
        file,
    };
    let model = model.map(&mut mapper);
    if let Some(err) = mapper.dtype_error {
        return Err(err);
    }
    // Counted by parameter path, not file key: a file may lack the prefix the key map writes
    // (a bare `BertModel`'s `encoder.layer.N`). A width mismatch besides is no depth's.
    let unexpected: Vec<String> = mapper.weights.keys().cloned().collect();
    let in_file = [mapper.loaded, unexpected.clone()].concat();
    let depth = depth_mismatch(&mapper.params, &in_file, &mapper.missing, &unexpected)
        .filter(|_| mapper.shape_error.is_none());
    if let Some((prefix, found, expected)) = depth {
        return Err(WeightError::Depth {
            path: file.to_path_buf(),
            prefix,
            found,
            expected,
        });
    }
    // Names before shapes: unknown tensors say "another architecture" most directly.
    if !unexpected.is_empty() {
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
            keys: mapper.missing.iter().map(|p| keys.file_key(p)).collect(),
        });
    }
    if let Some(err) = mapper.shape_error {
        return Err(err);
    }
    Ok(model)
}

/// A key's layer: the part before its first numeric component, and that number
/// (`bert.encoder.layer.3.output.dense.weight` -> (`bert.encoder.layer`, 3)).
fn layer_of(key: &str) -> Option<(&str, usize)> {
    let mut end = 0;
    for part in key.split('.') {
        if let Ok(index) = part.parse() {
            return Some((key[..end].trim_end_matches('.'), index));
        }
        end += part.len() + 1;
    }
    None
}

/// `(prefix, the file's layers, the model's)` when every parameter path the file lacks or
/// has over is a layer past the other's last under one prefix, both having some: a model of
/// another depth, which the count names better than a list of keys.
fn depth_mismatch(
    model: &[String],
    file: &[String],
    missing: &[String],
    unexpected: &[String],
) -> Option<(String, usize, usize)> {
    let mut odd = missing.iter().chain(unexpected);
    let (prefix, _) = odd.clone().find_map(|k| layer_of(k))?;
    let layers = |keys: &[String]| {
        keys.iter()
            .filter_map(|k| layer_of(k))
            .filter(|(p, _)| *p == prefix)
            .map(|(_, index)| index + 1)
            .max()
            .unwrap_or(0)
    };
    let (found, expected) = (layers(file), layers(model));
    let past = found.min(expected);
    let all_past = odd.all(|k| matches!(layer_of(k), Some((p, i)) if p == prefix && i >= past));
    let both = found > 0 && expected > 0;
    (found != expected && both && all_past).then(|| (prefix.to_string(), found, expected))
}

/// Every float parameter of `model`, keyed by parameter path, as f32.
pub fn collect<M: Module>(model: &M) -> BTreeMap<String, Weight> {
    let mut tensors = BTreeMap::new();
    for_each_param(model, |path, shape, values| {
        let key = path.to_string();
        tensors.insert(key.clone(), Weight::new(key, shape, values));
    });
    tensors
}

/// Calls `f` with the path, dims and values (as f32) of every float parameter of `model`, in
/// visit order, one parameter at a time.
pub fn for_each_param<M: Module>(model: &M, f: impl FnMut(&str, Vec<usize>, Vec<f32>)) {
    model.visit(&mut Visitor {
        path: Vec::new(),
        f,
    });
}

/// The path and dims of every float parameter of `model`, in visit order (read from its
/// shape: a lazy parameter stays uninitialised).
pub fn param_shapes<M: Module>(model: &M) -> Vec<(String, Vec<usize>)> {
    let mut shapes = Vec::new();
    model.visit(&mut ShapeVisitor {
        path: Vec::new(),
        shapes: &mut shapes,
    });
    shapes
}

struct LoadMapper<'a> {
    path: Vec<String>,
    weights: HashMap<String, Weight>,
    keys: &'a dyn KeyMap,
    device: Device,
    /// The paths of the parameters the file lacks, of every parameter, and of those loaded.
    missing: Vec<String>,
    params: Vec<String>,
    loaded: Vec<String>,
    dtype_error: Option<WeightError>,
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
        self.params.push(path.clone());
        let Some(weight) = self.weights.remove(&path) else {
            if !self.keys.may_stay_initialised(&path) {
                self.missing.push(path);
            }
            return param;
        };
        self.loaded.push(path.clone());
        if !matches!(weight.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            self.dtype_error.get_or_insert(WeightError::NotFloat {
                path: self.file.to_path_buf(),
                dtype: format!("{:?}", weight.dtype),
                key: weight.key,
            });
            return param;
        }
        if weight.shape != expected {
            // Both shapes in the file's layout: a weight the loader transposed into Burn's
            // was `[out, in]` there (whatever prefix or old name its key had in the file).
            let transposed = self
                .keys
                .saved_as(&path, &expected)
                .iter()
                .any(|s| s.transposed);
            let in_file = |mut shape: Vec<usize>| {
                if transposed {
                    shape.reverse();
                }
                shape
            };
            self.shape_error.get_or_insert(WeightError::Shape {
                path: self.file.to_path_buf(),
                hint: self.keys.shape_hint(&path).to_string(),
                key: weight.key,
                expected: in_file(expected),
                found: in_file(weight.shape),
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

struct Visitor<F> {
    path: Vec<String>,
    f: F,
}

impl<F: FnMut(&str, Vec<usize>, Vec<f32>)> ModuleVisitor for Visitor<F> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        let values: Vec<f32> = tensor
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap_or_default();
        (self.f)(&self.path.join("."), shape, values);
    }
}

struct ShapeVisitor<'a> {
    path: Vec<String>,
    shapes: &'a mut Vec<(String, Vec<usize>)>,
}

impl ModuleVisitor for ShapeVisitor<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let dims = param.lazy_shape().dims::<D>().to_vec();
        self.shapes.push((self.path.join("."), dims));
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

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("burnscale-weights-{}-{name}", std::process::id()))
    }

    struct Transposing;

    impl KeyMap for Transposing {
        fn file_key(&self, path: &str) -> String {
            format!("file.{path}")
        }

        fn saved_as(&self, path: &str, _dims: &[usize]) -> Vec<Saved> {
            let saved = Saved {
                key: self.file_key(path),
                transposed: path == "w",
            };
            match path {
                "w" => vec![
                    saved.clone(),
                    Saved {
                        key: "tied".into(),
                        ..saved
                    },
                ],
                _ => vec![saved],
            }
        }
    }

    #[derive(Module, Debug)]
    struct OneMatrix {
        w: Param<Tensor<2>>,
    }

    /// A shape mismatch names both shapes in the file's layout, also for a weight the loader
    /// transposed into Burn's (a PyTorch `[out, in]` linear weight).
    #[test]
    fn a_transposed_weights_shape_mismatch_is_told_in_the_files_layout() {
        let device = Device::default();
        let model = OneMatrix {
            w: Param::from_tensor(Tensor::zeros([2, 3], &device)),
        };
        // The file's `[2, 4]` as the loader hands it over, transposed.
        let wrong = Weight::new("file.w".into(), vec![2, 4], vec![0.0; 8]).transposed();
        let weights = HashMap::from([("w".to_string(), wrong)]);
        let err = apply(
            model,
            weights,
            &Transposing,
            Path::new("m.safetensors"),
            &device,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`file.w` has shape [2, 4], the config expects [3, 2]"),
            "{err}"
        );
    }

    /// Another model's file: its unknown weights named, the first of them and how many more.
    #[test]
    fn another_models_weights_are_named_a_few_and_counted() {
        let device = Device::default();
        let model = || OneMatrix {
            w: Param::from_tensor(Tensor::zeros([2, 3], &device)),
        };
        let foreign = |i: usize| Weight::new(format!("other.{i:02}"), vec![1], vec![0.0]);
        let file = Path::new("m.safetensors");
        let weights = (0..20).map(|i| (format!("other.{i:02}"), foreign(i)));
        let err = apply(model(), weights.collect(), &Transposing, file, &device)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("has 20 weight(s) this model does not use: other.00, other.01, ")
                && err.contains("other.07, and 12 more (weights for another architecture?)")
                && !err.contains("other.08"),
            "{err}"
        );
        let err = apply(model(), HashMap::new(), &Transposing, file, &device)
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("is missing 1 weight(s): file.w"), "{err}");
    }

    #[derive(Module, Debug)]
    struct Stack {
        layers: Vec<OneMatrix>,
    }

    fn stack(depth: usize, device: &Device) -> Stack {
        let layers = (0..depth)
            .map(|_| OneMatrix {
                w: Param::from_tensor(Tensor::zeros([2, 3], device)),
            })
            .collect();
        Stack { layers }
    }

    /// A file of another depth is named by its layer count, deeper or shallower, also where
    /// its keys lack the prefix the key map writes (`layers.N.w`, not `file.layers.N.w`); a
    /// file with other keys besides, or of another width too, is another architecture's.
    #[test]
    fn a_file_of_another_depth_names_its_layer_count() {
        let device = Device::default();
        let file = Path::new("m.safetensors");
        let weights = |depth: usize| -> HashMap<String, Weight> {
            collect(&stack(depth, &device)).into_iter().collect()
        };
        let load = |model: usize, file_depth: usize| {
            apply(
                stack(model, &device),
                weights(file_depth),
                &Transposing,
                file,
                &device,
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        assert_eq!(load(3, 3), Ok(()));
        let deeper = load(2, 3).unwrap_err();
        assert!(
            deeper.contains("holds 3 layer(s) where the config has 2 (the model's `layers.N`)"),
            "{deeper}"
        );
        let shallower = load(3, 2).unwrap_err();
        assert!(
            shallower.contains("holds 2 layer(s) where the config has 3"),
            "{shallower}"
        );
        let mut other = weights(3);
        other.insert("x".into(), Weight::new("x".into(), vec![1], vec![0.0]));
        let err = apply(stack(2, &device), other, &Transposing, file, &device)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not use: layers.2.w, x"), "{err}");
        let mut wider = weights(3);
        for w in wider.values_mut() {
            *w = Weight::new(w.key.clone(), vec![2, 4], vec![0.0; 8]);
        }
        let err = apply(stack(2, &device), wider, &Transposing, file, &device)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not use: layers.2.w"), "{err}");
    }

    /// An integer tensor (a quantized file's codes) under a float parameter's name is refused,
    /// not loaded as its integer values.
    #[test]
    fn integer_codes_never_load_as_a_float_parameter() {
        use safetensors::tensor::TensorView;
        let device = Device::default();
        let path = temp_path("int8.safetensors");
        let codes = [1u8, 2, 3, 4, 5, 6];
        let view = TensorView::new(Dtype::I8, vec![2, 3], &codes).unwrap();
        safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
        let weights = read_safetensors(&path)
            .unwrap()
            .into_iter()
            .map(|w| (w.key.clone(), w))
            .collect();
        std::fs::remove_file(&path).unwrap();
        let model = OneMatrix {
            w: Param::from_tensor(Tensor::zeros([2, 3], &device)),
        };
        let err = apply(model, weights, &OwnNames, &path, &device)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor `w` holds I8 values where the model has a float parameter"),
            "{err}"
        );
    }

    /// Integer and bool buffers (GPT-2's causal mask, saved as uint8 or bool by older
    /// transformers) read as their values, for the loaders to skip or use; a dtype no
    /// checkpoint's weights take is named.
    #[test]
    fn integer_and_bool_buffers_read_as_their_values() {
        use safetensors::tensor::TensorView;
        let path = temp_path("buffers.safetensors");
        let (mask, signed, ints) = (
            [1u8, 0, 1],
            [(-2i8) as u8, 3],
            [7i32, -9].map(i32::to_le_bytes).concat(),
        );
        let views = [
            (
                "h.0.attn.bias",
                TensorView::new(Dtype::BOOL, vec![3], &mask),
            ),
            ("h.1.attn.bias", TensorView::new(Dtype::U8, vec![3], &mask)),
            ("i8", TensorView::new(Dtype::I8, vec![2], &signed)),
            ("i32", TensorView::new(Dtype::I32, vec![2], &ints)),
        ]
        .map(|(key, view)| (key, view.unwrap()));
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let read: BTreeMap<String, Vec<f32>> = read_safetensors(&path)
            .unwrap()
            .into_iter()
            .map(|w| (w.key, w.values))
            .collect();
        assert_eq!(read["h.0.attn.bias"], [1.0, 0.0, 1.0]);
        assert_eq!(read["h.1.attn.bias"], [1.0, 0.0, 1.0]);
        assert_eq!(read["i8"], [-2.0, 3.0]);
        assert_eq!(read["i32"], [7.0, -9.0]);

        let u16s = [1u8, 0];
        let view = TensorView::new(Dtype::U16, vec![1], &u16s).unwrap();
        safetensors::serialize_to_file([("odd", view)], None, &path).unwrap();
        let err = read_safetensors(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(err.contains("`odd` has dtype U16"), "{err}");
    }

    #[test]
    fn a_streamed_file_reads_back_whatever_order_its_tensors_came_in() {
        let path = temp_path("stream.safetensors");
        let params = [("b".to_string(), vec![3]), ("w".to_string(), vec![2, 3])];
        let mut saver = Saver::create(&path, &Transposing, &params).unwrap();
        saver
            .put("w", &[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        saver.put("b", &[3], vec![-1.0, 0.5, 7.0]).unwrap();
        saver.finish().unwrap();
        let mut read = read_safetensors(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        read.sort_by(|a, b| a.key.cmp(&b.key));
        let transposed = vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0];
        assert_eq!(
            read,
            vec![
                Weight::new("file.b".into(), vec![3], vec![-1.0, 0.5, 7.0]),
                Weight::new("file.w".into(), vec![3, 2], transposed.clone()),
                Weight::new("tied".into(), vec![3, 2], transposed),
            ]
        );
    }

    #[test]
    fn an_unfinished_file_is_never_left_under_its_name() {
        let path = temp_path("unfinished.safetensors");
        let partial = temp_path("unfinished.safetensors.partial");
        let plan = [("a".to_string(), vec![2]), ("b".to_string(), vec![1])];
        let mut writer = SafetensorsWriter::create(&path, &plan).unwrap();
        writer.write("a", &[1.0, 2.0]).unwrap();
        assert!(partial.exists());
        let err = writer.finish().unwrap_err().to_string();
        assert!(err.contains("never written: b"), "{err}");
        assert!(!path.exists() && !partial.exists());

        let mut writer = SafetensorsWriter::create(&path, &plan).unwrap();
        let err = writer.write("a", &[1.0]).unwrap_err().to_string();
        assert!(err.contains("`a`: 1 values for 2 planned"), "{err}");
        let err = writer.write("c", &[1.0]).unwrap_err().to_string();
        assert!(err.contains("`c` is not in the file's plan"), "{err}");
        drop(writer);
        assert!(!path.exists() && !partial.exists());

        // A directory where the file goes: refused at once, or (made while the file was
        // written) by the rename, which leaves no partial file behind.
        std::fs::create_dir_all(&path).unwrap();
        let err = SafetensorsWriter::create(&path, &plan).err().unwrap();
        assert!(err.to_string().contains("it is a directory"), "{err}");
        std::fs::remove_dir(&path).unwrap();
        let mut writer = SafetensorsWriter::create(&path, &plan).unwrap();
        writer.write("a", &[1.0, 2.0]).unwrap();
        writer.write("b", &[3.0]).unwrap();
        std::fs::create_dir_all(path.join("taken")).unwrap();
        writer.finish().unwrap_err();
        assert!(!partial.exists());
        std::fs::remove_dir_all(&path).unwrap();
    }
}
