//! minGPT training throughput, burnscale beside the PyTorch reference in the same run.
//!
//!     cargo bench --bench mingpt_throughput                 # gpt-mini, block 128, batch 16
//!     cargo bench --bench mingpt_throughput -- --steps 40 --summary-json /tmp/bench.json
//!
//! The PyTorch side is scripts/bench_mingpt_torch.py (needs `pip install torch`); without it
//! the table shows burnscale alone and says why. Both sides train the same model (minGPT,
//! dropout 0.1, AdamW with minGPT's decay groups, clip 1.0) on random tokens, vocab 65.

use std::process::Command;

use anyhow::{Context, Result};
use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{self, CountingAllocator};
use burnscale::train::{RunSummary, TrainArgs, train};
use clap::Parser;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
struct Cli {
    #[arg(long, default_value = "gpt-mini")]
    model: String,
    #[arg(long, default_value_t = 128)]
    block_size: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    #[arg(long, default_value_t = 65)]
    vocab_size: usize,
    /// Timed optimizer steps (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Threads for PyTorch (this machine has 2 cores).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Skip the PyTorch reference.
    #[arg(long)]
    no_torch: bool,
    #[arg(long)]
    summary_json: Option<std::path::PathBuf>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

fn burnscale_run(cli: &Cli, config: &GptConfig, steps: usize) -> Result<RunSummary> {
    let steps = steps.to_string();
    let batch = cli.batch_size.to_string();
    let args = TrainArgs::from_flags(&["--max-steps", &steps, "--batch-size", &batch])?;
    let device = Device::default().autodiff();
    device.seed(1337);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1337);
    let tokens = (0..1 << 20)
        .map(|_| rng.random_range(0..config.vocab_size as i64))
        .collect();
    let mut task = NextToken::new(tokens, cli.block_size, cli.batch_size, 1337)?;
    let model = Gpt::new(config, &device)?;
    Ok(train(model, &mut task, &args, &device)?.1)
}

fn torch_run(cli: &Cli, config: &GptConfig) -> Result<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench_mingpt_torch.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--n-layer", &config.n_layer.to_string()])
        .args(["--n-head", &config.n_head.to_string()])
        .args(["--n-embd", &config.n_embd.to_string()])
        .args(["--block-size", &cli.block_size.to_string()])
        .args(["--batch-size", &cli.batch_size.to_string()])
        .args(["--vocab-size", &cli.vocab_size.to_string()])
        .args(["--steps", &cli.steps.to_string()])
        .args(["--warmup", &cli.warmup.to_string()])
        .args(["--threads", &cli.threads.to_string()])
        .output()
        .context("cannot start python3")?;
    if !out.status.success() {
        anyhow::bail!(
            "{}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("failed")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().context("no output")?;
    Ok(serde_json::from_str(line)?)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let config = GptConfig::preset(&cli.model, cli.vocab_size, cli.block_size)?;
    // A short untimed run pays one-time costs (allocator warm-up, lazy init) first.
    burnscale_run(&cli, &config, cli.warmup)?;
    memory::reset_peak();
    let ours = burnscale_run(&cli, &config, cli.steps)?;
    let ours_tps = ours.tokens_per_s.unwrap_or(0.0);
    let torch = if cli.no_torch {
        Err(anyhow::anyhow!("skipped (--no-torch)"))
    } else {
        torch_run(&cli, &config)
    };

    println!(
        "minGPT {} (params {}), block {}, batch {}, {} timed steps, {} threads",
        cli.model, ours.num_params, cli.block_size, cli.batch_size, cli.steps, cli.threads
    );
    println!("{:<22} {:>12} {:>10}", "", "tokens/s", "step ms");
    let step_ms = |tps: f64| 1e3 * (cli.batch_size * cli.block_size) as f64 / tps;
    println!(
        "{:<22} {:>12.0} {:>10.1}",
        "burnscale (Flex)",
        ours_tps,
        step_ms(ours_tps)
    );
    let ratio = match &torch {
        Ok(t) => {
            let tps = t["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
            let name = format!("pytorch {}", t["torch_version"].as_str().unwrap_or("?"));
            println!("{name:<22} {tps:>12.0} {:>10.1}", step_ms(tps));
            println!("ratio burnscale/pytorch: {:.2}", ours_tps / tps);
            Some(ours_tps / tps)
        }
        Err(e) => {
            println!("pytorch reference: not run ({e})");
            None
        }
    };
    println!(
        "peak process memory {} | model states {} (formula 16 B/param: {})",
        memory::human_bytes(ours.peak_mem_bytes),
        memory::human_bytes(ours.model_state_bytes_per_rank),
        memory::human_bytes(ours.model_state_predicted_bytes)
    );
    if let Some(path) = &cli.summary_json {
        let report = json!({
            "burnscale": ours,
            "pytorch": torch.as_ref().ok(),
            "ratio_burnscale_over_pytorch": ratio,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    Ok(())
}
