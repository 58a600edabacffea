//! Per-block activation checkpointing (`--checkpoint-activations`, full or selective) gives the
//! gradients of the plain Burn step, for every model that exposes its block list, alone and with strategies.
//!
//! One SGD step with learning rate 1 and nothing else (no momentum, decay or clipping) moves
//! each parameter by exactly its gradient, so comparing parameters after it compares
//! gradients. Also: ranks draw dropout masks of their own.

mod common;

use std::collections::BTreeMap;
use std::ops::Range;

use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead, Layout};
use burnscale::bigbird::{BigBird, BigBirdConfig};
use burnscale::images::{self, Preprocess};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::nn::BlockModel;
use burnscale::nn::weights::{self, Weight};
use burnscale::reference::PlainConfig;
use burnscale::tasks::{ImageClassification, NextToken, TextClassification};
use burnscale::train::{Batch, BatchPart, Score, TrainArgs, TrainTask, train};
use burnscale::vit::{Vit, VitConfig};
use common::seeded_model;

const ONE_GRADIENT_STEP: [&str; 14] = [
    "--optimizer",
    "sgd",
    "--lr",
    "1",
    "--momentum",
    "0",
    "--weight-decay",
    "0",
    "--grad-clip",
    "0",
    "--max-steps",
    "1",
    "--schedule",
    "constant",
];

type Parameters = BTreeMap<String, Weight>;

/// Max |a - b| over all parameters, as a fraction of the largest step `a` took from `start`.
fn difference(start: &Parameters, a: &Parameters, b: &Parameters) -> f32 {
    let (mut worst, mut largest) = (0f32, 0f32);
    for (path, p0) in start {
        let (a, b) = (&a[path].values, &b[path].values);
        for ((x0, x), y) in p0.values.iter().zip(a).zip(b) {
            largest = common::nan_max(largest, (x0 - x).abs());
            worst = common::nan_max(worst, (x - y).abs());
        }
    }
    assert!(largest > 0.0, "the step moved nothing");
    worst / largest
}

/// The parameters after the runner's one gradient step with `flags` added, `task` drawing
/// `batch` samples a rank.
fn run<T: TrainTask>(model: T::Model, mut task: T, batch: usize, flags: &[&str]) -> Parameters {
    let mut args = TrainArgs::from_flags(&[&ONE_GRADIENT_STEP[..], flags].concat()).unwrap();
    args.batch_size = batch;
    args.gather_model = true;
    let device = Device::default().autodiff();
    let (trained, _) = train(model, &mut task, &args, &device).unwrap();
    weights::collect(&trained.expect("asked for the whole model"))
}

/// The parameters after one gradient step of the plain Burn loop, dropping what rank 0 of the
/// runner's run with the same seed drops.
fn plain<T: TrainTask>(model: T::Model, mut task: T) -> Parameters {
    let args = TrainArgs::from_flags(&ONE_GRADIENT_STEP).unwrap();
    burnscale::nn::dropout::seed(args.seed);
    let device = Device::default().autodiff();
    let trained = PlainConfig::from_args(&args)
        .unwrap()
        .train(model, &mut task, &device)
        .1;
    weights::collect(&trained)
}

/// Checkpointed gradients equal plain ones: one step of the plain Burn loop
/// (`burnscale::reference`) against the runner's with and without `--checkpoint-activations`
/// (or `--checkpoint-blocks 1`) on one rank (alone and as ddp), and on two ranks (zero2, each rank drawing its own dropout
/// masks) the checkpointed run against the same strategy without checkpointing. `model` builds
/// the model with a dropout rate, `task` the task at a per-rank batch size. Where `sharded`,
/// also ZeRO-2 and ZeRO-3 on two ranks, each reading half the batch, against the plain step
/// without dropout (each rank draws masks of its own).
fn check<T: TrainTask>(
    name: &str,
    model: impl Fn(f64) -> T::Model,
    task: impl Fn(usize) -> T,
    sharded: bool,
) {
    let run =
        |dropout: f64, batch: usize, flags: &[&str]| run(model(dropout), task(batch), batch, flags);
    let plain = |dropout: f64| plain(model(dropout), task(BATCH));
    let (start, with_dropout) = (weights::collect(&model(DROPOUT)), plain(DROPOUT));
    let two_ranks = ["--strategy", "zero2", "--devices", "2"];
    let mut cases = Vec::new();
    for extra in [&[][..], &["--strategy", "ddp"]] {
        for checkpoint in CHECKPOINTING {
            let flags = [extra, checkpoint].concat();
            cases.push((
                format!("{flags:?} vs plain"),
                difference(&start, &with_dropout, &run(DROPOUT, BATCH, &flags)),
            ));
        }
    }
    let unchecked = run(DROPOUT, BATCH, &two_ranks);
    let checkpointed = run(
        DROPOUT,
        BATCH,
        &[&two_ranks[..], &["--checkpoint-activations"]].concat(),
    );
    cases.push((
        "zero2 x2 checkpointed vs not".into(),
        difference(&start, &unchecked, &checkpointed),
    ));
    if sharded {
        let (start, without_dropout) = (weights::collect(&model(0.0)), plain(0.0));
        for strategy in ["zero2", "zero3"] {
            for checkpoint in CHECKPOINTING {
                let flags = [&["--strategy", strategy, "--devices", "2"], checkpoint].concat();
                cases.push((
                    format!("{flags:?} vs plain, no dropout"),
                    difference(&start, &without_dropout, &run(0.0, BATCH / 2, &flags)),
                ));
            }
        }
    }
    for (case, diff) in cases {
        eprintln!("{name} {case}: gradients differ by {diff:.1e} (relative)");
        assert!(
            diff < TOLERANCE,
            "{name} {case}: gradients differ by {diff:e} of the largest"
        );
    }
}

