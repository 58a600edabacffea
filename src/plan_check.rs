//! The memory planner against measurement: a minGPT (or, with `--classifier`, a BERT text
//! classifier) trained for two steps under a configuration, its planned peak beside the
//! counting allocator's. The tests run the
//! one-rank configurations in-process; `examples/plan_check.rs` runs the sharded ones under
//! mpirun, where each rank is a process and measures its own peak. (Ranks on threads share
//! one process, whose peak moves by about 10% with how their backward passes interleave:
//! too much for a 10% check.)

use burn::prelude::*;
use burnscale_bert::{Bert, BertConfig, BertHead};
use burnscale_mingpt::{Gpt, GptConfig};
use burnscale_train::{RunSummary, TrainArgs, train};

use crate::tasks::{NextToken, TextClassification};

/// The most a prediction may be off, as a fraction of the measured peak.
pub const TOLERANCE: f64 = 0.10;

/// The check's own flags, first when given: `--vocab N` tokens instead of 65, so that with
/// 8192 the token table and the head (2.1M parameters each) outweigh a block (0.8M), as a
/// BERT's or a GPT-2's do; `--layers N` blocks instead of 4, so that with 24 at batch 1 the
/// model states outweigh the activations, as a large model's do, and the optimizer step
/// (with its gradient clipping) is the peak.
const VOCAB: &str = "--vocab";
const LAYERS: &str = "--layers";
/// `--classifier`, first: a DistilBERT-shaped text classifier instead of the minGPT (BERT's
/// 30522-token table, 4 blocks of width 256, batch 1 x 512 tokens): its head is small and
/// its token table's gradient, dense, comes at the very end of backward, while the
/// activations peak at its top; under ZeRO-3 the table is gathered again for that backward,
/// and its gradient is reduce-scattered last.
const CLASSIFIER: &str = "--classifier";

/// One rank's configurations: every precision, optimizer and technique (4 blocks of width
/// 256, batch 8 x 128, AdamW, dropout 0.1, unless a flag says otherwise).
pub const ONE_RANK: &[&[&str]] = &[
    &[],
    &["--checkpoint-activations"],
    &["--precision", "bf16-mixed"],
    &["--precision", "bf16-true"],
    &["--precision", "16-mixed", "--accumulate", "2"],
    &["--optimizer", "adam8bit"],
    &["--optimizer", "adafactor"],
    &["--optimizer", "sgd"],
    &["--offload", "optimizer"],
    &[VOCAB, "8192", "--precision", "16-mixed"],
    &[VOCAB, "8192", "--checkpoint-activations"],
    &[CLASSIFIER],
];

/// The sharded configurations, each on the MPI world.
pub const SHARDED: &[&[&str]] = &[
    &["--strategy", "ddp"],
    &["--strategy", "zero1"],
    &["--strategy", "zero2", "--accumulate", "2"],
    &["--strategy", "zero2", "--checkpoint-activations"],
    &["--strategy", "zero3"],
    // Every micro-step reduce-scatters its gradients: only shards are summed.
    &["--strategy", "zero3", "--accumulate", "2"],
    &["--strategy", "zero3", "--precision", "bf16-true"],
    &["--strategy", "zero3", "--offload", "params"],
    &[VOCAB, "8192", "--strategy", "zero3"],
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
    &[CLASSIFIER, "--strategy", "zero3"],
    // Each process plans for the launcher's world, and the ranks check they chose alike.
    &["--strategy", "auto", "--memory-budget", "150MiB"],
];

/// Trains the check's model under `flags` (with `--plan`) on this process's ranks.
pub fn run(flags: &[&str]) -> anyhow::Result<RunSummary> {
    if let [CLASSIFIER, flags @ ..] = flags {
        let (model, mut task, args, device) = classifier(flags)?;
        return Ok(train(model, &mut task, &args, &device)?.1);
    }
    let (model, mut task, args, device) = setup(flags)?;
    Ok(train(model, &mut task, &args, &device)?.1)
}

/// The `--classifier` check: its model, task (random token ids, batch 1 x 512) and `flags`.
fn classifier(
    flags: &[&str],
) -> anyhow::Result<(Bert, TextClassification<Bert>, TrainArgs, Device)> {
    let config = BertConfig {
        intermediate_size: 1024,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        hidden_size: 256,
        ..BertConfig::distilbert_base()
    }
    .with_dropout(0.1)
    .with_head(BertHead::SequenceClassification { num_labels: 2 });
    let args = check_args("1", flags)?;
    let device = Device::default().autodiff();
    device.seed(1);
    let task = TextClassification::random_tokens(16, 512, args.batch_size)?;
    let model = Bert::new(&config, &device)?;
    Ok((model, task, args, device))
}

/// `flags` after the check's own: 2 steps of `batch` with `--plan`.
fn check_args(batch: &str, flags: &[&str]) -> anyhow::Result<TrainArgs> {
    let base = ["--max-steps", "2", "--batch-size", batch, "--plan"];
    Ok(TrainArgs::from_flags(&[&base[..], flags].concat())?)
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
    let tokens: Vec<i64> = (0..20_000).map(|i| (i * 31 % 65) as i64).collect();
    let args = check_args("8", flags)?;
    let device = Device::default().autodiff();
    device.seed(1);
    let task = NextToken::new(tokens.clone(), 128, args.batch_size, 1)?.with_validation(
        tokens[..2_000].to_vec(),
        128,
        1,
    )?;
    let model = Gpt::new(&config, &device)?;
    Ok((model, task, args, device))
}
