//! ViT through the runner: it learns the bundled digits (and reports its MFU), and a sharded
//! run over thread ranks equals a single-device run with the same global batch.

mod common;

use burn::prelude::*;
use burnscale::equivalence::seeded_model_on;
use burnscale::images::{self, Preprocess};
use burnscale::nn::BlockModel;
use burnscale::tasks::ImageClassification;
use burnscale::train::{RunSummary, TrainArgs, TrainError, train};
use burnscale::vit::{Vit, VitConfig};
use common::{assert_same, assert_steps_close, seeded_model, steps};

fn config() -> VitConfig {
    VitConfig {
        patch_size: 4,
        ..VitConfig::tiny().with_image_size(16)
    }
}

/// The bundled digits resized to `size` px, in batches of `batch` (evaluated in batches of
/// `eval_batch`).
fn digits(size: usize, batch: usize, eval_batch: usize) -> ImageClassification {
    let (train_set, test_set) = images::load("digits", None, 0).unwrap();
    let prep = Preprocess {
        size,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    ImageClassification::new(train_set, test_set, prep, batch, eval_batch, 5).unwrap()
}

fn run(flags: &[&str]) -> (Vit, RunSummary) {
    let mut args = TrainArgs::from_flags(flags).unwrap();
    args.gather_model = true;
    let device = Device::default().autodiff();
    let model = seeded_model(5, |device| Vit::new(&config(), device).unwrap());
    let mut task = digits(16, args.batch_size, 256);
    let (model, summary) = train(model, &mut task, &args, &device).unwrap();
    (model.expect("asked for the whole model"), summary)
}

#[test]
fn tiny_vit_learns_the_digits() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("metrics.csv");
    let (_, summary) = run(&[
        "--max-steps",
        "300",
        "--batch-size",
        "32",
        "--lr",
        "2e-3",
        "--warmup-steps",
        "20",
        "--eval-interval",
        "100",
        "--metrics-csv",
        csv.to_str().unwrap(),
    ]);
    let accuracy = summary.accuracy.unwrap();
    // Chance is 10%.
    assert!(accuracy > 0.6, "test accuracy {accuracy}");
    // The evaluations on the way, in the step metrics and the CSV's last two columns.
    let evaluated: Vec<_> = summary
        .history
        .iter()
        .filter_map(|m| Some((m.step, m.val_loss?, m.accuracy?)))
        .collect();
    assert_eq!(
        evaluated.iter().map(|e| e.0).collect::<Vec<_>>(),
        [100, 200, 300]
    );
    assert_eq!(evaluated[2].2, accuracy);
    let rows = std::fs::read_to_string(&csv).unwrap();
    let columns: Vec<_> = rows
        .lines()
        .skip(1)
        .filter_map(|row| {
            let cells: Vec<&str> = row.split(',').collect();
            Some((
                cells[0].parse::<usize>().ok()?,
                cells[7].parse::<f64>().ok()?,
                cells[8].parse::<f64>().ok()?,
            ))
        })
        .collect();
    assert_eq!(columns, evaluated, "{rows}");
    // A ViT counts samples; its model FLOPs are an image's times the samples a second.
    let mfu = summary.mfu.expect("an MFU where the probe timed its work");
    assert!(mfu > 0.0 && mfu < 1.0, "MFU {mfu}");
    let device = Device::default();
    let model = Vit::new(&config(), &device).unwrap(); // lazy: nothing is drawn
    let image = Tensor::<4>::zeros([1, 3, 16, 16], &device);
    let per_image = model.train_flops(&model.flops(), &image);
    let per_s = per_image * summary.samples_per_s.unwrap();
    assert!(
        (summary.model_flops_per_s / per_s - 1.0).abs() < 1e-9,
        "{} model FLOP/s, {per_image} an image at {:?} images/s",
        summary.model_flops_per_s,
        summary.samples_per_s
    );
}

