//! Checks every sharding strategy against a single device on this process group and prints
//! a pass line per strategy and setting (see `burnscale::equivalence`).
//!
//!     cargo run --release --example shard_check -- --devices 3      # threads
//!     cargo build --release --features mpi --example shard_check
//!     mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/shard_check
//!
//! Exits non-zero if any strategy differs on any rank.

use std::process::ExitCode;

use burnscale::check_ranks;
use burnscale::collective::Communicator;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
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
    check_ranks(Cli::parse().devices, DEFAULT_TIMEOUT, report)
}
