//! The DeepSpeed article's table (002): the largest minGPT that trains within a memory budget
//! per rank at N = 4 ranks under DDP, ZeRO-3, and ZeRO-3 with the optimizer state offloaded,
//! and the peak of that largest model with activation checkpointing. The planner chooses the
//! candidate (the largest width whose planned per-rank peak fits); measurement confirms it
//! (4 MPI processes, each rank's own peak: the chosen size fits, the next one up does not),
//! stepping down where the measurement disagrees.
//!
//!     cargo bench --features mpi --bench deepspeed_mingpt                 # 384 MiB a rank
//!     cargo bench --features mpi --bench deepspeed_mingpt -- --quick      # 64 MiB a rank
//!
//! Scaled for a CPU: a budget of MiB instead of an A100's 80 GB, 8 blocks (quick: 4) whose
//! width grows in steps of 128 (quick: 64), characters as tokens, batch 1 x 128 a rank,
//! 16-mixed AdamW as in the article, 2 steps. On a CPU, host memory is the device's, so
//! "offload" puts the optimizer state on disk (`--offload-dir`, ZeRO-Infinity's tier) rather
//! than in host memory. The article's sizes are compared as ratios to DDP's.

mod article_table;

use anyhow::{Result, bail};
use article_table::{Table, cell, mib, num, planned_off, ratios};
use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::plan_check::PLANNED_ON_CPU;
use burnscale::tasks::NextToken;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::plan::{MemoryPlan, Probe};
use burnscale::train::{TrainArgs, train};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const RANKS: usize = 4;
const BLOCK: usize = 128;
const VOCAB: usize = 65;

/// (label, runner flags, the article's largest model in billions of parameters).
const ROWS: [(&str, &[&str], Option<f64>); 4] = [
    ("DDP", &["--strategy", "ddp"], Some(1.7)),
    ("ZeRO-3", &["--strategy", "zero3"], Some(12.8)),
    (
        "ZeRO-3 + offload",
        &["--strategy", "zero3", "--offload-dir"],
        Some(45.0),
    ),
    (
        "ZeRO-3 + offload + ckpt",
        &[
            "--strategy",
            "zero3",
            "--checkpoint-activations",
            "--offload-dir",
        ],
        None,
    ),
];

/// The article's peaks (MiB) of its rows: DDP at 1.7B, ZeRO-3 at 12.8B, ZeRO-3 with CPU
/// offload at 45B, without and with checkpointing.
const ARTICLE_PEAKS: [f64; 4] = [36148.55, 7796.98, 4976.98, 2192.98];

#[derive(Parser)]
struct Cli {
    /// 64 MiB a rank, 4 blocks, widths in steps of 64 (a smoke run for CI).
    #[arg(long)]
    quick: bool,
    /// The memory budget of each rank, MiB.
    #[arg(long)]
    budget_mib: Option<f64>,
    /// Worker mode (set by the driver, under mpirun): train row `--row` at width `--width`.
    #[arg(long, hide = true)]
    row: Option<usize>,
    #[arg(long, hide = true)]
    width: Option<usize>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Cli {
    fn budget(&self) -> usize {
        let mib = self
            .budget_mib
            .unwrap_or(if self.quick { 64.0 } else { 384.0 });
        (mib * (1u64 << 20) as f64) as usize
    }

    /// The family's widths, smallest first, and its depth.
    fn family(&self) -> (impl Iterator<Item = usize>, usize) {
        let (step, layers) = if self.quick { (64, 4) } else { (128, 8) };
        ((1..=64).map(move |k| k * step), layers)
    }

    fn config(&self, width: usize) -> GptConfig {
        GptConfig::new(self.family().1, 8, width, VOCAB, BLOCK).with_dropout(0.0)
    }
}

fn args(row: usize) -> Result<TrainArgs> {
    let offload_dir = std::env::temp_dir().display().to_string();
    let mut flags = vec![
        "--batch-size",
        "1",
        "--max-steps",
        "2",
        "--precision",
        "16-mixed",
        "--lr",
        "1e-4",
    ];
    flags.extend(PLANNED_ON_CPU);
    flags.extend(ROWS[row].1);
    if flags.last() == Some(&"--offload-dir") {
        flags.push(&offload_dir);
    }
    Ok(TrainArgs::from_flags(&flags)?)
}

fn task() -> Result<NextToken> {
    let tokens = (0..1 << 16).map(|i| (i * 31 % VOCAB) as i64).collect();
    Ok(NextToken::new(tokens, BLOCK, 1, 1)?)
}

/// The planner's peak of one of `RANKS` processes (a rank each) for `row` at `width`, the
/// process's baseline in it, as the measured peak has it. The model is never initialised:
/// the probe zero-copies one block.
fn planned(cli: &Cli, row: usize, width: usize, device: &Device) -> Result<usize> {
    let args = args(row)?;
    let model = Gpt::new(&cli.config(width), device)?;
    let probe = Probe::measure(&model, &task()?, &args, device)?;
    Ok(MemoryPlan::new(&model, &args, RANKS, 1, probe)?.rank_share())
}

/// One rank of a measured run (under mpirun): rank 0 prints the largest rank peak.
fn worker(cli: &Cli, row: usize, width: usize) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(1);
    let args = args(row)?;
    let summary = train(
        Gpt::new(&cli.config(width), &device)?,
        &mut task()?,
        &args,
        &device,
    )?
    .1;
    article_table::print_summary(&summary)
}