/// Images resized to another size than the model's are refused before any step, naming
/// both sizes.
#[test]
fn images_of_another_size_than_the_models_are_refused() {
    let device = Device::default().autodiff();
    let model = seeded_model(7, |device| Vit::new(&config(), device).unwrap());
    let mut task = digits(32, 4, 8);
    let args = TrainArgs::from_flags(&["--max-steps", "1"]).unwrap();
    let err = train(model, &mut task, &args, &device).unwrap_err();
    assert!(
        matches!(&err, TrainError::InvalidData(e) if e.contains("[1, 3, 32, 32]") && e.contains("[batch, 3, 16, 16]")),
        "{err}"
    );
}

/// The positions MFU counts are what `embed` makes: each 16 px image's 16 patches of 4 px and
/// its class token.
#[test]
fn positions_are_the_patches_and_the_class_token() {
    let device = Device::default();
    // Built as the other tests build theirs: a model initialised from the process-wide
    // generator while theirs were being built would change their weights.
    let model = seeded_model_on(6, &device, |d| Vit::new(&config(), d).unwrap());
    let pixels = Tensor::<4>::zeros([3, 3, 16, 16], &device);
    let [b, seq, _] = BlockModel::embed(&model, pixels.clone()).0.dims();
    assert_eq!(model.extent(&pixels), [b, seq]);
    assert_eq!([b, seq], [3, 17]);
}

/// ViT-B/16 at 224 px costs the 17.6 GFLOPs (multiply-adds) a forward pass that DeiT's table
/// (Touvron et al. 2021, table 1) gives it: a forward and backward pass is 6 FLOPs per
/// multiply-add of the forward's 3.
#[test]
fn vit_b_16_costs_what_deit_says() {
    let device = Device::default();
    // Lazy: its parameters are never drawn (the count reads their shapes).
    let model = Vit::new(&VitConfig::vit_b_16(), &device).unwrap();
    let pixels = Tensor::<4>::zeros([1, 3, 224, 224], &device);
    let forward_macs = model.train_flops(&model.flops(), &pixels) / 6.0;
    assert!(
        (forward_macs / 17.6e9 - 1.0).abs() < 0.003,
        "ViT-B/16: {forward_macs:e} multiply-adds a forward pass, DeiT 17.6e9"
    );
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
    let (single, single_run) = run(&[&common[..], &["--batch-size", "8"]].concat());
    let sharded_flags = ["--strategy", "zero3", "--devices", "2", "--batch-size", "4"];
    let (sharded, sharded_run) = run(&[&common[..], &sharded_flags[..]].concat());
    assert_same(&single, &sharded, "zero3");
    // The clipped updates cannot tell a gradient from twice it; the norms can.
    assert_steps_close(&steps(&sharded_run), &steps(&single_run));
}

/// Adafactor's state of the patch projection's `[d, 3, p, p]` kernel, whose column moment has
/// a row per output channel (each rank's own under ZeRO), resumes at another world size: a
/// zero2 x 2 run's step-2 checkpoint resumed on one device takes the uninterrupted run's
/// steps 3 and 4 (saved as rank 0's rows alone, it broke the resumed step).
#[test]
fn an_adafactor_checkpoint_of_a_convolution_resumes_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().to_str().unwrap();
    let common = [
        "--optimizer",
        "adafactor",
        "--max-steps",
        "4",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "2",
    ];
    let sharded = ["--strategy", "zero2", "--devices", "2", "--batch-size", "4"];
    let (_, uninterrupted) = run(&[&common[..], &sharded].concat());
    std::fs::remove_dir_all(dir.path().join("step-00000004")).unwrap();
    let (_, resumed) = run(&[&common[..], &["--batch-size", "8", "--resume"]].concat());
    let (want, got) = (steps(&uninterrupted), steps(&resumed));
    assert_eq!(got.iter().map(|s| s.0).collect::<Vec<_>>(), [3, 4]);
    assert_steps_close(&got, &want[2..]);
}
