//! The memory ladders, measured: the same training steps under each rung, with the
//! counting allocator's process peak, the model states (and the optimizer's bytes per
//! parameter) and the median step time per rung, side by side in one run.
//!
//!     cargo bench --bench precision_ladder                        # minGPT, 8 blocks of 256
//!     cargo bench --bench precision_ladder -- --model bert-large --steps 2
//!     cargo bench --bench precision_ladder -- --ladder lean --model bert-large --steps 2
//!
//! - `--ladder precision` (the Fabric article's): 32-true, bf16-mixed, bf16-true and
//!   bf16-true with per-block checkpointing (and 16-mixed).
//! - `--ladder lean` (the HF article's optimizer rungs, BERT-large): AdamW, Adafactor and
//!   8-bit AdamW at batch 4, then each with batch 1 x 4 accumulated, per-block
//!   checkpointing and 16-mixed, beside the article's V100 figures as ratios to its
//!   vanilla run.
//!
//! Each rung runs in a child process of this binary, so one rung's peak cannot hide in
//! another's. On Flex (the CPU backend) 16-bit types are stored in 16 bits but computed
//! through f32, so the 16-bit rungs save memory, not time.

use anyhow::{Result, bail};
use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::{NextToken, TextClassification};
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::{RunSummary, TrainArgs, train};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// (label, runner flags) of each rung, in ladder order.
const RUNGS: [(&str, &[&str]); 5] = [
    ("32-true", &["--precision", "32-true"]),
    ("16-mixed", &["--precision", "16-mixed"]),
    ("bf16-mixed", &["--precision", "bf16-mixed"]),
    (
        "bf16-true",
        &["--precision", "bf16-true", "--init-on-device"],
    ),
    (
        "bf16-true + ckpt",
        &[
            "--precision",
            "bf16-true",
            "--init-on-device",
            "--checkpoint-activations",
        ],
    ),
];

/// The HF article's optimizer rungs: (label, runner flags, the article's `nvidia-smi`
/// figure in MB on a V100, with about 1.3 GB of CUDA kernels in each).
const LEAN: [(&str, &[&str], Option<f64>); 8] = [
    ("AdamW, batch 4", &["--batch-size", "4"], Some(14949.0)),
    (
        "Adafactor, batch 4",
        &["--batch-size", "4", "--optimizer", "adafactor"],
        Some(12295.0),
    ),
    (
        "8-bit AdamW, batch 4",
        &["--batch-size", "4", "--optimizer", "adam8bit"],
        Some(13085.0),
    ),
    ("AdamW, 1x4 ckpt fp16", &[], Some(7275.0)),
    (
        "Adafactor, 1x4 ckpt fp16",
        &["--optimizer", "adafactor"],
        Some(4847.0),
    ),
    (
        "8-bit, 1x4 ckpt fp16",
        &["--optimizer", "adam8bit"],
        Some(5363.0),
    ),
    // Beyond the article: 16-bit weights, and so 16-bit gradients, too.
    (
        "Adafactor, 1x4 ckpt bf16-true",
        &["--optimizer", "adafactor", "--precision", "bf16-true"],
        None,
    ),
    (
        "8-bit, 1x4 ckpt bf16-true",
        &["--optimizer", "adam8bit", "--precision", "bf16-true"],
        None,
    ),
];

/// What the lean ladder's rungs after the third add (the article's full settings; fp16
/// unless the rung names a precision).
const FULL_SETTINGS: &[&str] = &[
    "--batch-size",
    "1",
    "--accumulate",
    "4",
    "--checkpoint-activations",
];

