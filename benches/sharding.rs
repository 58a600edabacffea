//! The ZeRO memory and speed table: minGPT (8 layers, width 768, character vocabulary:
//! 56.9M parameters) trained for a few steps under every strategy at N = 1, 2 and 4 MPI
//! processes; per strategy and N, every rank's measured model-state bytes against the ZeRO
//! paper's formula, the process peak, and the median step time, each beside DDP's at the
//! same N; then DDP and ZeRO-3 again with the optimizer state on disk (`--offload-dir`),
//! and how much that lowers the process peak.
//!
//!     cargo bench --features mpi --bench sharding
//!     cargo bench --features mpi --bench sharding -- --worlds 2 --steps 3
//!
//! The driver starts `mpirun -np N` on this same binary in worker mode for each run; rank
//! 0 of each run writes its summary JSON, which the driver reads.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::{TrainArgs, train};
use clap::Parser;
use rand::{Rng, SeedableRng};
use serde_json::Value;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Per world size: a label, the strategy, and whether the optimizer state is on disk.
const RUNS: [(&str, &str, bool); 6] = [
    ("ddp", "ddp", false),
    ("zero1", "zero1", false),
    ("zero2", "zero2", false),
    ("zero3", "zero3", false),
    ("ddp+disk", "ddp", true),
    ("zero3+disk", "zero3", true),
];

#[derive(Parser)]
struct Cli {
    #[arg(long, default_value_t = 8)]
    n_layer: usize,
    #[arg(long, default_value_t = 12)]
    n_head: usize,
    #[arg(long, default_value_t = 768)]
    n_embd: usize,
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Micro-batch per rank.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Optimizer steps per run (the median step time is reported).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    worlds: Vec<usize>,
    /// Worker mode (set by the driver): train this run of `RUNS`, as one MPI rank.
    #[arg(long, hide = true)]
    worker: Option<String>,
    #[arg(long, hide = true)]
    summary_json: Option<PathBuf>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Cli {
    fn config(&self) -> GptConfig {
        let mut config = GptConfig::preset("gpt-mini", 65, self.block_size)
            .expect("gpt-mini is a preset")
            .with_dropout(0.0);
        (config.n_layer, config.n_head, config.n_embd) = (self.n_layer, self.n_head, self.n_embd);
        config
    }
}

fn worker(cli: &Cli, label: &str) -> Result<()> {
    let Some(&(_, strategy, disk)) = RUNS.iter().find(|run| run.0 == label) else {
        bail!("unknown run {label}");
    };
    let (steps, batch) = (cli.steps.to_string(), cli.batch_size.to_string());
    // On the host, whose memory the counting allocator reads (in a `cuda` build on a GPU
    // machine the default would put the ranks on the GPU, and the peak column would not be
    // theirs).
    let mut flags = vec![
        "--strategy",
        strategy,
        "--max-steps",
        &steps,
        "--batch-size",
        &batch,
        "--accelerator",
        "cpu",
    ];
    let dir = std::env::temp_dir().join("burnscale-sharding-offload");
    let dir = dir.display().to_string();
    if disk {
        flags.extend(["--offload-dir", &dir]);
    }
    let summary = cli.summary_json.as_ref().map(|p| p.display().to_string());
    if let Some(path) = &summary {
        flags.extend(["--summary-json", path]);
    }
    let args = TrainArgs::from_flags(&flags)?;
    let device = Device::flex().autodiff();
    device.seed(1337);
    let config = cli.config();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1337);
    let tokens = (0..1 << 20)
        .map(|_| rng.random_range(0..config.vocab_size as i64))
        .collect();
    let mut task = NextToken::new(tokens, cli.block_size, cli.batch_size, 1337)?;
    train(Gpt::new(&config, &device)?, &mut task, &args, &device)?;
    Ok(())
}

