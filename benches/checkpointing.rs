//! Per-block activation checkpointing on minGPT: activation memory (process peak minus model
//! states, counting allocator) and median step time without checkpointing, with
//! `--checkpoint-activations` (ours, per block; and with `--checkpoint-mode selective`, each
//! block keeping its linears' outputs), with `--checkpoint-blocks` half the depth (the lower
//! half recomputed, the upper keeping its graphs), and with Burn's own device-level gradient
//! checkpointing (`Device::gradient_checkpointing`, which recomputes memory-bound operations
//! and keeps compute-bound ones), side by side in one run, for several depths.
//!
//!     cargo bench --bench checkpointing
//!     cargo bench --bench checkpointing -- --layers 4,8 --steps 3
//!
//! Each configuration runs in a child process of this binary, so one run's peak cannot
//! hide in another's.

use anyhow::Result;
use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::{TrainArgs, train};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// What is compared with no checkpointing: every block checkpointed (`per-block`), every block
/// keeping its linears' outputs too (`selective`), the lower half (`half`), Burn's own.
const MODES: [&str; 4] = ["per-block", "selective", "half", "burn"];

#[derive(Parser)]
struct Cli {
    /// Depths to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,12")]
    layers: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    n_head: usize,
    #[arg(long, default_value_t = 256)]
    n_embd: usize,
    #[arg(long, default_value_t = 256)]
    block_size: usize,
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Worker mode (set by the driver): one run, `layers[0]` blocks, plain or one of [`MODES`].
    #[arg(long, hide = true)]
    worker: Option<String>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

fn worker(cli: &Cli, mode: &str) -> Result<()> {
    // On the host whatever the build: activation bytes are the counting allocator's.
    let device = match mode {
        "burn" => Device::flex().autodiff().gradient_checkpointing(),
        _ => Device::flex().autodiff(),
    };
    device.seed(1);
    let n_layer = cli.layers[0];
    let config =
        GptConfig::new(n_layer, cli.n_head, cli.n_embd, 65, cli.block_size).with_dropout(0.0);
    let model = Gpt::new(&config, &device)?;
    let tokens: Vec<i64> = (0..1 << 18).map(|i| (i * 31 % 65) as i64).collect();
    let (steps, batch) = (cli.steps.to_string(), cli.batch_size.to_string());
    let mut flags = vec![
        "--max-steps",
        &steps,
        "--batch-size",
        &batch,
        "--accelerator",
        "cpu",
    ];
    let half = (n_layer / 2).max(1).to_string();
    match mode {
        "per-block" => flags.push("--checkpoint-activations"),
        "selective" => flags.extend(["--checkpoint-activations", "--checkpoint-mode", "selective"]),
        "half" => flags.extend(["--checkpoint-blocks", &half]),
        _ => {}
    }
    let args = TrainArgs::from_flags(&flags)?;
    let mut task = NextToken::new(tokens, cli.block_size, cli.batch_size, 1)?;
    let (_, summary) = train(model, &mut task, &args, &device)?;
    let peak = summary
        .peak_mem_bytes
        .expect("this bench installs the counting allocator");
    let out = json!({
        "activation_bytes": peak.saturating_sub(summary.model_state_bytes_per_rank),
        "peak_bytes": peak,
        "step_s": summary.step_s_median,
        "params": summary.num_params,
    });
    println!("{out}");
    Ok(())
}

fn run_child(cli: &Cli, layers: usize, mode: &str) -> Result<Value> {
    burnscale::run_worker([
        "--worker".to_string(),
        mode.to_string(),
        "--layers".into(),
        layers.to_string(),
        "--n-head".into(),
        cli.n_head.to_string(),
        "--n-embd".into(),
        cli.n_embd.to_string(),
        "--block-size".into(),
        cli.block_size.to_string(),
        "--batch-size".into(),
        cli.batch_size.to_string(),
        "--steps".into(),
        cli.steps.to_string(),
    ])
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(mode) = &cli.worker {
        return worker(&cli, mode);
    }
    println!(
        "minGPT width {}, {} heads, batch {} x {} tokens, {} steps (median step time)",
        cli.n_embd, cli.n_head, cli.batch_size, cli.block_size, cli.steps
    );
    let mut header = format!("  {:>6} {:>11} {:>12}", "blocks", "params", "activations");
    for mode in MODES {
        header += &format!(" {mode:>12} {:>6}", "ratio");
    }
    header += &format!(" {:>6} {:>8}", "1.5/L", "step s");
    for mode in MODES {
        header += &format!(" {:>9}", mode);
    }
    println!("{header}");
    for &layers in &cli.layers {
        let plain = run_child(&cli, layers, "plain")?;
        let runs = MODES
            .iter()
            .map(|mode| run_child(&cli, layers, mode))
            .collect::<Result<Vec<_>>>()?;
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let act = |v: &Value| f(v, "activation_bytes");
        let (a, s) = (act(&plain), f(&plain, "step_s"));
        let mut line = format!(
            "  {layers:>6} {:>11} {:>12}",
            f(&plain, "params"),
            human_bytes(a as usize)
        );
        for run in &runs {
            line += &format!(
                " {:>12} {:>6.2}",
                human_bytes(act(run) as usize),
                act(run) / a
            );
        }
        line += &format!(" {:>6.2} {s:>8.3}", 1.5 / layers as f64);
        for run in &runs {
            line += &format!(" {:>9.2}", f(run, "step_s") / s);
        }
        println!("{line}");
    }
    Ok(())
}
