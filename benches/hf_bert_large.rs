//! The HF article's table (003, "Efficient training on a single GPU"): BERT-large sequence
//! classification on random tokens, one device, rung by rung: vanilla batch 4, batch 1 x 4
//! accumulated, + gradient checkpointing, fp16, all of them together, then Adafactor and
//! 8-bit AdamW at batch 4 and with everything; peak memory, samples/s and the model states'
//! bytes per parameter (the article's 18 B/param for mixed-precision AdamW) per rung, beside
//! the article's V100 figures, both as ratios to the vanilla rung.
//!
//!     cargo bench --bench hf_bert_large               # BERT-large, 128 tokens, 3 steps a rung
//!     cargo bench --bench hf_bert_large -- --quick    # MiniLM-L6 size, 64 tokens, 2 steps
//!     cargo bench --features cuda --bench hf_bert_large   # on a GPU: 512 tokens, 5 steps
//!
//! On a GPU (`--accelerator cuda`, the default in a `cuda` build on a machine with one) the
//! rungs run at the article's 512 tokens, the peak is the device pool's reserved bytes and
//! the plan the device plan's (none for the fp16 rungs). Scaled for a CPU: sequences of 128
//! tokens instead of 512 (activations are a smaller share of the peak than in the article),
//! a few steps instead of an epoch. The article's
//! `nvidia-smi` figures include ~1.3 GB of CUDA kernels (its 1343 MB before the model loads);
//! its ratios here are taken after subtracting them. On Flex (the CPU backend) fp16 is
//! stored in 16 bits but computed through f32, so the fp16 rungs save memory, not time.

mod article_table;

use anyhow::{Result, bail};
use article_table::{Machine, Table, cell, mib, num, planned_off, ratios};
use burnscale::bert::{Bert, BertConfig, BertHead};
use burnscale::tasks::TextClassification;
use burnscale::train::accelerator::Accelerator;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::train;
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The article's CUDA kernels and context, in every `nvidia-smi` figure (MB).
const ARTICLE_KERNELS_MB: f64 = 1343.0;

const BATCH_4: &[&str] = &["--batch-size", "4"];
const ACCUMULATE: &[&str] = &["--batch-size", "1", "--accumulate", "4"];
const CKPT: &[&str] = &["--checkpoint-activations"];
const FP16: &[&str] = &["--precision", "16-mixed"];
/// The article's full combination.
const ALL: &[&[&str]] = &[ACCUMULATE, CKPT, FP16];
const ADAFACTOR: &[&str] = &["--optimizer", "adafactor"];
const ADAM_8BIT: &[&str] = &["--optimizer", "adam8bit"];

/// The article's rungs: label, runner flags (concatenated), its `nvidia-smi` MB and
/// samples/s on a V100.
type Rung = (&'static str, &'static [&'static [&'static str]], f64, f64);

const RUNGS: [Rung; 9] = [
    ("vanilla, batch 4", &[BATCH_4], 14949.0, 8.86),
    ("batch 1 x accumulate 4", &[ACCUMULATE], 8681.0, 7.75),
    (
        "+ gradient checkpointing",
        &[ACCUMULATE, CKPT],
        6775.0,
        5.99,
    ),
    ("fp16, batch 4", &[BATCH_4, FP16], 13939.0, 18.64),
    ("1x4 + ckpt + fp16", ALL, 7275.0, 10.09),
    ("Adafactor, batch 4", &[BATCH_4, ADAFACTOR], 12295.0, 7.96),
    (
        "Adafactor, 1x4 + ckpt + fp16",
        &[ACCUMULATE, CKPT, FP16, ADAFACTOR],
        4847.0,
        9.06,
    ),
    ("8-bit AdamW, batch 4", &[BATCH_4, ADAM_8BIT], 13085.0, 9.15),
    (
        "8-bit AdamW, 1x4 + ckpt + fp16",
        &[ACCUMULATE, CKPT, FP16, ADAM_8BIT],
        5363.0,
        10.35,
    ),
];

