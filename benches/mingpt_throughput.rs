//! minGPT training throughput: burnscale's runner beside a plain Burn loop (the floor: the
//! same model and AdamW through `burnscale::reference`, no engine) and the PyTorch reference,
//! in the same run.
//!
//!     cargo bench --bench mingpt_throughput                 # gpt-mini, block 128, batch 16
//!     cargo bench --bench mingpt_throughput -- --steps 40 --summary-json /tmp/bench.json
//!     # ZeRO-3 on one rank beside single: its default (alone in f32: one graph, as single),
//!     # and with its shards offloaded (resharded after forward, its linears regathered for
//!     # backward); kept gathered until backward where a rank alone computes on a copy
//!     # (bf16-mixed; in f32 it gathers nothing and the flag is refused):
//!     cargo bench --bench mingpt_throughput -- --no-torch --also "--strategy zero3" \
//!         --also "--strategy zero3 --offload params"
//!     cargo bench --bench mingpt_throughput -- --no-torch --precision bf16-mixed \
//!         --also "--strategy zero3 --reshard-after-forward false"
//!     # one configuration, with no single run before it:
//!     cargo bench --bench mingpt_throughput -- --no-torch --no-plain --strategy zero3 \
//!         --precision bf16-mixed --flags "--reshard-after-forward false"
//!     # on a GPU (a `cuda` build), the 57M config in bf16-mixed:
//!     cargo bench --features cuda --bench mingpt_throughput -- --accelerator cuda \
//!         --n-layer 8 --n-head 8 --n-embd 768 --block-size 256 --precision bf16-mixed
//!     # the same model on Burn's LibTorch backend (PyTorch's kernels; README: LibTorch):
//!     cargo bench --features tch --bench mingpt_throughput -- --accelerator libtorch
//!
//! The PyTorch side is scripts/bench_mingpt_torch.py (needs `pip install torch`); without it
//! the table shows burnscale alone and says why. All sides train the same model (minGPT,
//! dropout 0.1, AdamW with minGPT's decay groups, clip 1.0, constant learning rate) on random
//! tokens, vocab 65. The plain loop has no autocast, so it runs only for the `*-true`
//! precisions.

use std::process::Command;

use anyhow::{Context, Result};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::reference::PlainConfig;
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
    /// Override the preset's depth, heads and width.
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    #[arg(long)]
    n_embd: Option<usize>,
    /// cpu, cuda, cubecl-cpu or libtorch (burnscale's `--accelerator`; PyTorch runs on the
    /// same device: on the CPU for cubecl-cpu, and for libtorch where LibTorch sees no GPU).
    #[arg(long, default_value = "cpu")]
    accelerator: String,
    /// burnscale's `--precision` (PyTorch: 32-true, bf16-mixed or bf16-true).
    #[arg(long, default_value = "32-true")]
    precision: String,
    /// burnscale's `--strategy` on one rank (single, or zero3 to see the engine's cost).
    #[arg(long, default_value = "single")]
    strategy: String,
    /// More runner flags for every burnscale run, the first and each `--also` (whose flags
    /// come later and override them), not the plain loop: `--flags "--offload params"` with
    /// `--strategy zero3`.
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    flags: String,
    #[arg(long, default_value_t = 128)]
    block_size: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    #[arg(long, default_value_t = 65)]
    vocab_size: usize,
    /// Optimizer steps of each timed run (after `--warmup` untimed ones): the steps after
    /// its first are timed, as the runner times them.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Untimed steps of a run before the timed one (at least 1: its first step is the
    /// cold start reported).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Threads for PyTorch (this machine has 2 cores).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Skip the PyTorch reference.
    #[arg(long)]
    no_torch: bool,
    /// Skip the plain Burn loop.
    #[arg(long)]
    no_plain: bool,
    /// Another burnscale run after the first, with these runner flags added (repeatable; a
    /// later flag overrides), its step time as a ratio to the first's.
    #[arg(long, allow_hyphen_values = true)]
    also: Vec<String>,
    #[arg(long)]
    summary_json: Option<std::path::PathBuf>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The runner's flags for `steps` steps of this benchmark, then `extra`.
