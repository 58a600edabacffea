//! Labelled images for classification: scikit-learn's 8x8 digits (bundled, see data/digits/)
//! and CIFAR-10's binary batches from disk, resized and normalised for a ViT on the fly.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::prelude::*;
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const DIGITS_GZ: &[u8] = include_bytes!("../data/digits/digits.csv.gz");
const CIFAR_SIDE: usize = 32;
const CIFAR_RECORD: usize = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE;

#[derive(Debug, thiserror::Error)]
pub enum ImageDataError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error(
        "unknown --data `{0}`: use `digits` or `cifar10:DIR` (DIR holds CIFAR-10's data_batch_*.bin and test_batch.bin)"
    )]
    UnknownSource(String),
    #[error("--test-fraction {0} is not in (0, 1)")]
    TestFraction(f64),
    #[error("--test-fraction splits a dataset without a test split; CIFAR-10 has its own")]
    OwnTestSplit,
    #[error(
        "--test-fraction {fraction} with --seed {seed} leaves class {class} out of the {split} set ({test} test images): give a fraction (or a seed) that keeps every class in both"
    )]
    ClassLeftOut {
        fraction: f64,
        seed: u64,
        class: usize,
        split: &'static str,
        test: usize,
    },
}

/// Images of one size, `[n, channels, side, side]` with values in [0, 1], and class ids.
#[derive(Debug, Clone)]
pub struct ImageSet {
    pub channels: usize,
    pub side: usize,
    pub classes: usize,
    pixels: Arc<Vec<f32>>,
    labels: Arc<Vec<i64>>,
}

/// How images become model input: resized (bilinear) to `size`, gray replicated to RGB, then
/// normalised per channel.
#[derive(Debug, Clone, Copy)]
pub struct Preprocess {
    pub size: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl ImageSet {
    fn new(
        channels: usize,
        side: usize,
        classes: usize,
        pixels: Vec<f32>,
        labels: Vec<i64>,
    ) -> Self {
        Self {
            channels,
            side,
            classes,
            pixels: Arc::new(pixels),
            labels: Arc::new(labels),
        }
    }

    /// The 1,797 bundled digits (8x8 gray, 10 classes).
    pub fn digits() -> Result<Self, ImageDataError> {
        let path = Path::new("data/digits/digits.csv.gz (bundled)");
        let format = |reason: String| ImageDataError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let mut text = String::new();
        flate2::read::GzDecoder::new(DIGITS_GZ)
            .read_to_string(&mut text)
            .map_err(|e| format(e.to_string()))?;
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for (row, line) in text.lines().enumerate() {
            let values: Vec<f32> = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<Result<_, _>>()
                .map_err(|e| format(format!("row {row}: {e}")))?;
            if values.len() != 65 {
                return Err(format(format!(
                    "row {row} has {} values, not 65",
                    values.len()
                )));
            }
            pixels.extend(values[..64].iter().map(|v| v / 16.0));
            labels.push(values[64] as i64);
        }
        Ok(Self::new(1, 8, 10, pixels, labels))
    }

    /// CIFAR-10 from the binary version's directory: `data_batch_1..5.bin` (those present) for
    /// training, `test_batch.bin` for testing.
    pub fn cifar10(dir: &Path) -> Result<(Self, Self), ImageDataError> {
        let train = cifar10_batches(dir);
        if train.is_empty() {
            return Err(ImageDataError::Io {
                path: dir.join("data_batch_1.bin"),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no CIFAR-10 training batch (data_batch_*.bin) in this directory",
                ),
            });
        }
        let read_all = |paths: &[PathBuf]| -> Result<Self, ImageDataError> {
            let (mut pixels, mut labels) = (Vec::new(), Vec::new());
            for path in paths {
                let (p, l) = read_cifar10_batch(path)?;
                pixels.extend(p);
                labels.extend(l);
            }
            Ok(Self::new(3, CIFAR_SIDE, 10, pixels, labels))
        };
        Ok((read_all(&train)?, read_all(&[dir.join("test_batch.bin")])?))
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// A fixed shuffle (seeded) split into `(train, test)`, `test_fraction` of the images in test.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Self, Self) {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let n_test = ((self.len() as f64) * test_fraction).round() as usize;
        let (test, train) = order.split_at(n_test.min(self.len()));
        (self.subset(train), self.subset(test))
    }

    fn subset(&self, indices: &[usize]) -> Self {
        let per = self.channels * self.side * self.side;
        let pixels = indices
            .iter()
            .flat_map(|&i| self.pixels[i * per..(i + 1) * per].iter().copied())
            .collect();
        let labels = indices.iter().map(|&i| self.labels[i]).collect();
        Self::new(self.channels, self.side, self.classes, pixels, labels)
    }

