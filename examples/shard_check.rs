//! Checks every sharding strategy against a single device on this process group and prints
//! a pass line per strategy and setting (see `burnscale::equivalence`).
//!
//!     cargo run --release --example shard_check -- --devices 3      # threads
//!     cargo build --release --features mpi --example shard_check
//!     mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/shard_check
//!
//! Exits non-zero if any strategy differs on any rank.

use std::process::ExitCode;

use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::collective::{Communicator, launched_by_mpirun, run_ranks};
use burnscale::equivalence::check;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// Ranks to run as threads [default: 2] (not under mpirun, where the world comes from MPI).
    #[arg(long)]
    devices: Option<usize>,
}

const SETTINGS: [&[&str]; 2] = [
    &["--grad-clip", "0"],
    &["--accumulate", "2", "--grad-clip", "0.05"],
];

/// Prints this rank's results; returns how many failed.
fn report(comm: &dyn Communicator) -> usize {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut failed = 0;
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for extra in SETTINGS {
            let case = format!("[rank {rank}/{world}] {strategy} {}", extra.join(" "));
            match check(comm, strategy, extra) {
                Ok(differences) if differences.is_empty() => println!("PASS {case}"),
                Ok(differences) => {
                    failed += 1;
                    println!("FAIL {case}:\n  {}", differences.join("\n  "));
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL {case}: {e}");
                }
            }
        }
    }
    failed
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let devices = cli
        .devices
        .unwrap_or(if launched_by_mpirun() { 1 } else { 2 });
    let failed: usize = match run_ranks(devices, DEFAULT_TIMEOUT, report) {
        Ok(ranks) => ranks.into_iter().map(|r| r.unwrap_or(1)).sum(),
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    };
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
