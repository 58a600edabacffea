//! Checks the memory planner's prediction against each rank's measured peak, for one sharded
//! configuration of `burnscale::plan_check` on this process group, and prints a PASS or
//! FAIL line per rank (see `burnscale::plan_check`).
//!
//!     cargo build --release --features mpi --example plan_check
//!     mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/plan_check --strategy zero3
//!
//! Without runner flags, lists the configurations (one per line) for a loop to run.
//! Exits non-zero if any rank's prediction is off by more than the tolerance.

use std::process::ExitCode;

use burnscale::collective::launcher_local_rank;
use burnscale::plan_check::{SHARDED, TOLERANCE, run};
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::plan::off;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() -> ExitCode {
    let flags: Vec<String> = std::env::args().skip(1).collect();
    if flags.is_empty() {
        for config in SHARDED {
            println!("{}", config.join(" "));
        }
        return ExitCode::SUCCESS;
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let summary = match run(&flags) {
        Ok(summary) => summary,
        // `--help`: the runner's flags, which the check takes after its own.
        Err(e)
            if e.downcast_ref::<clap::Error>()
                .is_some_and(|e| matches!(e.kind(), clap::error::ErrorKind::DisplayHelp)) =>
        {
            print!("{e}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for rank in &summary.ranks {
        let Some(planned) = rank.planned_peak_mem_bytes else {
            println!("FAIL {} rank {}: no plan", flags.join(" "), rank.rank);
            failed = true;
            continue;
        };
        let Some(measured) = rank.peak_mem_bytes else {
            println!("FAIL {} rank {}: not measured", flags.join(" "), rank.rank);
            failed = true;
            continue;
        };
        let off = off(planned, measured);
        failed |= off.abs() > TOLERANCE;
        // Every process holds every rank's figures: the first prints them.
        if launcher_local_rank() == 0 {
            println!(
                "{} {} rank {}: measured {} planned {} ({:+.1}%)",
                if off.abs() > TOLERANCE {
                    "FAIL"
                } else {
                    "PASS"
                },
                flags.join(" "),
                rank.rank,
                human_bytes(measured),
                human_bytes(planned),
                100.0 * off
            );
        }
    }
    match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    }
}
