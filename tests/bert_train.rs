//! BERT and BigBird through the runner with padded batches: a sharded run over thread ranks
//! (ZeRO-3's re-gathered blocks read the padding mask too) equals a single-device run with the
//! same global batch, and a tiny model learns a toy task. BigBird's training-time random
//! blocks are redrawn identically when ZeRO-3 with checkpointing recomputes a block.

mod common;

use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead, BertInput};
use burnscale::bigbird::{BigBird, BigBirdConfig};
use burnscale::nn::BlockModel;
use burnscale::tasks::{SequenceClassifier, TextClassification};
use burnscale::train::{Batch, BatchPart, RunSummary, Score, TrainArgs, TrainTask, train};
use common::{assert_same, assert_steps_close, seeded_model, steps};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sequences of 3 to 12 tokens (`[CLS]`=2 ... `[SEP]`=3, padding 0); the label says whether
/// token 7 occurs.
fn data(n: usize, seed: u64) -> Vec<(Vec<i64>, i64)> {
    data_of_lengths(n, 1..11, seed)
}

fn data_of_lengths(n: usize, lengths: std::ops::Range<usize>, seed: u64) -> Vec<(Vec<i64>, i64)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(lengths.clone());
            let mut seq = vec![2];
            seq.extend((0..len).map(|_| rng.random_range(5..20)));
            seq.push(3);
            let label = seq.contains(&7) as i64;
            (seq, label)
        })
        .collect()
}

fn run(flags: &[&str]) -> (Bert, RunSummary) {
    let config = BertConfig::tiny()
        .with_dropout(0.0)
        .with_head(BertHead::SequenceClassification { num_labels: 2 });
    let model = seeded_model(3, |device| Bert::new(&config, device).unwrap());
    run_task(model, data(512, 1), data(128, 2), flags)
}

fn run_task<M: SequenceClassifier>(
    model: M,
    train_set: Vec<(Vec<i64>, i64)>,
    test_set: Vec<(Vec<i64>, i64)>,
    flags: &[&str],
) -> (M, RunSummary) {
    let mut args = TrainArgs::from_flags(flags).unwrap();
    args.gather_model = true;
    let mut task = TextClassification::new(train_set, test_set, 0, args.batch_size, 3).unwrap();
    let device = Device::default().autodiff();
    let (model, summary) = train(model, &mut task, &args, &device).unwrap();
    (model.expect("asked for the whole model"), summary)
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
    let (single, single_run) = run(&[&common[..], &["--batch-size", "8"]].concat());
    for strategy in ["zero3", "zero2"] {
        let flags = [
            "--strategy",
            strategy,
            "--devices",
            "2",
            "--batch-size",
            "4",
        ];
        let (sharded, sharded_run) = run(&[&common[..], &flags[..]].concat());
        assert_same(&single, &sharded, strategy);
        // The clipped updates cannot tell a gradient from twice it; the norms can.
        assert_steps_close(&steps(&sharded_run), &steps(&single_run));
    }
}

#[test]
fn bigbird_block_sparse_zero3_recomputes_the_same_random_blocks() {
    // 58 to 69 tokens: block-sparse for the tiny config (from 57 on), random blocks drawn in
    // training. One rank, as only there does a rank's stream equal the single-device one.
    // At this init attention is near uniform, so this checks the plumbing (mask, sparse
    // kernel, recomputation); that a rewound stream redraws the same blocks is checked on
    // the kernel itself (`attention::tests`).
    let config = BigBirdConfig::tiny().with_num_labels(2);
    let build = || seeded_model(3, |device| BigBird::new(&config, device).unwrap());
    let common = [
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
    ];
    let data = || {
        (
            data_of_lengths(64, 58..70, 1),
            data_of_lengths(8, 58..70, 2),
        )
    };
    let (train_set, test_set) = data();
    let (single, _) = run_task(build(), train_set, test_set, &common);
    let (train_set, test_set) = data();
    let zero3 = [
        &common[..],
        &["--strategy", "zero3", "--checkpoint-activations"],
    ]
    .concat();
    let (sharded, _) = run_task(build(), train_set, test_set, &zero3);
    assert_same(&single, &sharded, "bigbird zero3");
}

