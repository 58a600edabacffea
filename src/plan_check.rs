//! The memory planner against measurement: a minGPT (or, with `--classifier`, `--text` or
//! `--masked-lm`, a BERT text classifier, on sequences of one length or two, or masked-LM;
//! with `--vit`, a ViT on the digits,
//! evaluated at a larger batch than it trains) trained for two steps under a
//! configuration, its planned peak beside the counting allocator's. The tests run the
//! one-rank configurations in-process; `examples/plan_check.rs` runs the sharded ones under
//! mpirun, where each rank is a process and measures its own peak. (Ranks on threads share
//! one process, whose peak moves by a few percent with how their backward passes
//! interleave; the tests check three of them, where the gradient reduction or backward's
//! temporaries set the peak.)

use burn::prelude::*;
use burnscale_bert::{Bert, BertConfig, BertHead, BertInput, Layout};
use burnscale_bigbird::{AttentionType, BigBird, BigBirdConfig};
use burnscale_mingpt::{Gpt, GptConfig};
use burnscale_train::{Batch, BatchPart, RunSummary, Score, TrainArgs, TrainTask, train};
use burnscale_vit::{Vit, VitConfig};

use crate::images::{self, Preprocess};
use crate::tasks::{ImageClassification, NextToken, SequenceClassifier, TextClassification};

/// The most a prediction may be off, as a fraction of the measured peak: the goal
/// beyond its 10% (every configuration here reads within 3%).
pub const TOLERANCE: f64 = 0.05;

/// The check's own flags, first when given: `--vocab N` tokens instead of 65, so that with
/// 8192 the token table and the head (2.1M parameters each) outweigh a block (0.8M), as a
/// BERT's or a GPT-2's do; `--layers N` blocks instead of 4, so that with 24 at batch 1 the
/// model states outweigh the activations, as a large model's do, and the optimizer step
/// (with its gradient clipping) is the peak.
const VOCAB: &str = "--vocab";
const LAYERS: &str = "--layers";
/// `--disk`, after those: the optimizer state on disk between steps (`--offload optimizer
/// --offload-dir` in a directory of the check's own under the system's temporary one).
const DISK: &str = "--disk";
/// `--classifier`, first: a DistilBERT-shaped text classifier instead of the minGPT (BERT's
/// 30522-token table, 4 blocks of width 256, batch 1 x 512 tokens): its head is small and
/// its token table's gradient, dense, comes at the very end of backward, while the
/// activations peak at its top; under ZeRO-3 the table is gathered again for that backward,
/// and its gradient is reduce-scattered last.
const CLASSIFIER: &str = "--classifier";
/// `--masked-lm`, first: the classifier's BERT with a masked-LM head instead, whose decoder
/// reads the token table: its logits span the vocabulary at every position, and under
/// ZeRO-2/3 the head's backward gives the table a whole gradient, held until the embeddings'
/// own backward and reduce-scatter, the step's last.
const MASKED_LM: &str = "--masked-lm";

/// `--bigbird`, first: the classifier as BigBird (block-sparse attention in blocks of 16: 512
/// tokens are past the (5 + 2 x 3) x 16 that sparse attention needs),
/// whose pooler its classification head does not read: no backward reaches it, so the
/// optimizer holds no state for it (a plan that counted it read 2 x 256 x 257 x 4 B over).
const BIGBIRD: &str = "--bigbird";
/// `--text`, first: the classifier's BERT on sequences of unequal length ([`TEXT_TOKENS`]),
/// padded per batch to the longest, as real text is (`bert_classify`'s emails): the first
/// batch drawn is the shorter one, and the two steps reach the longer, which the plan counts.
const TEXT: &str = "--text";
/// `--vit`, first: a ViT (4 blocks of width 256; the bundled digits at 64 pixels in 8-pixel
/// patches, 65 positions) whose evaluation runs the test set in batches of
/// [`VIT_EVAL_BATCH`], as `vit_finetune`'s does, larger than training's: with checkpointing
/// at a small batch the evaluation sets the peak.
const VIT: &str = "--vit";
const VIT_EVAL_BATCH: usize = 128;

/// A planned run: `--plan` on the CPU, where the counting allocator sees the device's memory
/// (the planner does not plan a GPU's pool yet; a `cuda` build on a GPU machine would
/// otherwise run there). Its model is built on `Device::flex()`, the CPU's.
pub const PLANNED_ON_CPU: [&str; 3] = ["--plan", "--accelerator", "cpu"];

