//! ViT through the runner: it learns the bundled digits, and a sharded run over thread ranks
//! equals a single-device run with the same global batch.

mod common;

use burn::prelude::*;
use burnscale::images::{self, Preprocess};
use burnscale::tasks::ImageClassification;
use burnscale::train::{TrainArgs, train};
use burnscale::vit::{Vit, VitConfig};
use common::{assert_same, seeded_model};

fn config() -> VitConfig {
    VitConfig {
        patch_size: 4,
        ..VitConfig::tiny().with_image_size(16)
    }
}

fn run(flags: &[&str]) -> (Vit, Option<f64>) {
    let mut args = TrainArgs::from_flags(flags).unwrap();
    args.gather_model = true;
    let device = Device::default().autodiff();
    let model = seeded_model(5, |device| Vit::new(&config(), device).unwrap());
    let (train_set, test_set) = images::load("digits", 0.2, 0).unwrap();
    let prep = Preprocess {
        size: 16,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    let mut task =
        ImageClassification::new(train_set, test_set, prep, args.batch_size, 256, 5).unwrap();
    let (model, summary) = train(model, &mut task, &args, &device).unwrap();
    (model.expect("asked for the whole model"), summary.accuracy)
}

#[test]
fn tiny_vit_learns_the_digits() {
    let (_, accuracy) = run(&[
        "--max-steps",
        "300",
        "--batch-size",
        "32",
        "--lr",
        "2e-3",
        "--warmup-steps",
        "20",
    ]);
    let accuracy = accuracy.unwrap();
    // Chance is 10%.
    assert!(accuracy > 0.6, "test accuracy {accuracy}");
}

#[test]
fn zero3_on_two_ranks_equals_single() {
    // SGD: the attention key bias has an exactly-zero true gradient, whose float noise Adam
    // would normalise into visible updates (see src/equivalence.rs).
    let common = [
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--max-steps",
        "3",
        "--grad-clip",
        "0.5",
    ];
    let (single, _) = run(&[&common[..], &["--batch-size", "8"]].concat());
    let sharded_flags = ["--strategy", "zero3", "--devices", "2", "--batch-size", "4"];
    let (sharded, _) = run(&[&common[..], &sharded_flags[..]].concat());
    assert_same(&single, &sharded, "zero3");
}