fn run(cli: &Cli, label: &str, world: usize) -> Result<Measured> {
    let json = std::env::temp_dir().join(format!("burnscale-sharding-{label}-{world}.json"));
    let status = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &world.to_string(),
        ])
        .arg(std::env::current_exe()?)
        .args(["--worker", label, "--summary-json"])
        .arg(&json)
        .args(["--n-layer", &cli.n_layer.to_string()])
        .args(["--n-head", &cli.n_head.to_string()])
        .args(["--n-embd", &cli.n_embd.to_string()])
        .args(["--block-size", &cli.block_size.to_string()])
        .args(["--batch-size", &cli.batch_size.to_string()])
        .args(["--steps", &cli.steps.to_string()])
        .status()
        .context("cannot start mpirun (apt-get install openmpi-bin libopenmpi-dev)")?;
    if !status.success() {
        bail!("{label} on {world} ranks failed: {status}");
    }
    let text = std::fs::read_to_string(&json).with_context(|| format!("{}", json.display()))?;
    let summary: Value = serde_json::from_str(&text)?;
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let max_over_ranks = |key: &str| {
        summary["ranks"]
            .as_array()
            .map(|ranks| ranks.iter().map(|r| num(&r[key])).fold(0.0, f64::max))
            .unwrap_or(f64::NAN)
    };
    Ok(Measured {
        states: max_over_ranks("model_state_bytes"),
        predicted: num(&summary["model_state_predicted_bytes"]),
        peak: max_over_ranks("peak_mem_bytes"),
        step_s: num(&summary["step_s_median"]),
        volume: num(&summary["collective_bytes_per_step"]["volume"]),
    })
}

/// One run, from rank 0's summary: the largest of the ranks' figures.
#[derive(Clone, Copy)]
struct Measured {
    states: f64,
    predicted: f64,
    peak: f64,
    step_s: f64,
    /// Rank 0's collective volume a step, as the ZeRO paper counts it.
    volume: f64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(strategy) = &cli.worker {
        return worker(&cli, strategy);
    }
    if !cfg!(feature = "mpi") {
        bail!("this benchmark runs MPI processes: cargo bench --features mpi --bench sharding");
    }
    let config = cli.config();
    println!(
        "minGPT {} layers, width {}, {} parameters; micro-batch {} x {} tokens per rank; AdamW, f32; {} steps\n\
         model states: ZeRO paper, pure f32 (4 B params + 4 B grads + 8 B AdamW per parameter, the strategy's part / N; +disk: AdamW's 8 B in --offload-dir files)\n\
         collectives: rank 0's volume a step as the ZeRO paper counts it (an all-reduce twice), in Ψ = 4 B x parameters\n",
        config.n_layer,
        config.n_embd,
        config.num_params(),
        cli.batch_size,
        cli.block_size,
        cli.steps
    );
    println!(
        "{:>2} {:<10} {:>14} {:>14} {:>7} {:>14} {:>9} {:>10} {:>9} {:>12}",
        "N",
        "",
        "states/rank",
        "formula",
        "meas/f",
        "peak/rank",
        "vs ddp",
        "step s",
        "vs ddp",
        "collectives"
    );
    let psi = 4.0 * config.num_params() as f64;
    for &world in &cli.worlds {
        let mut measured: Vec<(&str, Measured)> = Vec::new();
        for (label, _, _) in RUNS {
            let m = run(&cli, label, world)?;
            let ddp = measured.first().map_or(m, |&(_, ddp)| ddp);
            println!(
                "{world:>2} {label:<10} {:>14} {:>14} {:>7.3} {:>14} {:>8.2}x {:>10.3} {:>8.2}x {:>11.2}Ψ",
                human_bytes(m.states as usize),
                human_bytes(m.predicted as usize),
                m.states / m.predicted,
                human_bytes(m.peak as usize),
                m.peak / ddp.peak,
                m.step_s,
                m.step_s / ddp.step_s,
                m.volume / psi,
            );
            measured.push((label, m));
        }
        let find = |label: &str| measured.iter().find(|m| m.0 == label).map(|m| m.1);
        for (label, strategy, _) in RUNS.iter().filter(|run| run.2) {
            if let (Some(memory), Some(disk)) = (find(strategy), find(label)) {
                println!(
                    "   {strategy} --offload-dir: peak {} -> {} ({:.2}x, {} less), step {:.2}x",
                    human_bytes(memory.peak as usize),
                    human_bytes(disk.peak as usize),
                    disk.peak / memory.peak,
                    human_bytes((memory.peak - disk.peak).max(0.0) as usize),
                    disk.step_s / memory.step_s,
                );
            }
        }
    }
    Ok(())
}