/// One rank's configurations: every precision, optimizer and technique (4 blocks of width
/// 256, batch 8 x 128, AdamW, dropout 0.1, unless a flag says otherwise).
pub const ONE_RANK: &[&[&str]] = &[
    &[],
    &["--checkpoint-activations"],
    // The lowest two blocks checkpointed, the two above keeping their graphs.
    &["--checkpoint-blocks", "2"],
    // Checkpointed blocks keeping their linears' outputs too.
    &["--checkpoint-activations", "--checkpoint-mode", "selective"],
    &[
        "--checkpoint-blocks",
        "2",
        "--checkpoint-mode",
        "selective",
        "--precision",
        "bf16-mixed",
    ],
    &[
        "--strategy",
        "zero3",
        "--checkpoint-activations",
        "--checkpoint-mode",
        "selective",
    ],
    &["--checkpoint-blocks", "2", "--precision", "bf16-mixed"],
    // One step: its forward and backward run before the optimizer has made its state.
    &["--max-steps", "1"],
    &["--precision", "bf16-mixed"],
    &["--precision", "bf16-true"],
    &["--precision", "16-mixed", "--accumulate", "2"],
    &["--optimizer", "adam8bit"],
    // The token and position tables' state in 32 bits.
    &["--optimizer", "adam8bit", "--embedding-state-32bit"],
    &["--optimizer", "adafactor"],
    &["--optimizer", "sgd"],
    &["--offload", "optimizer"],
    // Frozen blocks that backward goes through keep only what their input's gradient needs (a
    // plan that counted them as training read +13.5%); frozen ones below the lowest that
    // trains run outside autodiff (+86.3% counted as training).
    &["--freeze", "wte,h.0,h.1"],
    &["--freeze", "wte,wpe,h.0,h.1,h.2", "--strategy", "zero3"],
    &["--freeze", "lm_head,h.3", "--checkpoint-activations"],
    // Alone, an f32 rank's gathered units are its shards: no copy.
    &["--strategy", "zero3"],
    &[VOCAB, "8192", "--precision", "16-mixed"],
    &[VOCAB, "8192", "--checkpoint-activations"],
    // The step is the peak, and under --offload-dir it reads the token table's state in and
    // flattens it to write it back (a probe stepping in memory planned -11.6%).
    &[VOCAB, "8192", LAYERS, "24", DISK, "--batch-size", "1"],
    &[CLASSIFIER],
    &[BIGBIRD],
    &[TEXT, "--batch-size", "4"],
    &[VIT],
    // The evaluation's forward at batch 128 outweighs training at batch 2.
    &[VIT, "--batch-size", "2", "--checkpoint-activations"],
    // A mixed replica evaluates unit by unit, each cast to 16 bits.
    &[
        VIT,
        "--batch-size",
        "2",
        "--checkpoint-activations",
        "--precision",
        "bf16-mixed",
    ],
    // Adafactor's step on the token table, its largest parameter, with clipped gradients: the
    // probe steps them multiplied, as the engine hands them over (stepped unmultiplied, the
    // plan read -16.9% with the tensor path's step, +4.6% with the host's).
    &[CLASSIFIER, "--optimizer", "adafactor"],
    // Each micro-step's 16-bit gradients are cast to f32 beside the sums they are added to.
    &[
        CLASSIFIER,
        "--precision",
        "16-mixed",
        "--accumulate",
        "2",
        "--checkpoint-activations",
    ],
];