    /// Images `indices` as model input `[b, 3, size, size]` and their labels `[b]`.
    pub fn batch(
        &self,
        indices: &[usize],
        prep: &Preprocess,
        device: &Device,
    ) -> (Tensor<4>, Tensor<1, Int>) {
        let (c, s) = (self.channels, self.side);
        let per = c * s * s;
        let pixels: Vec<f32> = indices
            .iter()
            .flat_map(|&i| self.pixels[i * per..(i + 1) * per].iter().copied())
            .collect();
        let b = indices.len();
        let mut x = Tensor::<4>::from_data(TensorData::new(pixels, [b, c, s, s]), device);
        if s != prep.size {
            let options = InterpolateOptions::new(InterpolateMode::Bilinear)
                .with_align_corners(false)
                .with_output_size([prep.size, prep.size]);
            x = interpolate(x, options);
        }
        if c == 1 {
            x = x.repeat_dim(1, 3);
        }
        let mean = Tensor::<1>::from_floats(prep.mean, device).reshape([1, 3, 1, 1]);
        let std = Tensor::<1>::from_floats(prep.std, device).reshape([1, 3, 1, 1]);
        let labels: Vec<i64> = indices.iter().map(|&i| self.labels[i]).collect();
        (
            (x - mean) / std,
            Tensor::from_data(TensorData::new(labels, [b]), device),
        )
    }
}

