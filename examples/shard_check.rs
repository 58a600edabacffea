//! Checks every sharding strategy against the plain Burn loop on this process group and
//! prints a pass line per strategy and setting (see `burnscale::equivalence`).
//!
//!     cargo run --release --example shard_check -- --devices 3      # threads
//!     cargo build --release --features mpi --example shard_check
//!     mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/shard_check
//!
//! With `--checkpoint-dir DIR` (the same path for every rank), also checks that each
//! strategy resumed from a checkpoint takes the uninterrupted run's steps bit for bit.
//!
//! Exits non-zero if any strategy differs on any rank.

use std::path::PathBuf;
use std::process::ExitCode;

use burnscale::check_ranks;
use burnscale::collective::Communicator;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::equivalence::{
    ADAMW, Comparison, KEPT_GATHERED, SGD, check, check_padded, check_resume,
};
use burnscale::train::accelerator::Accelerator;
use burnscale::train::{TrainError, value_name};
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// Ranks to run as threads [default: 2] (not under mpirun, where the world comes from MPI).
    #[arg(long)]
    devices: Option<usize>,
    /// Also check resuming from a checkpoint written here (removed after).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Where the ranks' tensors live: cpu, or libtorch (a `tch` build: Burn's LibTorch
    /// backend, both the engine's run and the plain loop on it).
    #[arg(long, value_enum, default_value = "cpu")]
    accelerator: Accelerator,
}

/// SGD (scale-sensitive) alone, with accumulation, and reducing in bf16 (16-bit values on
/// the wire); AdamW with accumulation and clipping. SGD with accumulation also runs on data
/// whose targets are ignored unevenly (padding).
const SETTINGS: [(&[&str], &[&str]); 4] = [
    (SGD, &[]),
    (SGD, &["--accumulate", "2"]),
    (SGD, &["--grad-reduce-dtype", "bf16"]),
    (ADAMW, &["--accumulate", "2", "--grad-clip", "0.05"]),
];

/// Prints this rank's results; returns how many failed.
fn report(comm: &dyn Communicator, cli: &Cli) -> usize {
    let accelerator = value_name(cli.accelerator);
    let on: &[&str] = &["--accelerator", &accelerator];
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut failed = 0;
    let mut outcome = |case: String, found: Result<Comparison, TrainError>| match found {
        Ok(found) if found.agrees() => {
            println!("PASS {case} (used {:.1e} of the tolerance)", found.worst)
        }
        Ok(found) => {
            failed += 1;
            println!("FAIL {case}:\n  {}", found.differences.join("\n  "));
        }
        Err(e) => {
            failed += 1;
            println!("FAIL {case}: {e}");
        }
    };
    // One rank reduces nothing, so it takes no reduction dtype.
    let settings = SETTINGS
        .into_iter()
        .filter(|(_, extra)| world > 1 || !extra.contains(&"--grad-reduce-dtype"));
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for (optimizer, extra) in settings.clone() {
            let flags = [optimizer, extra, on].concat();
            let case = format!("[rank {rank}/{world}] {strategy} {}", flags.join(" "));
            outcome(case, check(comm, strategy, &flags));
        }
        // Targets ignored unevenly over the ranks and micro-batches.
        let flags = [SETTINGS[1].0, SETTINGS[1].1, on].concat();
        let case = format!(
            "[rank {rank}/{world}] {strategy} {} with ignored targets",
            flags.join(" ")
        );
        outcome(case, check_padded(comm, strategy, &flags));
        if let Some(dir) = &cli.checkpoint_dir {
            let case = format!("[rank {rank}/{world}] {strategy} resumed from a checkpoint");
            let flags = [ADAMW, on].concat();
            outcome(
                case,
                check_resume(comm, strategy, &dir.join(strategy), &flags),
            );
        }
    }
    // ZeRO-3 keeping each unit gathered from its forward to the end of its backward.
    for (optimizer, extra) in [SETTINGS[0], SETTINGS[3]] {
        let flags = [optimizer, extra, KEPT_GATHERED, on].concat();
        let case = format!("[rank {rank}/{world}] zero3 {}", flags.join(" "));
        outcome(case, check(comm, "zero3", &flags));
    }
    // Frozen parameters, which rank 0's model names for every rank: the token table and the
    // top block (backward goes through it), or the embeddings and the bottom block (below the
    // lowest unit that trains: outside autodiff).
    for freeze in ["wte,h.1", "wte,wpe,h.0"] {
        for strategy in ["ddp", "zero3"] {
            let flags = [ADAMW, &["--freeze", freeze], on].concat();
            let case = format!("[rank {rank}/{world}] {strategy} {}", flags.join(" "));
            outcome(case, check(comm, strategy, &flags));
        }
    }
    failed
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    check_ranks(cli.devices, DEFAULT_TIMEOUT, |comm| report(comm, &cli))
}
