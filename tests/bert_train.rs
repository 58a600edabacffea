//! BERT through the runner with padded batches: a sharded run over thread ranks (ZeRO-3's
//! re-gathered, recomputed blocks read the padding mask too) equals a single-device run with
//! the same global batch, and a tiny model learns a toy task.

use std::sync::Mutex;

use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead};
use burnscale::tasks::TextClassification;
use burnscale::train::{TrainArgs, train};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sequences of 3 to 12 tokens (`[CLS]`=2 ... `[SEP]`=3, padding 0); the label says whether
/// token 7 occurs.
fn data(n: usize, seed: u64) -> Vec<(Vec<i64>, i64)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(1..11);
            let mut seq = vec![2];
            seq.extend((0..len).map(|_| rng.random_range(5..20)));
            seq.push(3);
            let label = seq.contains(&7) as i64;
            (seq, label)
        })
        .collect()
}

fn run(flags: &[&str]) -> (Bert, Option<f64>) {
    let args = TrainArgs::from_flags(flags).unwrap();
    let device = Device::default().autodiff();
    let config = BertConfig::tiny()
        .with_dropout(0.0)
        .with_head(BertHead::SequenceClassification { num_labels: 2 });
    let model = {
        // Flex seeds one process-wide generator, and tests run in parallel.
        static INIT: Mutex<()> = Mutex::new(());
        let _init = INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        device.seed(3);
        let model = Bert::new(&config, &device).unwrap();
        burnscale::shard::host::materialize(&model);
        model
    };
    let mut task =
        TextClassification::new(data(512, 1), data(128, 2), 0, args.batch_size, 3).unwrap();
    let (model, summary) = train(model, &mut task, &args, &device).unwrap();
    (model, summary.accuracy)
}

#[test]
fn zero3_on_two_ranks_equals_single_with_padding() {
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
    for strategy in ["zero3", "zero2"] {
        let flags = [
            "--strategy",
            strategy,
            "--devices",
            "2",
            "--batch-size",
            "4",
        ];
        let (sharded, _) = run(&[&common[..], &flags[..]].concat());
        let a = burnscale::nn::weights::collect(&single);
        let b = burnscale::nn::weights::collect(&sharded);
        for ((path, x), (_, y)) in a.iter().zip(&b) {
            let scale = x.values.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = x
                .values
                .iter()
                .zip(&y.values)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            // The floor covers the attention key bias, which stays at float noise.
            assert!(
                diff <= 1e-5 * scale + 1e-9,
                "{strategy} {path}: differs by {diff} (scale {scale})"
            );
        }
    }
}

#[test]
fn tiny_bert_learns_a_toy_task() {
    let (_, accuracy) = run(&["--max-steps", "150", "--batch-size", "32", "--lr", "2e-3"]);
    let accuracy = accuracy.unwrap();
    // The majority class is about 55%.
    assert!(accuracy > 0.8, "test accuracy {accuracy}");
}
