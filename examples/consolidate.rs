//! A sharded checkpoint (`--checkpoint-dir`) as one safetensors file in the model's own
//! checkpoint layout (HF names and layouts: the file `--weights` loads), written one
//! parameter at a time; or, with `--inspect`, what a checkpoint holds.
//!
//!     cargo run --release --example consolidate -- runs/ckpt model.safetensors
//!     cargo run --release --example consolidate -- runs/ckpt/step-00000300 out.safetensors --with-optimizer   # + out.optimizer.safetensors
//!     cargo run --release --example consolidate -- --inspect runs/ckpt
//!
//! A directory of checkpoints means its newest complete one.

use std::path::PathBuf;

use anyhow::{Result, bail};
use burnscale::train::checkpoint::{Checkpoint, optimizer_path};
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// A checkpoint (`step-N`), or a --checkpoint-dir (its newest complete checkpoint).
    checkpoint: PathBuf,
    /// The safetensors file to write.
    out: Option<PathBuf>,
    /// Also write every optimizer state tensor (whole, f32) to OUT's stem with
    /// `.optimizer.safetensors`, beside the model.
    #[arg(long)]
    with_optimizer: bool,
    /// List what the checkpoint holds instead of writing anything.
    #[arg(long, conflicts_with_all = ["out", "with_optimizer"])]
    inspect: bool,
}

fn main() -> std::process::ExitCode {
    burnscale::exit_code(run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    // Its errors name the path and what is wrong there (missing, incomplete, damaged).
    let mut ckpt = Checkpoint::find(&cli.checkpoint)?;
    if cli.inspect {
        println!("{}", ckpt.describe());
        return Ok(());
    }
    let Some(out) = cli.out else {
        bail!("give the file to write (or --inspect)");
    };
    let start = std::time::Instant::now();
    let tensors = ckpt.consolidate(&out, cli.with_optimizer)?;
    let bytes = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    println!(
        "wrote {} ({tensors} tensors, {bytes} B) from {} (step {}) in {:.2} s",
        out.display(),
        ckpt.dir.display(),
        ckpt.meta.step,
        start.elapsed().as_secs_f64()
    );
    if cli.with_optimizer {
        println!("optimizer state in {}", optimizer_path(&out).display());
    }
    Ok(())
}