fn train_args(cli: &Cli, steps: usize, extra: &[&str]) -> Result<TrainArgs> {
    let (steps, batch) = (steps.to_string(), cli.batch_size.to_string());
    let base = [
        "--max-steps",
        &steps,
        "--batch-size",
        &batch,
        "--schedule",
        "constant",
        "--accelerator",
        &cli.accelerator,
        "--precision",
        &cli.precision,
        "--strategy",
        &cli.strategy,
    ];
    Ok(TrainArgs::from_flags(&[&base[..], extra].concat())?)
}

/// Random tokens, the same for every side.
fn task(cli: &Cli, config: &GptConfig) -> Result<NextToken> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1337);
    let tokens = (0..1 << 20)
        .map(|_| rng.random_range(0..config.vocab_size as i64))
        .collect();
    Ok(NextToken::new(
        tokens,
        cli.block_size,
        cli.batch_size,
        1337,
    )?)
}

fn burnscale_run(
    cli: &Cli,
    config: &GptConfig,
    steps: usize,
    extra: &[&str],
) -> Result<RunSummary> {
    let flags: Vec<&str> = cli.flags.split_whitespace().collect();
    let args = train_args(cli, steps, &[&flags[..], extra].concat())?;
    let device = args.device()?;
    device.seed(1337);
    let model = Gpt::new(config, &device)?;
    Ok(train(model, &mut task(cli, config)?, &args, &device)?.1)
}

/// The plain Burn loop's tokens per second over `cli.steps` steps after `cli.warmup` untimed
/// ones, counted as the runner counts (the steps after the first), and its first timed step's
/// seconds.
fn plain_run(cli: &Cli, config: &GptConfig) -> Result<(f64, f64)> {
    let args = train_args(cli, cli.warmup, &[])?;
    let device = args.device()?;
    device.seed(1337);
    let mut task = task(cli, config)?;
    let warm = PlainConfig::from_args(&args).map_err(anyhow::Error::msg)?;
    let (_, model) = warm.train(Gpt::new(config, &device)?, &mut task, &device);
    let timed =
        PlainConfig::from_args(&train_args(cli, cli.steps, &[])?).map_err(anyhow::Error::msg)?;
    let (trajectory, _) = timed.train(model, &mut task, &device);
    anyhow::ensure!(
        trajectory.losses.iter().all(|l| l.is_finite()),
        "plain loss diverged"
    );
    let (first, steady) = trajectory.step_s.split_first().context("no timed step")?;
    // A one-step run has only its first.
    let counted = match steady.is_empty() {
        true => std::slice::from_ref(first),
        false => steady,
    };
    let items = counted.len() * cli.batch_size * cli.block_size;
    Ok((items as f64 / counted.iter().sum::<f64>(), *first))
}