/// The sharded configurations, each on the MPI world.
pub const SHARDED: &[&[&str]] = &[
    &["--strategy", "ddp"],
    &["--strategy", "zero1"],
    &["--strategy", "zero2", "--accumulate", "2"],
    // Whole sums: the first micro-step plain, the second block by block beside the sums, its
    // graphs keeping the blocks' 16-bit copies.
    &[
        "--strategy",
        "ddp",
        "--precision",
        "bf16-mixed",
        "--accumulate",
        "2",
    ],
    &["--strategy", "zero2", "--checkpoint-activations"],
    &[
        "--strategy",
        "zero2",
        "--checkpoint-activations",
        "--checkpoint-mode",
        "selective",
    ],
    &["--strategy", "zero2", "--checkpoint-blocks", "2"],
    &["--strategy", "zero3", "--checkpoint-blocks", "2"],
    &[
        "--strategy",
        "ddp",
        "--checkpoint-blocks",
        "3",
        "--precision",
        "bf16-mixed",
        "--accumulate",
        "2",
    ],
    // Frozen parameters stay as broadcast the whole run, each in storage of its own (a slice
    // of its bucket kept the bucket's first values alive: -8.9% and -8.9%).
    &["--strategy", "ddp", "--freeze", "wpe"],
    &["--strategy", "zero2", "--freeze", "wte,wpe,h.0"],
    &["--strategy", "zero3"],
    // Resharded with checkpointing: blocks run forward outside autodiff, recomputed.
    &["--strategy", "zero3", "--checkpoint-activations"],
    // Every micro-step reduce-scatters its gradients: only shards are summed.
    &["--strategy", "zero3", "--accumulate", "2"],
    &["--strategy", "zero3", "--precision", "bf16-true"],
    &["--strategy", "zero3", "--offload", "params"],
    // Each unit kept gathered, with its graph, from its forward to its backward.
    &["--strategy", "zero3", "--reshard-after-forward", "false"],
    &[
        "--strategy",
        "zero3",
        "--reshard-after-forward",
        "false",
        "--precision",
        "bf16-mixed",
    ],
    &[
        "--strategy",
        "zero3",
        "--reshard-after-forward",
        "false",
        "--checkpoint-activations",
    ],
    &[VOCAB, "8192", "--strategy", "zero3"],
    // The reduction sets the peak (a deep model at batch 1): 16-bit buckets reduced in f32
    // (the default --grad-reduce-dtype) are cast up for the collective (-9.5% when the plan
    // counted them at 16 bits); reduce-scattered in bf16, MPI divides them for the mean in
    // place (a copy of each bucket before, -5.7%).
    &[
        LAYERS,
        "24",
        "--strategy",
        "ddp",
        "--precision",
        "bf16-true",
        "--optimizer",
        "sgd",
        "--batch-size",
        "1",
    ],
    &[
        LAYERS,
        "24",
        "--strategy",
        "zero2",
        "--precision",
        "bf16-true",
        "--grad-reduce-dtype",
        "bf16",
        "--optimizer",
        "sgd",
        "--batch-size",
        "1",
    ],
    &[
        LAYERS,
        "24",
        "--strategy",
        "zero3",
        "--optimizer",
        "sgd",
        "--batch-size",
        "1",
    ],
    &[CLASSIFIER, "--strategy", "ddp"],
    // With checkpointing DDP and ZeRO-1 sum whole gradients block by block: a unit's come in
    // after its backward, beside the sums of the units above (counted whole from the start,
    // the first read +18.4% and the second -2.2%).
    &[
        CLASSIFIER,
        "--strategy",
        "zero1",
        "--checkpoint-activations",
    ],
    &[
        MASKED_LM,
        "--strategy",
        "zero1",
        "--checkpoint-activations",
        "--precision",
        "bf16-mixed",
    ],
    // After the step ZeRO-2 gathers its updated shards back bucket by bucket, the token
    // table's alone; the shards already sent are gone.
    &[
        CLASSIFIER,
        "--strategy",
        "zero2",
        "--checkpoint-activations",
    ],
    &[CLASSIFIER, "--strategy", "zero3"],
    // The evaluation gathers one unit at a time, as training does.
    &[
        VIT,
        "--strategy",
        "zero3",
        "--batch-size",
        "2",
        "--checkpoint-activations",
    ],
    &[MASKED_LM, "--strategy", "zero3"],
    // The tied head reads the token table the embeddings keep gathered.
    &[
        MASKED_LM,
        "--strategy",
        "zero3",
        "--reshard-after-forward",
        "false",
    ],
    // A plain backward with a tied head: the head's gradient of the token table is held
    // until the embeddings' backward adds theirs, beside every other gradient (planned
    // without it, it read -7.6%).
    &[MASKED_LM, "--strategy", "zero2"],
    &[MASKED_LM, "--strategy", "zero2", "--checkpoint-activations"],
    // Each process plans for the launcher's world, and the ranks check they chose alike.
    &["--strategy", "auto", "--memory-budget", "150MiB"],
    // The token table and the head a bucket each (32 MiB), batch 1: the gradients'
    // reduction is the peak. An all-reduce's output takes its input's place (kept for the
    // next call, the plan read -5.1%); a reduce-scatter sends the packed bucket as it is
    // (planned with a receive buffer of its size, +12.0%).
    &[VOCAB, "32768", "--batch-size", "1", "--strategy", "ddp"],
    &[VOCAB, "32768", "--batch-size", "1", "--strategy", "zero2"],
];

