//! Per-block activation checkpointing on minGPT: activation memory (process peak minus model
//! states, counting allocator) and median step time with and without
//! `--checkpoint-activations`, side by side in one run, for several depths.
//!
//!     cargo bench --bench checkpointing
//!     cargo bench --bench checkpointing -- --layers 4,8 --steps 3
//!
//! Each configuration runs in a child process of this binary, so one run's peak cannot
//! hide in another's.

use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::{TrainArgs, train};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

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
    /// Worker mode (set by the driver): one run, `layers[0]` blocks, checkpointed or not.
    #[arg(long, hide = true)]
    worker: Option<bool>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

fn worker(cli: &Cli, checkpoint: bool) -> Result<()> {
    let device = Device::default().autodiff();
    device.seed(1);
    let n_layer = cli.layers[0];
    let config =
        GptConfig::new(n_layer, cli.n_head, cli.n_embd, 65, cli.block_size).with_dropout(0.0);
    let model = Gpt::new(&config, &device)?;
    let tokens: Vec<i64> = (0..1 << 18).map(|i| (i * 31 % 65) as i64).collect();
    let (steps, batch) = (cli.steps.to_string(), cli.batch_size.to_string());
    let mut flags = vec!["--max-steps", &steps, "--batch-size", &batch];
    if checkpoint {
        flags.push("--checkpoint-activations");
    }
    let args = TrainArgs::from_flags(&flags)?;
    let mut task = NextToken::new(tokens, cli.block_size, cli.batch_size, 1)?;
    let (_, summary) = train(model, &mut task, &args, &device)?;
    let out = json!({
        "activation_bytes": summary.peak_mem_bytes - summary.model_state_bytes_per_rank,
        "peak_bytes": summary.peak_mem_bytes,
        "step_s": summary.step_s_median,
        "params": summary.num_params,
    });
    println!("{out}");
    Ok(())
}

fn run_child(cli: &Cli, layers: usize, checkpoint: bool) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .args([
            "--worker",
            &checkpoint.to_string(),
            "--layers",
            &layers.to_string(),
        ])
        .args([
            "--n-head",
            &cli.n_head.to_string(),
            "--n-embd",
            &cli.n_embd.to_string(),
        ])
        .args(["--block-size", &cli.block_size.to_string()])
        .args([
            "--batch-size",
            &cli.batch_size.to_string(),
            "--steps",
            &cli.steps.to_string(),
        ])
        .output()
        .context("cannot start the worker")?;
    if !out.status.success() {
        bail!("worker failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Ok(serde_json::from_str(
        stdout.lines().last().context("no output")?,
    )?)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(checkpoint) = cli.worker {
        return worker(&cli, checkpoint);
    }
    println!(
        "minGPT width {}, {} heads, batch {} x {} tokens, {} steps (median step time)",
        cli.n_embd, cli.n_head, cli.batch_size, cli.block_size, cli.steps
    );
    println!(
        "  {:>6} {:>11} {:>16} {:>16} {:>7} {:>8} {:>9} {:>10} {:>7}",
        "blocks",
        "params",
        "activations",
        "checkpointed",
        "ratio",
        "1.5/L",
        "step s",
        "ckpt s",
        "ratio"
    );
    for &layers in &cli.layers {
        let plain = run_child(&cli, layers, false)?;
        let ckpt = run_child(&cli, layers, true)?;
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let (a, b) = (f(&plain, "activation_bytes"), f(&ckpt, "activation_bytes"));
        let (s, t) = (f(&plain, "step_s"), f(&ckpt, "step_s"));
        println!(
            "  {layers:>6} {:>11} {:>16} {:>16} {:>7.2} {:>8.2} {s:>9.3} {t:>10.3} {:>7.2}",
            f(&plain, "params"),
            human_bytes(a as usize),
            human_bytes(b as usize),
            b / a,
            1.5 / layers as f64,
            t / s
        );
    }
    Ok(())
}
