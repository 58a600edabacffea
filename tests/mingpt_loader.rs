//! GPT-2-layout safetensors: round trip, tied heads, and clear errors for bad files.

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig, GptError, loader};
use burnscale::nn::weights::WeightError;
use safetensors::tensor::TensorView;

fn model() -> Gpt {
    let device = Device::default();
    device.seed(1);
    Gpt::new(&GptConfig::tiny(), &device).unwrap()
}

fn logits(model: &Gpt) -> Vec<f32> {
    let device = Device::default();
    let idx = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 3, 0], [1, 4]), &device);
    model.forward(idx).into_data().try_into_vec().unwrap()
}

/// Rewrites a safetensors file through `edit` on its (key, shape, bytes) entries.
fn rewrite(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit: impl Fn(Vec<(String, Vec<usize>, Vec<u8>)>) -> Vec<(String, Vec<usize>, Vec<u8>)>,
) {
    let bytes = std::fs::read(src).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let entries = file
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let entries = edit(entries);
    let views = entries.iter().map(|(k, s, b)| {
        (
            k.clone(),
            TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, dst).unwrap();
}

#[test]
fn save_then_load_gives_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let original = model();
    loader::save(&original, &path).unwrap();
    let loaded = loader::load(&path, &GptConfig::tiny(), &Device::default()).unwrap();
    assert_eq!(logits(&original), logits(&loaded));
}

#[test]
fn a_gpt2_file_without_lm_head_ties_it_to_wte() {
    let dir = tempfile::tempdir().unwrap();
    let (full, tied) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    loader::save(&model(), &full).unwrap();
    // GPT-2 files store no head, carry its causal-mask buffers, and may drop the prefix.
    rewrite(&full, &tied, |entries| {
        let mut out: Vec<_> = entries
            .into_iter()
            .filter(|(k, _, _)| k != "lm_head.weight")
            .map(|(k, s, b)| (k.trim_start_matches("transformer.").to_string(), s, b))
            .collect();
        out.push(("h.0.attn.bias".into(), vec![1], 0f32.to_le_bytes().to_vec()));
        out
    });
    let loaded = loader::load(&tied, &GptConfig::tiny(), &Device::default()).unwrap();
    let head: Vec<f32> = loaded
        .lm_head
        .weight
        .val()
        .transpose()
        .into_data()
        .try_into_vec()
        .unwrap();
    let wte: Vec<f32> = loaded.wte.weight.val().into_data().try_into_vec().unwrap();
    assert_eq!(head, wte);
}

#[test]
fn bad_files_give_errors_that_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    loader::save(&model(), &good).unwrap();
    let config = GptConfig::tiny();
    let device = Device::default();
    let load = |p: &std::path::Path, c: &GptConfig| loader::load(p, c, &device).unwrap_err();

    let err = load(&dir.path().join("absent.safetensors"), &config);
    assert!(
        matches!(err, GptError::Weights(WeightError::Io { .. })),
        "{err}"
    );

    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(&truncated, &config);
    assert!(err.to_string().contains("truncated"), "{err}");

    let missing = dir.path().join("missing.safetensors");
    rewrite(&good, &missing, |e| {
        e.into_iter()
            .filter(|(k, _, _)| !k.contains("h.1.mlp.c_fc.bias"))
            .collect()
    });
    let err = load(&missing, &config);
    assert!(
        err.to_string().contains("transformer.h.1.mlp.c_fc.bias"),
        "{err}"
    );

    let extra = dir.path().join("extra.safetensors");
    rewrite(&good, &extra, |mut e| {
        e.push(("bert.pooler.dense.weight".into(), vec![1], vec![0; 4]));
        e
    });
    let err = load(&extra, &config);
    assert!(
        err.to_string().contains("bert.pooler.dense.weight"),
        "{err}"
    );

    let other_vocab = GptConfig {
        vocab_size: 12,
        ..config
    };
    let err = load(&good, &other_vocab);
    assert!(err.to_string().contains("vocabulary size"), "{err}");
}
