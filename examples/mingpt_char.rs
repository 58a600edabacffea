//! Character-level minGPT on Shakespeare (eight plays, CC BY 2.5; see data/shakespeare/).
//!
//!     cargo run --release --example mingpt_char -- --max-steps 200 --summary-json /tmp/s.json

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::prelude::*;
use burnscale::collective::launcher_rank;
use burnscale::mingpt::{Gpt, GptConfig, Sampling, loader};
use burnscale::tasks::NextToken;
use burnscale::train::TrainArgs;
use burnscale::train::checkpoint::config_path;
use burnscale::train::memory::CountingAllocator;
use clap::Parser;
use rand::SeedableRng;
use sha2::{Digest, Sha256};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const SHAKESPEARE: &str = include_str!("../data/shakespeare/input.txt");

#[derive(Parser)]
#[command(about = "Train a character-level minGPT on Shakespeare")]
struct Cli {
    /// minGPT model type (gpt-nano, gpt-micro, gpt-mini, gopher-44m, gpt2, ...).
    #[arg(long, default_value = "gpt-micro")]
    model: String,
    /// Override the preset's layer count.
    #[arg(long)]
    n_layer: Option<usize>,
    /// Override the preset's head count.
    #[arg(long)]
    n_head: Option<usize>,
    /// Override the preset's width.
    #[arg(long)]
    n_embd: Option<usize>,
    /// Context length in characters.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Dropout of embeddings, attention and residual paths (minGPT uses 0.1; these short
    /// runs learn faster without).
    #[arg(long, default_value_t = 0.0, value_parser = burnscale::parse_dropout)]
    dropout: f64,
    /// A UTF-8 text file to train on instead of the bundled Shakespeare.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 20)]
    eval_batches: usize,
    /// Characters to sample after training (0: none). Under zero3 sampling gathers the
    /// whole model on every rank first.
    #[arg(long, default_value_t = 300)]
    sample_len: usize,
    /// Start from these GPT-2-layout safetensors weights (e.g. an earlier `--save`).
    #[arg(long)]
    weights: Option<PathBuf>,
    #[command(flatten)]
    train: TrainArgs,
}

/// The field of the recorded configuration that holds the characters, in token order.
const CHARACTERS: &str = "characters";

/// Characters <-> token ids, the sorted set of characters in the text.
struct CharVocab {
    chars: Vec<char>,
}

