//! The memory ladders, measured: the same training steps under each rung, with the
//! counting allocator's process peak, the model states (and the optimizer's bytes per
//! parameter) and the median step time per rung, side by side in one run.
//!
//!     cargo bench --bench precision_ladder                        # minGPT, 8 blocks of 256
//!     cargo bench --bench precision_ladder -- --model bert-large --steps 2
//!
//! The rungs (the Fabric article's precisions): 32-true, 16-mixed, bf16-mixed, bf16-true and
//! bf16-true with per-block checkpointing. The HF article's optimizer rungs are
//! `benches/hf_bert_large.rs`.
//!
//! Each rung runs in a child process of this binary, so one rung's peak cannot hide in
//! another's. On Flex (the CPU backend) 16-bit types are stored in 16 bits but computed
//! through f32, so the 16-bit rungs save memory, not time.

use anyhow::{Context, Result, bail};
use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::plan_check::PLANNED_ON_CPU;
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

#[derive(Parser)]
struct Cli {
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

fn worker(cli: &Cli, rung: usize) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(1);
    let steps = cli.steps.to_string();
    let Some((_, rung_flags)) = RUNGS.get(rung) else {
        bail!("no rung {rung}");
    };
    let common = ["--max-steps", &steps, "--grad-clip", "0", "--lr", "1e-4"];
    // A rung may set its own batch.
    let batch = |size: &'static str| match rung_flags.contains(&"--batch-size") {
        true => vec![],
        false => vec!["--batch-size", size],
    };
    let summary: RunSummary = match cli.model.as_str() {
        "mingpt" => {
            let config = GptConfig::new(8, 8, 256, 65, 256).with_dropout(0.0);
            let flags = [&common[..], &PLANNED_ON_CPU, &batch("8"), rung_flags].concat();
            let args = TrainArgs::from_flags(&flags)?;
            let tokens: Vec<i64> = (0..1 << 18).map(|i| (i * 31 % 65) as i64).collect();
            let mut task = NextToken::new(tokens, 256, args.batch_size, 1)?;
            train(Gpt::new(&config, &device)?, &mut task, &args, &device)?.1
        }
        "bert-large" => {
            let config = BertConfig::bert_large()
                .with_head(BertHead::SequenceClassification { num_labels: 2 })
                .with_dropout(0.0);
            let flags = [&common[..], &PLANNED_ON_CPU, &batch("4"), rung_flags].concat();
            let args = TrainArgs::from_flags(&flags)?;
            let mut task =
                TextClassification::<Bert>::random_tokens(&[128; 64], &[128; 2], args.batch_size)?;
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
    burnscale::run_worker(["--rung", &rung, "--model", &cli.model, "--steps", &steps])
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
        "{} precision ladder, {} steps (median step time), process peak by the counting allocator, and the planner's prediction made before the first step",
        cli.model, cli.steps
    );
    println!(
        "  {:<24} {:>11} {:>10} {:>11} {:>6} {:>13} {:>9} {:>12} {:>8} {:>10}",
        "rung",
        "peak",
        "vs 32-true",
        "planned",
        "off",
        "model states",
        "optim B/p",
        "above state",
        "step s",
        "vs 32-true"
    );
    let mut base: Option<(f64, f64)> = None;
    for (rung, (label, _)) in RUNGS.iter().enumerate() {
        let r = run_child(&cli, rung)?;
        let f = |k: &str| {
            r[k].as_f64()
                .with_context(|| format!("rung {label}: the worker reported no {k}: {r}"))
        };
        let (peak, step, planned, state) = (
            f("peak_bytes")?,
            f("step_s")?,
            f("planned_bytes")?,
            f("state_bytes")?,
        );
        let (p0, s0) = *base.get_or_insert((peak, step));
        println!(
            "  {label:<24} {:>11} {:>10.2} {:>11} {:>+5.1}% {:>13} {:>9.2} {:>12} {step:>8.2} {:>10.2}",
            human_bytes(peak as usize),
            peak / p0,
            human_bytes(planned as usize),
            100.0 * (planned / peak - 1.0),
            human_bytes(state as usize),
            f("optimizer_bytes")? / f("params")?,
            human_bytes((peak - state) as usize),
            step / s0,
        );
    }
    Ok(())
}