#[derive(Parser)]
struct Cli {
    /// precision (the Fabric article's rungs) or lean (the HF article's optimizer rungs,
    /// bert-large only).
    #[arg(long, default_value = "precision")]
    ladder: String,
    /// mingpt (8 blocks, width 256, batch 8 x 256) or bert-large (BERT-large config,
    /// sequence classification, batch 4 x 128).
    #[arg(long, default_value = "mingpt")]
    model: String,
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Worker mode (set by the driver): run one rung.
    #[arg(long, hide = true)]
    rung: Option<usize>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A rung: label, runner flags, and the article's figure (MB) if it has one.
type Rung = (&'static str, Vec<&'static str>, Option<f64>);

/// The rungs of `cli`'s ladder.
fn rungs(cli: &Cli) -> Result<Vec<Rung>> {
    Ok(match cli.ladder.as_str() {
        "precision" => RUNGS
            .iter()
            .map(|(label, flags)| (*label, flags.to_vec(), None))
            .collect(),
        "lean" if cli.model == "bert-large" => LEAN
            .iter()
            .enumerate()
            .map(|(i, (label, flags, mb))| {
                let mut all = flags.to_vec();
                if i >= 3 {
                    all.extend(FULL_SETTINGS);
                    if !flags.contains(&"--precision") {
                        all.extend(["--precision", "16-mixed"]);
                    }
                }
                (*label, all, *mb)
            })
            .collect(),
        other => bail!("--ladder must be precision, or lean with --model bert-large; got {other}"),
    })
}

fn worker(cli: &Cli, rung: usize) -> Result<()> {
    let device = Device::default().autodiff();
    device.seed(1);
    let steps = cli.steps.to_string();
    let rung_flags = rungs(cli)?.swap_remove(rung).1;
    let common = [
        "--max-steps",
        &steps,
        "--grad-clip",
        "0",
        "--lr",
        "1e-4",
        "--plan",
    ];
    // A rung may set its own batch.
    let batch = |size: &'static str| match rung_flags.contains(&"--batch-size") {
        true => vec![],
        false => vec!["--batch-size", size],
    };
    let summary: RunSummary = match cli.model.as_str() {
        "mingpt" => {
            let config = GptConfig::new(8, 8, 256, 65, 256).with_dropout(0.0);
            let flags = [&common[..], &batch("8"), &rung_flags].concat();
            let args = TrainArgs::from_flags(&flags)?;
            let tokens: Vec<i64> = (0..1 << 18).map(|i| (i * 31 % 65) as i64).collect();
            let mut task = NextToken::new(tokens, 256, 8, 1)?;
            train(Gpt::new(&config, &device)?, &mut task, &args, &device)?.1
        }
        "bert-large" => {
            let config = BertConfig::bert_large()
                .with_head(BertHead::SequenceClassification { num_labels: 2 })
                .with_dropout(0.0);
            let flags = [&common[..], &batch("4"), &rung_flags].concat();
            let args = TrainArgs::from_flags(&flags)?;
            let rows = |n: usize| -> Vec<(Vec<i64>, i64)> {
                (0..n)
                    .map(|i| {
                        let ids = (0..128).map(|j| ((i * 131 + j * 7) % 30000 + 1000) as i64);
                        (ids.collect(), (i % 2) as i64)
                    })
                    .collect()
            };
            let mut task = TextClassification::<Bert>::new(rows(64), rows(2), 0, 4, 1)?;
            train(Bert::new(&config, &device)?, &mut task, &args, &device)?.1
        }
        other => bail!("--model must be mingpt or bert-large, got {other}"),
    };
    let out = json!({
        "peak_bytes": summary.peak_mem_bytes,
        "planned_bytes": summary.planned_peak_mem_bytes,
        "state_bytes": summary.model_state_bytes_per_rank,
        "optimizer_bytes": summary.model_state.optimizer,
        "step_s": summary.step_s_median,
        "params": summary.num_params,
        "loss": summary.final_loss,
    });
    println!("{out}");
    Ok(())
}

fn run_child(cli: &Cli, rung: usize) -> Result<Value> {
    let (rung, steps) = (rung.to_string(), cli.steps.to_string());
    burnscale::run_worker([
        "--rung",
        &rung,
        "--ladder",
        &cli.ladder,
        "--model",
        &cli.model,
        "--steps",
        &steps,
    ])
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(rung) = cli.rung {
        return worker(&cli, rung);
    }
    println!(
        "{} {} ladder, {} steps (median step time), process peak by the counting allocator, and the planner's prediction made before the first step",
        cli.model, cli.ladder, cli.steps
    );
    println!(
        "  {:<24} {:>11} {:>6} {:>11} {:>6} {:>13} {:>9} {:>12} {:>8} {:>6} {:>8} {:>7}",
        "rung",
        "peak",
        "ratio",
        "planned",
        "off",
        "model states",
        "optim B/p",
        "activations",
        "step s",
        "ratio",
        "article",
        "ratio"
    );
    let mut base: Option<(f64, f64, Option<f64>)> = None;
    for (rung, (label, _, article)) in rungs(&cli)?.into_iter().enumerate() {
        let r = run_child(&cli, rung)?;
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let (peak, step) = (f("peak_bytes"), f("step_s"));
        let (p0, s0, a0) = *base.get_or_insert((peak, step, article));
        let (article_mb, article_ratio) = match (article, a0) {
            (Some(mb), Some(mb0)) => (format!("{mb:.0} MB"), format!("{:.2}", mb / mb0)),
            _ => (String::new(), String::new()),
        };
        println!(
            "  {label:<24} {:>11} {:>6.2} {:>11} {:>+5.1}% {:>13} {:>9.2} {:>12} {step:>8.2} {:>6.2} {article_mb:>8} {article_ratio:>7}",
            human_bytes(peak as usize),
            peak / p0,
            human_bytes(f("planned_bytes") as usize),
            100.0 * (f("planned_bytes") / peak - 1.0),
            human_bytes(f("state_bytes") as usize),
            f("optimizer_bytes") / f("params"),
            human_bytes((peak - f("state_bytes")) as usize),
            step / s0,
        );
    }
    Ok(())
}
