//! The sharded-DDP article's comparison (000): a BERT classifier trained with DDP and with
//! "sharded" DDP (optimizer state and gradients sharded, ZeRO-2: Lightning's
//! `ddp_sharded`) at N = 2 and 4 ranks; per-rank model states, the process peak, and
//! samples/s, as ratios to DDP at 2 ranks and sharded over DDP at the same N.
//!
//!     cargo bench --bench sharded_ddp               # bert-base, 128 tokens, batch 4 a rank
//!     cargo bench --bench sharded_ddp -- --quick    # MiniLM-L6 size, 64 tokens, batch 2
//!
//! Scaled for a CPU: the article's bert-base on 2 and 4 thread ranks instead of its 8 GPUs,
//! a few steps. The ranks
//! are threads of one process, so the peak is the process's (all ranks together); the
//! engine's per-rank model states and the planner's per-rank peak are each rank's own. The
//! article gives no figures, only its claim: sharding lets each GPU hold about twice the
//! model.

mod article_table;

use anyhow::{Result, bail};
use article_table::{Table, cell, mib, num, planned_off, ratios};
use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead};
use burnscale::plan_check::PLANNED_ON_CPU;
use burnscale::tasks::TextClassification;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, train};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// (label, strategy, ranks) of each row.
const ROWS: [(&str, &str, usize); 4] = [
    ("DDP x 2", "ddp", 2),
    ("sharded x 2", "zero2", 2),
    ("DDP x 4", "ddp", 4),
    ("sharded x 4", "zero2", 4),
];

#[derive(Parser)]
struct Cli {
    /// A MiniLM-L6-sized BERT, 64 tokens, batch 2 a rank, 2 steps (a smoke run for CI).
    #[arg(long)]
    quick: bool,
    /// Worker mode (set by the driver): run one row.
    #[arg(long, hide = true)]
    row: Option<usize>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Cli {
    /// (model, sequence length, batch per rank, steps).
    fn setup(&self) -> (BertConfig, usize, usize, usize) {
        let (config, len, batch, steps) = match self.quick {
            true => (BertConfig::minilm_l6(), 64, 2, 2),
            false => (BertConfig::bert_base(), 128, 4, 3),
        };
        let config = config
            .with_head(BertHead::SequenceClassification { num_labels: 2 })
            .with_dropout(0.0);
        (config, len, batch, steps)
    }
}

fn worker(cli: &Cli, row: usize) -> Result<()> {
    let Some(&(_, strategy, ranks)) = ROWS.get(row) else {
        bail!("no row {row}");
    };
    let device = Device::flex().autodiff();
    device.seed(1);
    let (config, len, batch, steps) = cli.setup();
    let (ranks, batch, steps) = (ranks.to_string(), batch.to_string(), steps.to_string());
    let flags = [
        "--strategy",
        strategy,
        "--devices",
        &ranks,
        "--batch-size",
        &batch,
        "--max-steps",
        &steps,
        "--lr",
        "2e-5",
    ];
    let args = TrainArgs::from_flags(&[&flags[..], &PLANNED_ON_CPU].concat())?;
    let mut task =
        TextClassification::<Bert>::random_tokens(&[len; 64], &[len; 2], args.batch_size)?;
    let summary = train(Bert::new(&config, &device)?, &mut task, &args, &device)?.1;
    article_table::print_summary(&summary)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(row) = cli.row {
        return worker(&cli, row);
    }
    let mut runs: Vec<Value> = Vec::new();
    for (row, (label, ..)) in ROWS.iter().enumerate() {
        eprintln!("{label}");
        let mut args = vec!["--row".to_string(), row.to_string()];
        if cli.quick {
            args.push("--quick".into());
        }
        runs.push(burnscale::run_worker(&args)?);
    }
    let column = |path: &str| -> Vec<Option<f64>> { runs.iter().map(|r| num(r, path)).collect() };
    let peaks = column("/peak_mem_bytes");
    let states = column("/model_state_bytes_per_rank");
    let speeds = column("/samples_per_s");
    let (peak_ratio, state_ratio, speed_ratio) = (ratios(&peaks), ratios(&states), ratios(&speeds));
    // Sharded over DDP at the same number of ranks (the rows go DDP, sharded, DDP, sharded).
    let over_ddp = |v: &[Option<f64>], i: usize| Some(v[i]? / v[i - i % 2]?);
    let rows = (0..ROWS.len())
        .map(|i| {
            let planned = num(&runs[i], "/planned_peak_mem_bytes");
            vec![
                json!(ROWS[i].0),
                cell(states[i].map(mib)),
                cell(num(&runs[i], "/plan/rank_peak").map(mib)),
                cell(peaks[i].map(mib)),
                cell(planned.map(mib)),
                planned_off(planned, peaks[i]),
                cell(speeds[i]),
                cell(state_ratio[i]),
                cell(peak_ratio[i]),
                cell(speed_ratio[i]),
                cell(over_ddp(&states, i)),
                cell(over_ddp(&peaks, i)),
                cell(over_ddp(&speeds, i)),
            ]
        })
        .collect();
    let (config, len, batch, steps) = cli.setup();
    Table {
        name: if cli.quick { "sharded_ddp_quick" } else { "sharded_ddp" },
        title: format!(
            "Sharded DDP article (000): BERT classifier, {} parameters, batch {batch} x {len} tokens a rank, AdamW, {steps} steps",
            config.num_params()
        ),
        notes: vec![
            "rank states: the engine's parameters + gradients + optimizer state on each rank; rank planned: the planner's per-rank peak".into(),
            "process peak: the counting allocator's peak of the process that runs all ranks as threads; planned: the planner's".into(),
            "the article has no figures for this model (its claim: about twice the model per GPU)".into(),
        ],
        columns: vec![
            "run",
            "rank states MiB",
            "rank planned MiB",
            "process peak MiB",
            "planned MiB",
            "planned off %",
            "samples/s",
            "states ratio",
            "peak ratio",
            "speed ratio",
            "states vs DDP",
            "peak vs DDP",
            "speed vs DDP",
        ],
        rows,
        // Against DDP at the same N: a process of 4 thread ranks peaks above one of 2 by the
        // ranks it holds, not by the strategy.
        plotted: vec!["states vs DDP", "peak vs DDP", "speed vs DDP"],
    }
    .finish()?;
    Ok(())
}