fn torch_run(cli: &Cli, config: &GptConfig) -> Result<Value> {
    let script = burnscale::reference_script("bench_mingpt_torch.py");
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
        .args([
            "--device",
            match train_args(cli, 1, &[])?.runs_on().on_gpu() {
                true => "cuda",
                false => "cpu",
            },
        ])
        .args(["--precision", &cli.precision])
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

/// The first rank's device peak (on the CPU its process peak).
fn device_peak(summary: &RunSummary) -> String {
    match summary.ranks.first().and_then(|r| r.device_peak_mem_bytes) {
        Some(bytes) => memory::human_bytes(bytes),
        None => "not read (on LibTorch: see nvidia-smi)".into(),
    }
}

fn process_peak(summary: &RunSummary) -> String {
    summary
        .peak_mem_bytes
        .map_or_else(|| "not measured".into(), memory::human_bytes)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.warmup >= 1,
        "--warmup 0: the untimed run needs a step, whose time is the cold start reported"
    );
    let mut config = GptConfig::preset(&cli.model, cli.vocab_size, cli.block_size)?;
    config.n_layer = cli.n_layer.unwrap_or(config.n_layer);
    config.n_head = cli.n_head.unwrap_or(config.n_head);
    config.n_embd = cli.n_embd.unwrap_or(config.n_embd);
    // A short untimed run pays one-time costs (kernel compilation and tuning, lazy init)
    // first; its first step's seconds are the configuration's cold start.
    let measured = |extra: &[&str]| -> Result<(f64, RunSummary)> {
        let cold = burnscale_run(&cli, &config, cli.warmup, extra)?.warmup_s;
        memory::reset_peak();
        Ok((cold, burnscale_run(&cli, &config, cli.steps, extra)?))
    };
    // Each row is printed as it is measured, so that a capped run still shows the rows it
    // finished.
    let (cold, ours) = measured(&[])?;
    let ours_tps = ours.tokens_per_s.unwrap_or(0.0);
    println!(
        "minGPT {}L/{}H/{} (params {}), block {}, batch {}, {} timed steps, {} on {}, {} threads",
        config.n_layer,
        config.n_head,
        config.n_embd,
        ours.num_params,
        cli.block_size,
        cli.batch_size,
        ours.timed_steps,
        cli.precision,
        cli.accelerator,
        cli.threads
    );
    println!("{:<22} {:>12} {:>10}", "", "tokens/s", "step ms");
    let step_ms = |tps: f64| 1e3 * (cli.batch_size * cli.block_size) as f64 / tps;
    println!(
        "{:<22} {:>12.0} {:>10.1}   first step {cold:.2} s (the process's first), {:.2} s (the timed run's), device {}",
        format!("burnscale ({} {})", cli.strategy, cli.flags).replace(" )", ")"),
        ours_tps,
        step_ms(ours_tps),
        ours.warmup_s,
        device_peak(&ours)
    );
    let mut others = Vec::new();
    for flags in &cli.also {
        let extra: Vec<&str> = flags.split_whitespace().collect();
        let summary = measured(&extra)?.1;
        let tps = summary.tokens_per_s.unwrap_or(0.0);
        println!(
            "  {flags}: {tps:.0} tokens/s, {:.1} ms a step ({:.2}x the first run's), first step {:.2} s, peak process memory {}, device {}",
            step_ms(tps),
            ours_tps / tps,
            summary.warmup_s,
            process_peak(&summary),
            device_peak(&summary)
        );
        others.push((flags, summary));
    }
    // The plain loop's linear layers run the first run's kernels (`--matmul`), whatever an
    // `--also` run chose since.
    ours.matmul.select();
    // Not run where asked or where it cannot run; a plain run that fails fails the bench.
    let plain = match cli.no_plain {
        true => Err("skipped (--no-plain)"),
        false if train_args(&cli, cli.warmup, &[])?.precision.is_mixed() => {
            Err("the plain loop has no autocast: run it with a *-true precision")
        }
        false => Ok(plain_run(&cli, &config)?),
    };
    match &plain {
        Ok((tps, first)) => println!(
            "{:<22} {tps:>12.0} {:>10.1}   first step {first:.2} s, burnscale/plain tokens/s {:.2}",
            "plain Burn loop",
            step_ms(*tps),
            ours_tps / tps
        ),
        Err(e) => println!("plain Burn loop: not run ({e})"),
    }
    let torch = match cli.no_torch {
        true => Err(anyhow::anyhow!("skipped (--no-torch)")),
        false => torch_run(&cli, &config),
    };
    let ratio = match &torch {
        Ok(t) => {
            let tps = t["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
            let name = format!("pytorch {}", t["torch_version"].as_str().unwrap_or("?"));
            println!(
                "{name:<22} {tps:>12.0} {:>10.1}   first step {} s",
                step_ms(tps),
                t["first_step_s"]
            );
            println!("ratio burnscale/pytorch: {:.2}", ours_tps / tps);
            Some(ours_tps / tps)
        }
        Err(e) => {
            println!("pytorch reference: not run ({e})");
            None
        }
    };
    let device_peak = device_peak(&ours);
    if let Ok(t) = &torch
        && let Some(reserved) = t["max_memory_reserved"].as_u64()
    {
        println!(
            "peak device memory: burnscale {} | pytorch {} (max_memory_reserved)",
            device_peak,
            memory::human_bytes(reserved as usize)
        );
    }
    println!(
        "peak process memory {} | model states {} (formula {:.0} B/param: {})",
        process_peak(&ours),
        memory::human_bytes(ours.model_state_bytes_per_rank),
        ours.model_state_predicted_bytes as f64 / ours.num_params.max(1) as f64,
        memory::human_bytes(ours.model_state_predicted_bytes)
    );
    if let Some(path) = &cli.summary_json {
        let report = json!({
            "burnscale": ours,
            "also": others.iter().map(|(flags, s)| json!({"flags": flags, "summary": s})).collect::<Vec<_>>(),
            "plain_tokens_per_s": plain.as_ref().ok().map(|p| p.0),
            "pytorch": torch.as_ref().ok(),
            "ratio_burnscale_over_pytorch": ratio,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    Ok(())
}
