//! Checks every sharding strategy against the plain Burn loop on this process group and
//! prints a pass line per strategy and setting (see `burnscale::equivalence`).
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
use burnscale::equivalence::{ADAMW, SGD, check};
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// Ranks to run as threads [default: 2] (not under mpirun, where the world comes from MPI).
    #[arg(long)]
    devices: Option<usize>,
}

/// SGD (scale-sensitive) alone, with accumulation, and reducing in bf16 (16-bit values on
/// the wire); AdamW with accumulation and clipping.
const SETTINGS: [(&[&str], &[&str]); 4] = [
    (SGD, &[]),
    (SGD, &["--accumulate", "2"]),
    (SGD, &["--grad-reduce-dtype", "bf16"]),
    (ADAMW, &["--accumulate", "2", "--grad-clip", "0.05"]),
];

/// Prints this rank's results; returns how many failed.
fn report(comm: &dyn Communicator) -> usize {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut failed = 0;
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for (optimizer, extra) in SETTINGS {
            let flags = [optimizer, extra].concat();
            let case = format!("[rank {rank}/{world}] {strategy} {}", flags.join(" "));
            match check(comm, strategy, &flags) {
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
            }
        }
    }
    failed
}

fn main() -> ExitCode {
    check_ranks(Cli::parse().devices, DEFAULT_TIMEOUT, report)
}