/// BigBird's classifier reads the first token, not the pooler (HF's
/// `BigBirdForSequenceClassification`), so backward never reaches the pooler: as in PyTorch and
/// the plain Burn loop, the optimizer leaves it as it was (AdamW's decoupled decay too), under
/// every strategy, while it trains the rest.
#[test]
fn a_parameter_backward_never_reaches_is_not_stepped() {
    let config = BigBirdConfig::tiny().with_num_labels(2);
    let build = || seeded_model(3, |device| BigBird::new(&config, device).unwrap());
    let values = |p: &burn::module::Param<Tensor<2>>| -> Vec<f32> {
        p.val().into_data().try_into_vec::<f32>().unwrap()
    };
    let fresh = build();
    let adamw = [
        "--optimizer",
        "adamw",
        "--weight-decay",
        "0.1",
        "--lr",
        "0.01",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
    ];
    for sharded in [
        &[][..],
        &["--strategy", "zero2", "--devices", "2"],
        &["--strategy", "zero3", "--devices", "2"],
    ] {
        let flags = [&adamw[..], sharded].concat();
        let (trained, _) = run_task(build(), data(64, 1), data(8, 2), &flags);
        let what = flags.join(" ");
        let pooler = values(&trained.pooler.weight) == values(&fresh.pooler.weight);
        assert!(pooler, "{what}: the pooler was stepped");
        let head = |m: &BigBird| values(&m.classifier.as_ref().expect("a head").dense.weight);
        assert!(
            head(&trained) != head(&fresh),
            "{what}: the head did not train"
        );
    }
}

/// A sequence the model cannot read (longer than the position table, or a token outside
/// the vocabulary) stops the run before its first step with an error naming the example.
#[test]
fn examples_the_model_cannot_read_are_named_before_training() {
    let config = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    // Seeded under the lock the other tests' models are built under: an unseeded build
    // beside them would draw from the backend's generator they seed.
    let model = seeded_model(5, |device| Bert::new(&config, device).unwrap());
    let args = TrainArgs::from_flags(&["--max-steps", "1"]).unwrap();
    let too_long = (vec![5; config.max_position_embeddings + 1], 0);
    let out_of_vocab = (vec![2, config.vocab_size as i64, 3], 1);
    for (train_set, test_set, expected) in [
        (
            vec![too_long],
            data(2, 2),
            "training sequence 0: a sequence of 41 tokens",
        ),
        (
            data(3, 1),
            vec![out_of_vocab],
            "test sequence 0: token id 99 is outside",
        ),
    ] {
        let mut task = TextClassification::new(train_set, test_set, 0, 1, 3).unwrap();
        let device = Device::default().autodiff();
        let err = train(model.clone(), &mut task, &args, &device).unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
}

#[test]
fn tiny_bert_learns_a_toy_task() {
    let (_, summary) = run(&["--max-steps", "150", "--batch-size", "32", "--lr", "2e-3"]);
    let accuracy = summary.accuracy.unwrap();
    // The majority class is about 55%.
    assert!(accuracy > 0.8, "test accuracy {accuracy}");
}

/// A masked-LM head reads the word embeddings too, so ZeRO-3 gathers the embeddings' unit for
/// the head as well (kept gathered, the head reads the embeddings' gathered table): two SGD
/// steps on 2 thread ranks (half the batch each) leave the same model as one rank on the
/// whole batch, with each unit resharded after forward or kept gathered until its backward;
/// under bf16-mixed, kept gathered leaves the same model as resharded (the same bf16 values
/// gathered, read from another copy).
#[test]
fn zero3_gathers_the_embeddings_for_a_tied_decoder() {
    use burnscale::bert::BertInput;
    use burnscale::collective::{run_ranks, threads::DEFAULT_TIMEOUT};
    use burnscale::precision::{Precision, ScalerConfig};
    use burnscale::shard::{Sharded, Strategy};
    use burnscale::train::ParamOptimizer;

    let config = BertConfig::tiny()
        .with_dropout(0.0)
        .with_head(BertHead::MaskedLm);
    let device = Device::default().autodiff();
    let (batch, t) = (4, 6);
    let ids: Vec<i64> = (0..batch * t).map(|i| (5 + i * 7 % 13) as i64).collect();
    // Rows `rows` of the batch: every position predicts its own token.
    let part = |rows: std::ops::Range<usize>| {
        let n = rows.len();
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(ids[rows.start * t..rows.end * t].to_vec(), [n, t]),
            &device,
        );
        let input = BertInput {
            input_ids: ids.clone(),
            token_type_ids: Tensor::zeros([n, t], &device),
            attention_mask: Tensor::ones([n, t], &device),
        };
        (input, ids.reshape([n * t]))
    };
    let train = |strategy: Strategy, world: usize, reshard: bool, precision: Precision| {
        let ranks = run_ranks(world, DEFAULT_TIMEOUT, |comm| {
            let model = seeded_model(5, |device| Bert::new(&config, device).unwrap());
            let sgd = [
                "--optimizer",
                "sgd",
                "--momentum",
                "0",
                "--weight-decay",
                "0",
            ];
            let args = TrainArgs::from_flags(&sgd).unwrap();
            let mut optim = ParamOptimizer::new(&args, 0, &model).unwrap();
            let mut engine = Sharded::new(strategy, model, comm, &device)
                .unwrap()
                .precision(precision, ScalerConfig::default());
            if !reshard {
                engine = engine.reshard_after_forward(false).unwrap();
            }
            let rows = batch / world;
            for _ in 0..2 {
                let (input, target) = part(comm.rank() * rows..(comm.rank() + 1) * rows);
                engine
                    .micro_step(input, target, &burnscale_shard::Share::Even(1), true)
                    .unwrap();
                let span = engine.shard_group();
                engine
                    .step(0.0, |m, g| optim.step(0.5, m, g, span).0)
                    .unwrap();
            }
            engine.full_model().unwrap()
        })
        .unwrap();
        ranks.into_iter().next().unwrap().unwrap()
    };
    let single = train(Strategy::Ddp, 1, true, Precision::F32True);
    let sharded = train(Strategy::Zero3, 2, true, Precision::F32True);
    assert_same(&single, &sharded, "zero3 masked LM");
    let kept = train(Strategy::Zero3, 2, false, Precision::F32True);
    assert_same(&single, &kept, "zero3 masked LM, kept gathered");
    let sharded = train(Strategy::Zero3, 2, true, Precision::Bf16Mixed);
    let kept = train(Strategy::Zero3, 2, false, Precision::Bf16Mixed);
    assert_same(
        &sharded,
        &kept,
        "zero3 masked LM, bf16-mixed, kept gathered",
    );
}