/// No block checkpointed, every one, the lowest alone (the blocks above it keeping their
/// graphs: both kinds in one backward), and every one keeping its linears' outputs (its
/// re-run taking them back).
const CHECKPOINTING: [&[&str]; 4] = [
    &[],
    &["--checkpoint-activations"],
    &["--checkpoint-blocks", "1"],
    &["--checkpoint-activations", "--checkpoint-mode", "selective"],
];

/// How far two gradients of the same batch may differ, as a fraction of the largest element:
/// `2^6 u` (3.8e-6, `u` = 2^-24, f32's unit roundoff). Runs on one rank compute the same sums
/// in the same order (measured: 0); two ranks sum each half of the batch apart and average
/// the halves, so an element's error grows with the root of the terms it sums (some
/// hundreds of positions) and the depth of the network (measured: at most 4 u, for minGPT,
/// ViT, BERT, DistilBERT and BigBird). A wrong mask, block or scale moves elements by whole
/// fractions of the largest (a reduce-scatter that sums: 1.0).
const TOLERANCE: f32 = 64.0 * f32::EPSILON / 2.0;

/// The global batch of the checks, and the dropout rate of their models.
const BATCH: usize = 4;
const DROPOUT: f64 = 0.1;

#[test]
fn mingpt() {
    let tokens: Vec<i64> = (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect();
    // Dropout on: the recomputation must drop what the forward dropped.
    check(
        "minGPT",
        |dropout| {
            let config = GptConfig::tiny().with_dropout(dropout);
            seeded_model(1, |d| Gpt::new(&config, d).unwrap())
        },
        |batch| NextToken::new(tokens.clone(), 8, batch, 1).unwrap(),
        true,
    );
}

#[test]
fn vit() {
    let (train_set, test_set) = images::load("digits", None, 0).unwrap();
    let prep = Preprocess {
        size: 32,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    check(
        "ViT",
        |dropout| {
            let config = VitConfig::tiny().with_dropout(dropout);
            seeded_model(2, |d| Vit::new(&config, d).unwrap())
        },
        |batch| {
            let (train, test) = (train_set.clone(), test_set.clone());
            ImageClassification::new(train, test, prep, batch, 64, 1).unwrap()
        },
        true,
    );
}

/// 32 labelled sequences of `min..min + spread` tokens (padded per batch).
fn text(min: usize, spread: usize) -> Vec<(Vec<i64>, i64)> {
    (0..32)
        .map(|i| {
            let seq = (0..min + i % spread)
                .map(|j| (5 + (i * 3 + j) % 90) as i64)
                .collect();
            (seq, (i % 2) as i64)
        })
        .collect()
}

/// A task of which every rank reads the whole batch, as one rank would.
#[derive(Clone)]
struct EveryRankReadsAll<T>(T);

impl<T: TrainTask> TrainTask for EveryRankReadsAll<T> {
    type Model = T::Model;

    fn next_batch(&mut self, device: &Device, _part: BatchPart) -> Batch<T::Model> {
        self.0.next_batch(device, BatchPart::WHOLE)
    }
    fn items(&self, input: &<T::Model as BlockModel>::Input) -> usize {
        self.0.items(input)
    }
    fn counts_tokens(&self) -> bool {
        self.0.counts_tokens()
    }
    fn eval_batches(&self) -> usize {
        self.0.eval_batches()
    }
    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<T::Model> {
        self.0.eval_batch(k, device)
    }
    fn score(
        &self,
        logits: <T::Model as BlockModel>::Logits,
        target: <T::Model as BlockModel>::Target,
    ) -> Score {
        self.0.score(logits, target)
    }
}

/// Ranks draw dropout masks of their own. Two ranks that read the same samples average two
/// gradients of them: without dropout, or with both ranks dropping the same elements, the
/// one gradient the plain step takes on them; with masks of their own, not.
#[test]
fn ranks_drop_elements_of_their_own() {
    let tokens: Vec<i64> = (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect();
    let model = |dropout: f64| {
        let config = GptConfig::tiny().with_dropout(dropout);
        seeded_model(1, |d| Gpt::new(&config, d).unwrap())
    };
    let task = || NextToken::new(tokens.clone(), 8, BATCH, 1).unwrap();
    let two_ranks = ["--strategy", "zero2", "--devices", "2"];
    let differs = |dropout: f64| {
        let alone = plain(model(dropout), task());
        let two = run(model(dropout), EveryRankReadsAll(task()), BATCH, &two_ranks);
        let diff = difference(&weights::collect(&model(dropout)), &alone, &two);
        eprintln!("dropout {dropout}: two ranks on the same samples differ from one by {diff:.1e}");
        diff
    };
    assert!(
        differs(0.0) < TOLERANCE,
        "without dropout two ranks on the same samples step as one"
    );
    let diff = differs(DROPOUT);
    assert!(
        diff > 1e-2,
        "with dropout two ranks on the same samples stepped as one ({diff:e}): they dropped the same elements"
    );
}

/// An encoder classifier of the given layout and seed.
fn encoder(name: &str, base: BertConfig, seed: u64) {
    let head = BertHead::SequenceClassification { num_labels: 2 };
    check(
        name,
        |dropout| {
            let config = base.with_head(head).with_dropout(dropout);
            seeded_model(seed, |d| Bert::new(&config, d).unwrap())
        },
        |batch| TextClassification::<Bert>::new(text(5, 20), text(5, 20), 0, batch, 1).unwrap(),
        true,
    );
}

#[test]
fn bert() {
    encoder("BERT", BertConfig::tiny(), 3);
}

#[test]
fn distilbert() {
    // No token types or pooler; a pre-classifier and its own classifier dropout.
    let config = BertConfig {
        layout: Layout::DistilBert,
        type_vocab_size: 0,
        ..BertConfig::tiny()
    };
    encoder("DistilBERT", config, 5);
}

/// BigBird on sequences of `lengths` (60 tokens and more: block-sparse attention).
fn bigbird_check(name: &str, num_random_blocks: usize, lengths: Range<usize>, sharded: bool) {
    let text = || text(lengths.start, lengths.len());
    check(
        name,
        |dropout| {
            let mut config = BigBirdConfig::tiny()
                .with_num_labels(2)
                .with_dropout(dropout);
            config.num_random_blocks = num_random_blocks;
            seeded_model(4, |d| BigBird::new(&config, d).unwrap())
        },
        |batch| TextClassification::<BigBird>::new(text(), text(), 0, batch, 1).unwrap(),
        sharded,
    );
}

#[test]
fn bigbird() {
    // Random blocks drawn in training, from each rank's own stream: two ranks do not draw the
    // plain step's blocks for their halves of the batch.
    bigbird_check("BigBird", 1, 60..80, false);
}

#[test]
fn bigbird_sharded() {
    // Without random blocks, and with rows of one length (a rank's half of a batch pads to
    // the blocks the whole batch pads to, and has the same last block), what each rank
    // attends to is the plain step's.
    bigbird_check("BigBird, window and global blocks", 0, 64..65, true);
}

#[test]
fn burn_device_checkpointing_trains_through_the_runner() {
    // Burn's own (per-operation) checkpointing is a property of the autodiff device; the
    // runner must keep every tensor it re-wraps on that device's strategy.
    let run = |device: Device| {
        let model = seeded_model(9, |_| {
            Gpt::new(&GptConfig::tiny().with_dropout(0.0), &device).unwrap()
        });
        let tokens: Vec<i64> = (0..2000).map(|i| (i * 5 % 11) as i64).collect();
        let mut task = NextToken::new(tokens, 8, 4, 9).unwrap();
        let args = TrainArgs::from_flags(&[
            "--max-steps",
            "3",
            "--optimizer",
            "sgd",
            "--batch-size",
            "4",
        ])
        .unwrap();
        let (trained, _) = train(model, &mut task, &args, &device).unwrap();
        trained.expect("one device holds the whole model")
    };
    let plain = run(Device::default().autodiff());
    let balanced = run(Device::default().autodiff().gradient_checkpointing());
    common::assert_same(&plain, &balanced, "burn checkpointing");
}