#[derive(Parser)]
struct Cli {
    /// A MiniLM-L6-sized BERT, 64 tokens, 2 steps a rung (a smoke run for CI).
    #[arg(long)]
    quick: bool,
    /// Optimizer steps per rung (the median step time is taken).
    #[arg(long)]
    steps: Option<usize>,
    /// Worker mode (set by the driver): run one rung.
    #[arg(long, hide = true)]
    rung: Option<usize>,
    /// Where the rungs run: cpu, cuda or cubecl-cpu.
    #[arg(long, value_enum)]
    accelerator: Option<Accelerator>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Cli {
    fn machine(&self) -> Machine {
        Machine::of(self.accelerator)
    }

    fn steps(&self) -> usize {
        self.steps
            .unwrap_or_else(|| self.machine().steps(self.quick))
    }

    /// (model, sequence length).
    fn model(&self) -> (BertConfig, usize) {
        let config = match self.quick {
            true => BertConfig::minilm_l6(),
            false => BertConfig::bert_large(),
        };
        let config = config
            .with_head(BertHead::SequenceClassification { num_labels: 2 })
            .with_dropout(0.0);
        let len = match (self.quick, self.machine().at_article_size()) {
            (true, _) => 64,
            (false, false) => 128,
            (false, true) => 512,
        };
        (config, len)
    }
}

fn worker(cli: &Cli, rung: usize) -> Result<()> {
    let Some((_, parts, ..)) = RUNGS.get(rung) else {
        bail!("no rung {rung}");
    };
    let steps = cli.steps().to_string();
    let common = ["--max-steps", &steps, "--lr", "1e-4"];
    let args = cli
        .machine()
        .train_args(&[&common[..], &parts.concat()[..]].concat())?;
    let device = args.device()?;
    device.seed(1);
    let (config, len) = cli.model();
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
    if let Some(rung) = cli.rung {
        return worker(&cli, rung);
    }
    let steps = cli.steps().to_string();
    let mut runs: Vec<Value> = Vec::new();
    for (rung, (label, ..)) in RUNGS.iter().enumerate() {
        let mut args = vec![
            "--rung".to_string(),
            rung.to_string(),
            "--steps".into(),
            steps.clone(),
        ];
        if cli.quick {
            args.push("--quick".into());
        }
        args.extend(cli.machine().worker_flags());
        eprintln!("rung {}: {label}", rung + 1);
        let run = burnscale::run_worker(&args)?;
        // Each rung's summary as it ends: a run cut short keeps the rungs it finished.
        eprintln!("{run}");
        runs.push(run);
    }
    let peaks: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/rank_peak")).collect();
    let speeds: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/samples_per_s")).collect();
    let article_mb: Vec<Option<f64>> = RUNGS
        .iter()
        .map(|r| Some(r.2 - ARTICLE_KERNELS_MB))
        .collect();
    let article_speed: Vec<Option<f64>> = RUNGS.iter().map(|r| Some(r.3)).collect();
    let (peak_ratio, speed_ratio) = (ratios(&peaks), ratios(&speeds));
    let (article_ratio, article_speed_ratio) = (ratios(&article_mb), ratios(&article_speed));
    let rows = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let planned = num(r, "/rank_planned");
            let states = ["params", "grads", "optimizer"]
                .iter()
                .filter_map(|k| num(r, &format!("/model_state/{k}")))
                .sum::<f64>();
            vec![
                json!(RUNGS[i].0),
                cell(peaks[i].map(mib)),
                cell(planned.map(mib)),
                planned_off(planned, peaks[i]),
                cell(num(r, "/num_params").map(|n| states / n)),
                cell(speeds[i]),
                cell(peak_ratio[i]),
                cell(article_ratio[i]),
                cell(speed_ratio[i]),
                cell(article_speed_ratio[i]),
                json!(RUNGS[i].2),
                json!(RUNGS[i].3),
            ]
        })
        .collect();
    let (config, len) = cli.model();
    Table {
        name: if cli.quick { "hf_bert_large_quick" } else { "hf_bert_large" },
        title: format!(
            "HF article (003): {} parameters, sequences of {len} tokens, one device, {} steps a rung",
            config.num_params(),
            cli.steps()
        ),
        notes: vec![
            cli.machine().peak_note(),
            "state B/p: parameters + gradients + optimizer state per parameter (the article: 18 for mixed-precision AdamW)".into(),
            format!("article: V100 nvidia-smi MB and samples/s; its ratios without its {ARTICLE_KERNELS_MB} MB of CUDA kernels"),
        ],
        columns: vec![
            "rung",
            "peak MiB",
            "planned MiB",
            "planned off %",
            "state B/p",
            "samples/s",
            "peak ratio",
            "article peak ratio",
            "speed ratio",
            "article speed ratio",
            "article MB",
            "article samples/s",
        ],
        rows,
        plotted: vec!["peak ratio", "article peak ratio"],
    }
    .finish()?;
    Ok(())
}