/// Checking examples reads shapes only: a lazily built model stays uninitialised (under
/// ZeRO-3 rank 0 initialises it one parameter at a time as it shards it).
#[test]
fn checking_examples_leaves_a_lazy_model_uninitialised() {
    let config = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    let model = Bert::new(&config, &Device::default()).unwrap();
    model.embeddings.check_ids(&[2, 5, 3]).unwrap();
    assert!(!model.embeddings.word_embeddings.weight.is_initialized());
    assert!(!model.embeddings.position_embeddings.weight.is_initialized());
}

/// A task whose rank 0 reads rows of one length and rank 1 rows of another: each rank's part
/// of a padded batch has a length of its own.
#[derive(Clone)]
struct LengthByRank([TextClassification<Bert>; 2]);

impl TrainTask for LengthByRank {
    type Model = Bert;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Bert> {
        self.0[part.rank].next_batch(device, BatchPart::WHOLE)
    }
    fn items(&self, input: &BertInput) -> usize {
        self.0[0].items(input)
    }
    fn counts_tokens(&self) -> bool {
        self.0[0].counts_tokens()
    }
    fn eval_batches(&self) -> usize {
        self.0[0].eval_batches()
    }
    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Bert> {
        self.0[0].eval_batch(k, device)
    }
    fn score(&self, logits: Tensor<2>, target: Tensor<1, Int>) -> Score {
        self.0[0].score(logits, target)
    }
}

/// The summary's model FLOPs are the sum of the ranks' parts, not rank 0's times the world;
/// thread ranks' MFU is theirs together over the CPU's one peak.
#[test]
fn model_flops_sum_the_ranks_parts() {
    let batch = 4;
    let config = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    let model = seeded_model(3, |device| Bert::new(&config, device).unwrap());
    // Rows of 6 tokens on rank 0, 32 on rank 1 ([CLS] and [SEP] among them).
    let task = |len: usize| {
        let rows = || data_of_lengths(32, len..len + 1, 1);
        TextClassification::new(rows(), rows(), 0, batch, 3).unwrap()
    };
    let mut task = LengthByRank([task(4), task(30)]);
    // What one batch of each costs, read before training moves the tasks on.
    let device = Device::default().autodiff();
    let per_sample = (0..2)
        .map(|rank| {
            let (input, _) = task
                .clone()
                .next_batch(&device, BatchPart { rank, world: 2 });
            model.train_flops(&model.flops(), &input)
        })
        .sum::<f64>()
        / (2 * batch) as f64;
    let batch = batch.to_string();
    let args = TrainArgs::from_flags(&[
        "--strategy",
        "zero2",
        "--devices",
        "2",
        "--batch-size",
        &batch,
        "--max-steps",
        "3",
    ])
    .unwrap();
    let (_, summary) = train(model, &mut task, &args, &device).unwrap();
    let measured = summary.model_flops_per_s * 2.0 / summary.samples_per_s.unwrap();
    assert!(
        (measured / per_sample - 1.0).abs() < 1e-6,
        "{measured} model FLOPs a sample, of {per_sample}"
    );
    // The two thread ranks share the CPU and its one measured peak.
    let peak = summary.peak_flops.expect("a CPU probe is timed");
    let mfu = summary.mfu.expect("an MFU where the probe timed its work");
    assert!(
        (mfu / (2.0 * summary.model_flops_per_s / peak) - 1.0).abs() < 1e-9,
        "MFU {mfu} of {} model FLOP/s a rank and a peak of {peak}",
        summary.model_flops_per_s
    );
}