fn measure(cli: &Cli, row: usize, width: usize) -> Result<Value> {
    eprintln!("  measuring width {width} on {RANKS} MPI processes");
    let mut args = vec![
        "--row".to_string(),
        row.to_string(),
        "--width".into(),
        width.to_string(),
    ];
    if cli.quick {
        args.push("--quick".into());
    }
    burnscale::run_mpi_worker(RANKS, &args)
}

/// A row's search: (the width measured to fit, its measurement, the measurement one width up,
/// the planner's choice).
fn search(cli: &Cli, row: usize, device: &Device) -> Result<(usize, Value, Value, Option<usize>)> {
    let budget = cli.budget();
    let (widths, _) = cli.family();
    let widths: Vec<usize> = widths.collect();
    let mut chosen = None;
    for (i, &width) in widths.iter().enumerate() {
        let plan = planned(cli, row, width, device)?;
        eprintln!(
            "  width {width}: planned {:.1} MiB a rank",
            mib(plan as f64)
        );
        if plan > budget {
            break;
        }
        chosen = Some(i);
    }
    let Some(planner_choice) = chosen else {
        bail!(
            "{}: even width {} is planned over the budget",
            ROWS[row].0,
            widths[0]
        );
    };
    let fits = |m: &Value| m["rank_peak"].as_f64().is_some_and(|p| p <= budget as f64);
    let mut i = planner_choice;
    let mut fit = measure(cli, row, widths[i])?;
    while !fits(&fit) {
        let Some(down) = i.checked_sub(1) else {
            bail!(
                "{}: width {} measured over the budget",
                ROWS[row].0,
                widths[i]
            );
        };
        i = down;
        fit = measure(cli, row, widths[i])?;
    }
    let up = |i: usize| match widths.get(i + 1) {
        Some(&width) => measure(cli, row, width),
        None => bail!(
            "{}: width {} fits; widen the family",
            ROWS[row].0,
            widths[i]
        ),
    };
    let mut above = up(i)?;
    while fits(&above) {
        i += 1;
        fit = above;
        above = up(i)?;
    }
    Ok((widths[i], fit, above, Some(widths[planner_choice])))
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let (Some(row), Some(width)) = (cli.row, cli.width) {
        return worker(&cli, row, width);
    }
    if !cfg!(feature = "mpi") {
        bail!(
            "the measured runs are MPI processes: cargo bench --features mpi --bench deepspeed_mingpt"
        );
    }
    let device = Device::flex().autodiff();
    let mut found = Vec::new();
    // The first three rows search; the last measures the offload row's size with checkpointing.
    for (row, (label, ..)) in ROWS.iter().enumerate().take(3) {
        eprintln!("{label}: searching");
        found.push(search(&cli, row, &device)?);
    }
    let offload_width = found[2].0;
    eprintln!("{}: width {offload_width}", ROWS[3].0);
    let ckpt = measure(&cli, 3, offload_width)?;
    // The offload row's width, measured with checkpointing: no search, no plan chose it.
    found.push((offload_width, ckpt, Value::Null, None));

    let sizes: Vec<Option<f64>> = found.iter().map(|f| num(&f.1, "/num_params")).collect();
    let article: Vec<Option<f64>> = ROWS.iter().map(|r| r.2).collect();
    let (size_ratio, article_ratio) = (ratios(&sizes[..3]), ratios(&article[..3]));
    let rows = found
        .iter()
        .enumerate()
        .map(|(i, (width, fit, above, choice))| {
            let (peak, planned) = (num(fit, "/rank_peak"), num(fit, "/rank_planned"));
            vec![
                json!(ROWS[i].0),
                json!(width),
                json!(choice),
                cell(sizes[i].map(|p| p / 1e6)),
                cell(peak.map(mib)),
                cell(planned.map(mib)),
                planned_off(planned, peak),
                cell(num(above, "/rank_peak").map(mib)),
                cell(num(fit, "/tokens_per_s")),
                cell(size_ratio.get(i).copied().flatten()),
                cell(article_ratio.get(i).copied().flatten()),
                cell(ROWS[i].2),
                cell(Some(ARTICLE_PEAKS[i])),
            ]
        })
        .collect();
    let (_, layers) = cli.family();
    Table {
        name: if cli.quick { "deepspeed_mingpt_quick" } else { "deepspeed_mingpt" },
        title: format!(
            "DeepSpeed article (002): the largest minGPT ({layers} blocks, 8 heads, width searched) in {:.0} MiB a rank, {RANKS} ranks, 16-mixed AdamW, batch 1 x {BLOCK}",
            mib(cli.budget() as f64)
        ),
        notes: vec![
            "planner's: the width the planner chose; width: the largest measured to fit (each rank's own peak, 4 MPI processes)".into(),
            "peak above: the largest rank peak one width up (over the budget, as it must be)".into(),
            "offload: the optimizer state on disk (--offload-dir); the last row is the offload row's model with checkpointing".into(),
            "article: 8 A100s, fp16; its largest models in billions of parameters and its peaks in MiB".into(),
        ],
        columns: vec![
            "run",
            "width",
            "planner's",
            "params M",
            "peak MiB",
            "planned MiB",
            "planned off %",
            "peak above MiB",
            "tokens/s",
            "size ratio",
            "article size ratio",
            "article B params",
            "article peak MiB",
        ],
        rows,
        plotted: vec!["size ratio", "article size ratio"],
    }
    .finish()?;
    Ok(())
}
