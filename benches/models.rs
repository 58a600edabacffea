//! Forward and forward+backward time per sample of each model's base config, burnscale beside
//! HF transformers on PyTorch (scripts/bench_models_torch.py) in the same run, and every
//! preset's parameter count against its reference.
//!
//!     cargo bench --bench models                      # batch 2; text 128 tokens, BigBird 1024
//!     cargo bench --bench models -- --no-torch --repeats 1
//!
//! Both sides: random init, no dropout, classification heads, loss = sum of logits.

use std::collections::HashMap;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::Module;
use burn::prelude::*;
use burnscale::bert::{Bert, BertConfig, BertHead, BertInput};
use burnscale::bigbird::{BigBird, BigBirdConfig};
use burnscale::tasks::SequenceClassifier;
use burnscale::vit::{Vit, VitConfig};
use clap::Parser;
use serde_json::Value;

#[derive(Parser)]
struct Cli {
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 1024)]
    bigbird_seq: usize,
    /// Timed repetitions (median), after one untimed.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Threads for PyTorch (this machine has 2 cores).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[arg(long)]
    no_torch: bool,
    // `cargo bench` passes `--bench` to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Median seconds of `f` over `repeats` runs, after one untimed run.
fn timed(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

struct Timing {
    params: usize,
    forward: f64,
    forward_backward: f64,
}

/// Times `logits` (class logits of a fixed batch): forward on the eval-mode model, forward
/// and backward of their sum in training.
fn time_model<M: Module>(cli: &Cli, model: M, logits: impl Fn(&M, &Device) -> Tensor<2>) -> Timing {
    let device = Device::default().autodiff();
    let valid = model.valid();
    let inner = device.clone().inner();
    let forward = timed(cli.repeats, || {
        let _ = logits(&valid, &inner).into_data();
    });
    let forward_backward = timed(cli.repeats, || {
        let _ = logits(&model, &device).sum().backward();
    });
    let b = cli.batch as f64;
    Timing {
        params: model.num_params(),
        forward: forward / b,
        forward_backward: forward_backward / b,
    }
}

fn text_input(batch: usize, seq: usize, device: &Device) -> BertInput {
    let ids: Vec<i64> = (0..batch * seq)
        .map(|i| 1000 + (i * 7919 % 19000) as i64)
        .collect();
    BertInput {
        input_ids: Tensor::from_data(TensorData::new(ids, [batch, seq]), device),
        token_type_ids: Tensor::zeros([batch, seq], device),
        attention_mask: Tensor::ones([batch, seq], device),
    }
}

fn time_text<M: SequenceClassifier>(cli: &Cli, model: M, seq: usize) -> Timing {
    let b = cli.batch;
    time_model(cli, model, |m, d| m.logits_of(text_input(b, seq, d)))
}

fn torch_side(cli: &Cli) -> Result<HashMap<String, Value>> {
    let script = burnscale::reference_script("bench_models_torch.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--threads", &cli.threads.to_string()])
        .args(["--repeats", &cli.repeats.to_string()])
        .args(["--batch", &cli.batch.to_string()])
        .args(["--seq", &cli.seq.to_string()])
        .args(["--bigbird-seq", &cli.bigbird_seq.to_string()])
        .output()
        .context("cannot start python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{}", err.lines().last().unwrap_or("failed"));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: Value = serde_json::from_str(l)?;
            Ok((v["model"].as_str().unwrap_or("?").to_string(), v))
        })
        .collect()
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    println!("parameter counts (config formula = built model = reference):");
    let device = Device::default();
    let counts: [(&str, usize, usize, &str); 5] = [
        (
            "ViT-L/16",
            VitConfig::vit_l_16().num_params(),
            Vit::new(&VitConfig::vit_l_16(), &device)?.num_params(),
            "304M",
        ),
        (
            "BERT-large",
            BertConfig::bert_large().num_params(),
            Bert::new(&BertConfig::bert_large(), &device)?.num_params(),
            "335M",
        ),
        (
            "BERT-base",
            BertConfig::bert_base().num_params(),
            Bert::new(&BertConfig::bert_base(), &device)?.num_params(),
            "110M",
        ),
        (
            "BigBird-RoBERTa-base",
            BigBirdConfig::bigbird_roberta_base().num_params(),
            BigBird::new(&BigBirdConfig::bigbird_roberta_base(), &device)?.num_params(),
            "128M",
        ),
        (
            "DistilBERT-base",
            BertConfig::distilbert_base().num_params(),
            Bert::new(&BertConfig::distilbert_base(), &device)?.num_params(),
            "66M",
        ),
    ];
    for (name, formula, built, reference) in counts {
        println!("  {name:<22} {formula:>12} {built:>12}   {reference}");
        if formula != built {
            bail!("{name}: the config counts {formula} parameters but the model has {built}");
        }
    }

    let device = Device::default().autodiff();
    device.seed(0);
    let (b, seq, big) = (cli.batch, cli.seq, cli.bigbird_seq);
    let cls = |c: BertConfig| {
        c.with_dropout(0.0)
            .with_head(BertHead::SequenceClassification { num_labels: 2 })
    };
    // As the BERT rows: no dropout (the PyTorch script sets every Dropout's p to 0).
    let no_dropout = |c: BigBirdConfig| c.with_dropout(0.0).with_num_labels(2);
    let pixels = move |d: &Device| Tensor::<4>::ones([b, 3, 224, 224], d);
    let ours: Vec<(&str, String, Timing)> = vec![
        (
            "vit-b-16",
            format!("{b} images 224 px"),
            time_model(&cli, Vit::new(&VitConfig::vit_b_16(), &device)?, |m, d| {
                m.forward(pixels(d))
            }),
        ),
        (
            "bert-base",
            format!("{b} x {seq} tokens"),
            time_text(
                &cli,
                Bert::new(&cls(BertConfig::bert_base()), &device)?,
                seq,
            ),
        ),
        (
            "distilbert-base",
            format!("{b} x {seq} tokens"),
            time_text(
                &cli,
                Bert::new(&cls(BertConfig::distilbert_base()), &device)?,
                seq,
            ),
        ),
        (
            "bigbird-roberta-base",
            format!("{b} x {big} tokens, block-sparse"),
            time_text(
                &cli,
                BigBird::new(&no_dropout(BigBirdConfig::bigbird_roberta_base()), &device)?,
                big,
            ),
        ),
    ];
    let torch = if cli.no_torch {
        Err(anyhow::anyhow!("skipped (--no-torch)"))
    } else {
        torch_side(&cli)
    };

    println!(
        "\nseconds per sample (median of {}), burnscale on Flex vs PyTorch ({} threads):",
        cli.repeats, cli.threads
    );
    println!(
        "  {:<22} {:<28} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7}",
        "model", "batch", "fwd", "torch", "ratio", "fwd+bwd", "torch", "ratio"
    );
    for (name, batch, t) in &ours {
        let reference = torch.as_ref().ok().and_then(|m| m.get(*name));
        let get = |key: &str| reference.and_then(|v| v[key].as_f64()).unwrap_or(f64::NAN);
        let (tf, tfb) = (
            get("forward_s_per_sample"),
            get("forward_backward_s_per_sample"),
        );
        println!(
            "  {name:<22} {batch:<28} {:>9.3} {tf:>9.3} {:>7.2} {:>9.3} {tfb:>9.3} {:>7.2}",
            t.forward,
            t.forward / tf,
            t.forward_backward,
            t.forward_backward / tfb
        );
        if let Some(p) = reference.and_then(|v| v["params"].as_u64())
            && p as usize != t.params
        {
            println!("    parameters: burnscale {} vs transformers {p}", t.params);
        }
    }
    if let Err(e) = &torch {
        println!("  pytorch reference: not run ({e})");
    }
    println!("  (ratio = burnscale / PyTorch time; above 1 is slower)");
    Ok(())
}