/// Trains the check's model under `flags` (with `--plan`) on this process's ranks.
pub fn run(flags: &[&str]) -> anyhow::Result<RunSummary> {
    match flags {
        [check @ (CLASSIFIER | TEXT), flags @ ..] => {
            let head = BertHead::SequenceClassification { num_labels: 2 };
            let (model, args, device) = bert(head, flags)?;
            let lengths = match *check {
                CLASSIFIER => CLASSIFIER_LENGTHS,
                _ => (&TEXT_TOKENS[..], &TEXT_TOKENS[..]),
            };
            classify(model, lengths, &args, &device)
        }
        [BIGBIRD, flags @ ..] => {
            let config = BigBirdConfig {
                encoder: BertConfig {
                    layout: Layout::Bert,
                    head: BertHead::Base,
                    ..encoder()
                },
                attention_type: AttentionType::BlockSparse,
                block_size: 16,
                num_random_blocks: 3,
                num_labels: Some(2),
            };
            let (args, device) = (check_args("1", flags)?, seeded_cpu());
            let model = BigBird::new(&config, &device)?;
            classify(model, CLASSIFIER_LENGTHS, &args, &device)
        }
        [MASKED_LM, flags @ ..] => {
            let (model, args, device) = bert(BertHead::MaskedLm, flags)?;
            let mut task = MaskedTokens {
                batch: args.batch_size,
            };
            Ok(train(model, &mut task, &args, &device)?.1)
        }
        [VIT, flags @ ..] => {
            let (model, mut task, args, device) = vit(flags)?;
            Ok(train(model, &mut task, &args, &device)?.1)
        }
        _ => {
            let (model, mut task, args, device) = setup(flags)?;
            Ok(train(model, &mut task, &args, &device)?.1)
        }
    }
}

/// Tokens per sequence of the classifier check, whose activations peak at the top of
/// backward; and of the masked-LM check: short, so that the logits over the vocabulary do not
/// set the peak, the table's gradients do.
const CLASSIFIER_TOKENS: usize = 512;
const MASKED_LM_TOKENS: usize = 128;
/// The text check's sequences, in the order the training set holds them (the validation set
/// holds the same): at batch 4 the two steps draw each once, the longest in the second
/// (seed 1 draws rows 0, 3, 5, 7 first), when the optimizer state exists beside it.
const TEXT_TOKENS: [usize; 8] = [128, CLASSIFIER_TOKENS, 128, 128, 128, 128, 128, 128];
/// The classifier check's sequences (training, test).
const CLASSIFIER_LENGTHS: (&[usize], &[usize]) =
    (&[CLASSIFIER_TOKENS; 16], &[CLASSIFIER_TOKENS; 2]);

/// Trains the sequence classifier `model` on [`TextClassification::random_tokens`] of
/// `lengths` (training, test).
fn classify<M: SequenceClassifier>(
    model: M,
    (train_lengths, test_lengths): (&[usize], &[usize]),
    args: &TrainArgs,
    device: &Device,
) -> anyhow::Result<RunSummary> {
    let mut task = TextClassification::random_tokens(train_lengths, test_lengths, args.batch_size)?;
    Ok(train(model, &mut task, args, device)?.1)
}

/// The checks' device, the CPU's (see [`PLANNED_ON_CPU`]), seeded alike for every model.
fn seeded_cpu() -> Device {
    let device = Device::flex().autodiff();
    device.seed(1);
    device
}