impl CharVocab {
    fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self { chars }
    }

    fn encode(&self, text: &str) -> Vec<i64> {
        text.chars()
            .filter_map(|c| self.chars.binary_search(&c).ok())
            .map(|i| i as i64)
            .collect()
    }

    fn decode(&self, tokens: &[usize]) -> String {
        tokens.iter().filter_map(|&t| self.chars.get(t)).collect()
    }

    /// The characters, in token order.
    fn table(&self) -> String {
        self.chars.iter().collect()
    }

    /// Fails when `weights` were trained on another character table than this text's: a
    /// token id means nothing without its text's table, which the run's configuration
    /// (written beside the weights by `--save` and `consolidate`) records.
    fn check_beside(&self, weights: &Path) -> Result<()> {
        let path = config_path(weights);
        let saved = match std::fs::read_to_string(&path) {
            Ok(saved) => saved,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!(
                    "warning: no {} beside the weights: their token ids are taken to be this text's {} characters",
                    path.display(),
                    self.chars.len()
                );
                return Ok(());
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let saved: serde_json::Value = serde_json::from_str(&saved)
            .with_context(|| format!("{} is not a JSON configuration", path.display()))?;
        let Some(saved) = saved.get(CHARACTERS).and_then(serde_json::Value::as_str) else {
            bail!(
                "{} records no `{CHARACTERS}`: weights of another program's run?",
                path.display()
            );
        };
        let ours = self.table();
        if saved != ours {
            bail!(
                "the weights were trained on other characters ({} in {}: {saved:?}) than this text's ({}: {ours:?}): train on the same text",
                saved.chars().count(),
                path.display(),
                self.chars.len()
            );
        }
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    // Runner defaults for this example that reach val loss < 2.0 in a few minutes on 2 CPU
    // cores (as nanoGPT's CPU recipe for a 4-layer char model: short context, no dropout,
    // a high learning rate after a warm-up).
    let mut cli: Cli = burnscale::parse_with_defaults(&[
        ("warmup_steps", "100"),
        ("max_steps", "2500"),
        ("eval_interval", "250"),
    ]);
    cli.train = cli.train.with_default_lr(2e-3);
    cli.train.validate_launch()?;
    if let Some(path) = &cli.weights {
        cli.train
            .check_loaded_weights(&format!("--weights {}", path.display()))?;
    }
    let text = match &cli.data {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read training text {}", path.display()))?,
        None => SHAKESPEARE.to_string(),
    };
    let vocab = CharVocab::new(&text);
    let tokens = vocab.encode(&text);
    if tokens.len() / 20 < cli.block_size {
        bail!(
            "{} characters is too little text for block size {} (20 windows at least): give a smaller --block-size or a larger --data file",
            tokens.len(),
            cli.block_size
        );
    }
    let split = tokens.len() * 9 / 10;
    let mut config =
        GptConfig::preset(&cli.model, vocab.chars.len(), cli.block_size)?.with_dropout(cli.dropout);
    config.n_layer = cli.n_layer.unwrap_or(config.n_layer);
    config.n_head = cli.n_head.unwrap_or(config.n_head);
    config.n_embd = cli.n_embd.unwrap_or(config.n_embd);
    config.validate()?;

    let device = cli.train.device()?;
    device.seed(cli.train.seed);
    let model = match &cli.weights {
        Some(path) => {
            vocab.check_beside(path)?;
            loader::load(path, &config, &device)?
        }
        None => Gpt::new(&config, &device)?,
    };
    // Under mpirun every process runs this program; one of them speaks and saves.
    let lead = launcher_rank() == 0;
    if lead {
        println!(
            "minGPT {} ({} layers, {} heads, width {}): {} parameters, vocab {}, {} train / {} val chars",
            cli.model,
            config.n_layer,
            config.n_head,
            config.n_embd,
            config.num_params(),
            config.vocab_size,
            split,
            tokens.len() - split
        );
    }

    let mut task = NextToken::new(
        tokens[..split].to_vec(),
        cli.block_size,
        cli.train.batch_size,
        cli.train.seed,
    )?
    .with_validation(tokens[split..].to_vec(), cli.block_size, cli.eval_batches)?;
    // A checkpoint records the characters the token ids stand for beside the configuration:
    // resumed on another text of as many characters, the ids would read as other ones.
    let mut recorded = serde_json::to_value(config)?;
    recorded[CHARACTERS] = vocab.table().into();
    // And the text, by its digest: resumed on another one (of the same characters, whose ids
    // still read), a run would train on other windows and validate on what it trained on.
    let digest = format!("{:x}", Sha256::digest(text.as_bytes()));
    let data = serde_json::json!({ "characters": tokens.len(), "sha256": digest });
    // Sampling reads the whole model: under zero3 it is gathered for it.
    let mut args = cli.train.with_model_and_data(&recorded, data)?;
    args.gather_model = cli.sample_len > 0;
    let (model, summary) = burnscale::train_stopping_on_signals(model, &mut task, &args, &device)?;
    if !lead {
        return Ok(());
    }
    print!("{}", summary.table());

    if let Some(model) = model.filter(|_| cli.sample_len > 0) {
        let model = model.valid();
        let mut rng = rand::rngs::StdRng::seed_from_u64(cli.train.seed);
        // Shakespeare's words, or where the text has none of their characters its first one.
        let prompt = match vocab.encode("O God, O God!") {
            words if !words.is_empty() => words,
            _ => tokens[..1].to_vec(),
        };
        let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
        let sampling = Sampling::TopK {
            k: 10,
            temperature: 0.8,
        };
        let device = device.inner();
        let out = model.generate(&prompt, cli.sample_len, sampling, &mut rng, &device)?;
        println!("--- sample ---\n{}\n--------------", vocab.decode(&out));
    }
    Ok(())
}
