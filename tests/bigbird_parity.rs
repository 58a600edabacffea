//! BigBird parity: all-MiniLM-L6-v2 loaded into BigBird in `original_full` and `block_sparse`
//! modes, and a random-init tiny block-sparse classifier, against HF's BigBird in eval mode
//! (`scripts/gen_bigbird_fixtures.py`), 1e-4 max-abs over every position (padded ones too:
//! block-sparse attention zeroes their outputs, as HF's does).

mod common;

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
use burnscale::bert::{BertConfig, BertInput};
use burnscale::bigbird::loader::{self, Head};
use burnscale::bigbird::{AttentionType, BigBirdConfig};
use burnscale::nn::weights::Weight;
use burnscale::pretrained;
use common::{fixture, max_abs_diff};

const TOLERANCE: f32 = 1e-4;

fn input(io: &HashMap<String, Weight>, device: &Device) -> BertInput {
    let ints = |w: &Weight| {
        let values: Vec<i64> = w.values.iter().map(|&v| v as i64).collect();
        Tensor::<2, Int>::from_data(TensorData::new(values, w.shape.clone()), device)
    };
    let ids = ints(&io["input.input_ids"]);
    BertInput {
        token_type_ids: ids.zeros_like(),
        attention_mask: ints(&io["input.attention_mask"]),
        input_ids: ids,
    }
}

#[test]
fn minilm_in_bigbird_matches_transformers_in_both_modes() {
    let device = Device::default();
    let files = pretrained::minilm_files()
        .unwrap_or_else(|e| panic!("the MiniLM weights are needed for this test: {e}"));
    let (_, io) = fixture("bigbird", "minilm.safetensors");
    for (mode, key) in [
        (AttentionType::OriginalFull, "output.original_full"),
        (AttentionType::BlockSparse, "output.block_sparse"),
    ] {
        let config = BigBirdConfig {
            encoder: BertConfig::from_hf_json(&files.config).unwrap(),
            attention_type: mode,
            block_size: 16,
            num_random_blocks: 2,
            num_labels: None,
        };
        let model = loader::load(&files.weights, &config, Head::Load, &device).unwrap();
        assert_eq!(model.is_sparse(250), mode == AttentionType::BlockSparse);
        let hidden = model.hidden_states(input(&io, &device));
        let diff = max_abs_diff(hidden, &io[key]);
        eprintln!("MiniLM as BigBird {mode:?}: max-abs difference {diff:.2e}");
        assert!(diff < TOLERANCE, "{mode:?} differs by {diff}");
    }
}

#[test]
fn tiny_block_sparse_classifier_matches_transformers() {
    let device = Device::default();
    let (tensors, io) = fixture("bigbird", "tiny.safetensors");
    let config = BigBirdConfig::tiny().with_num_labels(3);
    let model = loader::load_weights(
        tensors,
        Path::new("tiny.safetensors"),
        &config,
        Head::Load,
        &device,
    )
    .unwrap();
    assert!(model.is_sparse(70));
    let logits = model.logits(model.hidden_states(input(&io, &device)));
    let reference = &io["output.logits"];
    let ours: Vec<f32> = logits.into_data().try_into_vec_as().unwrap();
    let diff = common::worst_abs_diff(&ours, &reference.values);
    eprintln!("tiny BigBird (block-sparse) logits: max-abs difference {diff:.2e}");
    assert!(diff < TOLERANCE, "logits differ by {diff}");

    // Saved and loaded back: the same logits; a BigBird file is not a ViT.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bigbird.safetensors");
    loader::save(&model, &path).unwrap();
    let again = loader::load(&path, &config, Head::Load, &device).unwrap();
    let a = model.logits(model.hidden_states(input(&io, &device)));
    let b = again.logits(again.hidden_states(input(&io, &device)));
    assert!(a.equal(b).all().into_scalar::<bool>());
    let err = burnscale::vit::loader::load(
        &path,
        &burnscale::vit::VitConfig::tiny(),
        burnscale::vit::loader::Head::Load,
        &device,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("bert.embeddings.word_embeddings.weight"),
        "{err}"
    );
}