/// One CIFAR-10 binary batch: records of a label byte and 3x32x32 pixel bytes (planes R, G, B).
pub fn read_cifar10_batch(path: &Path) -> Result<(Vec<f32>, Vec<i64>), ImageDataError> {
    let bytes = std::fs::read(path).map_err(|source| ImageDataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let format = |reason: String| ImageDataError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() || !bytes.len().is_multiple_of(CIFAR_RECORD) {
        return Err(format(format!(
            "{} bytes is not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records (truncated, or CIFAR-100?)",
            bytes.len()
        )));
    }
    let mut pixels = Vec::with_capacity(bytes.len());
    let mut labels = Vec::with_capacity(bytes.len() / CIFAR_RECORD);
    for (i, record) in bytes.chunks_exact(CIFAR_RECORD).enumerate() {
        if record[0] > 9 {
            return Err(format(format!(
                "record {i} has label {}, not 0..9",
                record[0]
            )));
        }
        labels.push(record[0] as i64);
        pixels.extend(record[1..].iter().map(|&v| v as f32 / 255.0));
    }
    Ok((pixels, labels))
}

/// The share of `digits` held out for testing when `--test-fraction` is not given.
pub const TEST_FRACTION: f64 = 0.2;

/// `(train, test)` for a `--data` value: `digits` (split with `test_fraction`, by default
/// [`TEST_FRACTION`], seeded) or `cifar10:DIR` (its own test batch: a fraction is refused).
pub fn load(
    source: &str,
    test_fraction: Option<f64>,
    seed: u64,
) -> Result<(ImageSet, ImageSet), ImageDataError> {
    match (source.split_once(':'), test_fraction) {
        (None, f) if source == "digits" => {
            let f = f.unwrap_or(TEST_FRACTION);
            if !(f > 0.0 && f < 1.0) {
                return Err(ImageDataError::TestFraction(f));
            }
            let (train, test) = ImageSet::digits()?.split(f, seed);
            let missing =
                |set: &ImageSet| (0..set.classes).find(|&c| !set.labels.contains(&(c as i64)));
            let left_out = [("training", &train), ("test", &test)]
                .into_iter()
                .find_map(|(split, set)| missing(set).map(|class| (split, class)));
            match left_out {
                Some((split, class)) => Err(ImageDataError::ClassLeftOut {
                    fraction: f,
                    seed,
                    class,
                    split,
                    test: test.len(),
                }),
                None => Ok((train, test)),
            }
        }
        (Some(("cifar10", _)), Some(_)) => Err(ImageDataError::OwnTestSplit),
        (Some(("cifar10", dir)), None) => ImageSet::cifar10(&expand_home(dir)),
        _ => Err(ImageDataError::UnknownSource(source.to_string())),
    }
}

/// CIFAR-10's training batches present in `dir`, in order.
fn cifar10_batches(dir: &Path) -> Vec<PathBuf> {
    (1..=5)
        .map(|i| dir.join(format!("data_batch_{i}.bin")))
        .filter(|p| p.is_file())
        .collect()
}

/// What a run records of its `--data`, `--test-fraction` and the `seed` that draws the split
/// (a checkpoint resumes only on the same; weights saved beside it are not tested on another
/// split of the same images: `check_held_out`): the split as [`load`] resolves it, so that
/// the default fraction given or left out are the same data; for CIFAR-10, which training
/// batches are there (a directory given more or fewer of them is other data; the same
/// batches moved elsewhere are not) and no split, its test batch being its own.
pub fn recorded(source: &str, test_fraction: Option<f64>, seed: u64) -> serde_json::Value {
    match source.split_once(':') {
        Some(("cifar10", dir)) => {
            let batches: Vec<String> = cifar10_batches(&expand_home(dir))
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            serde_json::json!({ "data": "cifar10", "train_batches": batches })
        }
        _ => serde_json::json!({
            "data": source,
            "split": {
                "test_fraction": test_fraction.unwrap_or(TEST_FRACTION),
                "seed": seed,
            },
        }),
    }
}

/// `dir` with a leading `~` read as `$HOME`: the shell does not expand it after `cifar10:`.
fn expand_home(dir: &str) -> PathBuf {
    match (dir.strip_prefix('~'), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => {
            PathBuf::from(home).join(rest.trim_start_matches('/'))
        }
        _ => PathBuf::from(dir),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_leading_tilde_is_home() {
        let home = std::env::var("HOME").unwrap();
        assert_eq!(
            super::expand_home("~/cifar"),
            std::path::PathBuf::from(format!("{home}/cifar"))
        );
        assert_eq!(
            super::expand_home("/data/~x"),
            std::path::PathBuf::from("/data/~x")
        );
        assert_eq!(
            super::expand_home("~user/x"),
            std::path::PathBuf::from("~user/x")
        );
    }

    use super::*;

    #[test]
    fn the_same_split_is_recorded_alike_however_it_was_written() {
        assert_eq!(
            recorded("digits", None, 0),
            recorded("digits", Some(0.2), 0)
        );
        assert_ne!(
            recorded("digits", None, 0),
            recorded("digits", Some(0.3), 0)
        );
        assert_ne!(recorded("digits", None, 0), recorded("digits", None, 1));
        // CIFAR-10 by the training batches there: the same ones anywhere are the same data,
        // one more or one fewer is not.
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for dir in [a.path(), b.path()] {
            for i in [1, 2] {
                std::fs::write(dir.join(format!("data_batch_{i}.bin")), b"").unwrap();
            }
        }
        let of = |dir: &Path| recorded(&format!("cifar10:{}", dir.display()), None, 0);
        assert_eq!(of(a.path()), of(b.path()));
        assert_eq!(of(a.path())["train_batches"].as_array().unwrap().len(), 2);
        std::fs::write(b.path().join("data_batch_3.bin"), b"").unwrap();
        assert_ne!(of(a.path()), of(b.path()));
    }

    #[test]
    fn digits_are_the_bundled_1797() {
        let digits = ImageSet::digits().unwrap();
        assert_eq!((digits.len(), digits.channels, digits.side), (1797, 1, 8));
        let (train, test) = digits.split(0.2, 0);
        assert_eq!((train.len(), test.len()), (1438, 359));
        let mut seen: Vec<i64> = test.labels.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn batches_are_resized_rgb_and_normalised() {
        let device = Device::default();
        let digits = ImageSet::digits().unwrap();
        let prep = Preprocess {
            size: 16,
            mean: [0.5; 3],
            std: [0.5; 3],
        };
        let (x, y) = digits.batch(&[0, 1, 2], &prep, &device);
        assert_eq!(x.dims(), [3, 3, 16, 16]);
        assert_eq!(
            y.into_data().try_into_vec_as::<i64>().unwrap(),
            vec![0, 1, 2]
        );
        // Grey copied to three channels; ink 0 and 16 of 16 normalised to -1 and 1.
        let [red, green, blue] = [0, 1, 2].map(|c| x.clone().narrow(1, c, 1));
        assert!(red.clone().equal(green).all().into_scalar::<bool>());
        assert!(red.equal(blue).all().into_scalar::<bool>());
        let v: Vec<f32> = x.into_data().try_into_vec_as().unwrap();
        let (min, max) = v
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &p| (lo.min(p), hi.max(p)));
        assert_eq!((min, max), (-1.0, 1.0));
    }

    #[test]
    fn cifar10_batches_read_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = Vec::new();
        for label in [3u8, 7] {
            bytes.push(label);
            bytes.extend((0..3 * 32 * 32).map(|i| (i % 256) as u8));
        }
        for name in ["data_batch_1.bin", "test_batch.bin"] {
            std::fs::write(dir.path().join(name), &bytes).unwrap();
        }
        let (train, test) = ImageSet::cifar10(dir.path()).unwrap();
        assert_eq!((train.len(), test.len(), train.channels), (2, 2, 3));
        assert_eq!(*train.labels, vec![3, 7]);
        // The first record's green plane starts after 1024 red values.
        assert_eq!(train.pixels[1024], 0.0);
        assert_eq!(train.pixels[1], 1.0 / 255.0);

        std::fs::write(dir.path().join("test_batch.bin"), &bytes[..5000]).unwrap();
        let err = ImageSet::cifar10(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("test_batch.bin") && err.contains("truncated"),
            "{err}"
        );
        let err = ImageSet::cifar10(&dir.path().join("absent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("data_batch_1.bin"), "{err}");
        assert!(load("mnist", None, 0).is_err());
        // Two test images cannot hold ten classes.
        let err = load("digits", Some(0.001), 0).unwrap_err().to_string();
        assert!(
            err.contains("--test-fraction 0.001 with --seed 0 leaves class ")
                && err.contains(" out of the test set (2 test images)"),
            "{err}"
        );
        let own = load(&format!("cifar10:{}", dir.path().display()), Some(0.5), 0);
        assert!(
            own.unwrap_err()
                .to_string()
                .contains("CIFAR-10 has its own")
        );
        let none = load("digits", Some(0.0), 0).unwrap_err().to_string();
        assert!(
            none.contains("--test-fraction 0 is not in (0, 1)"),
            "{none}"
        );
    }
}