/// The ViT check's model (4 blocks of width 256, 64-pixel images in 8-pixel patches), its
/// task (the bundled digits, evaluated in batches of [`VIT_EVAL_BATCH`]) and `flags` at
/// batch 8.
fn vit(flags: &[&str]) -> anyhow::Result<(Vit, ImageClassification, TrainArgs, Device)> {
    let config = VitConfig {
        image_size: 64,
        hidden_size: 256,
        num_hidden_layers: 4,
        intermediate_size: 1024,
        ..VitConfig::tiny()
    }
    .with_dropout(0.1);
    let args = check_args("8", flags)?;
    let device = seeded_cpu();
    let model = Vit::new(&config, &device)?;
    let (train_set, test_set) = images::load("digits", None, 0)?;
    let prep = Preprocess {
        size: 64,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    let task = ImageClassification::new(
        train_set,
        test_set,
        prep,
        args.batch_size,
        VIT_EVAL_BATCH,
        1,
    )?;
    Ok((model, task, args, device))
}

/// The BERT checks' model (DistilBERT's 30522-token table, 4 blocks of width 256) with
/// `head`, and `flags` at batch 1.
fn bert(head: BertHead, flags: &[&str]) -> anyhow::Result<(Bert, TrainArgs, Device)> {
    let config = encoder().with_head(head);
    let args = check_args("1", flags)?;
    let device = seeded_cpu();
    let model = Bert::new(&config, &device)?;
    Ok((model, args, device))
}

/// The text checks' encoder: 4 blocks of width 256 with DistilBERT's table of 30522 tokens.
fn encoder() -> BertConfig {
    BertConfig {
        intermediate_size: 1024,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        hidden_size: 256,
        ..BertConfig::distilbert_base()
    }
    .with_dropout(0.1)
}

/// Masked-LM batches for the memory check: fixed token ids (each rank its own), every
/// seventh position to predict (its own token; the rest -1, ignored). The same batch each
/// step: only memory is measured.
#[derive(Clone)]
struct MaskedTokens {
    batch: usize,
}

impl TrainTask for MaskedTokens {
    type Model = Bert;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Bert> {
        let (b, t) = (self.batch, MASKED_LM_TOKENS);
        let ids: Vec<i64> = (0..b * t)
            .map(|i| ((part.rank * b * t + i) * 7919 % 29900 + 100) as i64)
            .collect();
        let targets = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| if i % 7 == 0 { id } else { -1 })
            .collect();
        let input = BertInput {
            input_ids: Tensor::from_data(TensorData::new(ids, [b, t]), device),
            token_type_ids: Tensor::zeros([b, t], device),
            attention_mask: Tensor::ones([b, t], device),
        };
        let targets = Tensor::from_data(TensorData::new(targets, [b * t]), device);
        (input, targets)
    }

    fn items(&self, input: &BertInput) -> usize {
        input.input_ids.shape().num_elements()
    }

    fn counts_tokens(&self) -> bool {
        true
    }

    fn eval_batches(&self) -> usize {
        1
    }

    fn eval_batch(&mut self, _k: usize, device: &Device) -> Batch<Bert> {
        self.next_batch(device, BatchPart::WHOLE)
    }

    fn score(&self, logits: Tensor<2>, targets: Tensor<1, Int>) -> Score {
        Score::of_cross_entropy(logits, targets)
    }
}

/// `flags` after the check's own: 2 steps of `batch` with `--plan`.
fn check_args(batch: &str, flags: &[&str]) -> anyhow::Result<TrainArgs> {
    let base = ["--max-steps", "2", "--batch-size", batch];
    Ok(TrainArgs::from_flags(
        &[&base[..], &PLANNED_ON_CPU, flags].concat(),
    )?)
}

/// The check's minGPT (4 blocks of width 256), its task (batch 8 x 128), and `flags` (with
/// `--plan`, 2 steps; the leading check flags size the token table and the depth).
pub fn setup(flags: &[&str]) -> anyhow::Result<(Gpt, NextToken, TrainArgs, Device)> {
    let (mut vocab, mut layers, mut flags) = (65, 4, flags);
    while let [flag @ (VOCAB | LAYERS), n, rest @ ..] = flags {
        let n = n
            .parse::<usize>()
            .map_err(|e| anyhow::anyhow!("{flag} {n}: {e}"))?;
        match *flag {
            VOCAB => vocab = n,
            _ => layers = n,
        }
        flags = rest;
    }
    let config = GptConfig::new(layers, 4, 256, vocab, 128).with_dropout(0.1);
    let tokens: Vec<i64> = (0..20_000).map(|i| (i * 31 % vocab) as i64).collect();
    let dir = std::env::temp_dir().join("burnscale-plan-check");
    let dir = dir.to_string_lossy();
    let args = match flags {
        [DISK, rest @ ..] => {
            let disk = ["--offload", "optimizer", "--offload-dir", &dir];
            check_args("8", &[&disk[..], rest].concat())?
        }
        _ => check_args("8", flags)?,
    };
    let device = seeded_cpu();
    let task = NextToken::new(tokens.clone(), 128, args.batch_size, 1)?.with_validation(
        tokens[..2_000].to_vec(),
        128,
        1,
    )?;
    let model = Gpt::new(&config, &device)?;
    Ok((model, task, args, device))
}
