//! Runs the collectives conformance suite and prints a pass line per op and dtype.
//!
//!     cargo run --release --example collective_check -- --devices 4      # threads
//!     cargo build --release --features mpi --example collective_check
//!     mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/collective_check
//!
//! Under mpirun (built with `--features mpi`) each process is one MPI rank; otherwise
//! `--devices` ranks run as threads. With `--nccl` (built with `--features cuda`) the ranks
//! are NCCL communicators, one per GPU: threads over `--devices` GPUs, or under mpirun (also
//! `--features mpi`) one process per GPU with NCCL's id broadcast over MPI. Exits non-zero if
//! any check fails on any rank.
//!
//!     cargo build --release --features cuda --example collective_check
//!     target/release/examples/collective_check --nccl --devices 2

use std::process::ExitCode;
use std::time::Duration;

use burn::prelude::*;
use burnscale::check_ranks;
use burnscale::collective::{Communicator, conformance, launched_by_mpirun};
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// Ranks to run as threads [default: 2] (not under mpirun, where the world comes from MPI).
    #[arg(long)]
    devices: Option<usize>,
    /// Seconds a rank waits for the others in one collective.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
    /// Fault injection: this rank panics after its first collective, to show that the
    /// others stop with an error instead of hanging.
    #[arg(long)]
    panic_rank: Option<usize>,
    /// Run the suite on the NCCL engine, one rank per GPU.
    #[cfg(feature = "cuda")]
    #[arg(long)]
    nccl: bool,
}

/// Prints this rank's results; returns how many failed.
fn report(comm: &dyn Communicator, engine: &str, panic_rank: Option<usize>) -> usize {
    if let Some(victim) = panic_rank {
        if let Err(e) = comm.barrier() {
            println!("FAIL [{engine} rank {}] barrier: {e}", comm.rank());
            return 1;
        }
        if comm.rank() == victim {
            panic!("rank {victim} panics on purpose (--panic-rank)");
        }
    }
    let results = conformance::run(comm, &Device::default());
    let mut failed = 0;
    for (name, outcome) in &results {
        match outcome {
            Ok(()) => println!(
                "PASS [{engine} rank {}/{}] {name}",
                comm.rank(),
                comm.world_size()
            ),
            Err(e) => {
                failed += 1;
                println!(
                    "FAIL [{engine} rank {}/{}] {name}: {e}",
                    comm.rank(),
                    comm.world_size()
                );
            }
        }
    }
    println!(
        "[{engine} rank {}] {} passed, {failed} failed",
        comm.rank(),
        results.len() - failed
    );
    failed
}

/// The suite on NCCL communicators: one per GPU, as threads or (under mpirun) processes.
#[cfg(feature = "cuda")]
fn nccl_main(cli: &Cli, timeout: Duration) -> ExitCode {
    use burnscale::collective::CollectiveError;
    use burnscale::collective::nccl::NcclComm;

    let invalid = |why: &str| Err(CollectiveError::Invalid(why.into()));
    let ranks = if launched_by_mpirun() && cli.devices.is_some() {
        invalid("under mpirun each process is one rank on one GPU: drop --devices")
    } else if launched_by_mpirun() {
        #[cfg(feature = "mpi")]
        {
            let gpu = |rank: usize| -> Result<usize, CollectiveError> {
                let local = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK")
                    .ok()
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(rank);
                Ok(local % NcclComm::device_count()?.max(1))
            };
            burnscale::collective::mpi::MpiComm::init(timeout).and_then(|mpi| {
                let nccl = NcclComm::over_mpi(&mpi, gpu(mpi.rank())?, timeout)?;
                Ok(vec![Ok(report(&nccl, "nccl", cli.panic_rank))])
            })
        }
        #[cfg(not(feature = "mpi"))]
        {
            invalid("--nccl under mpirun needs a build with --features cuda,mpi")
        }
    } else {
        let gpus: Vec<usize> = (0..cli.devices.unwrap_or(2)).collect();
        NcclComm::run(&gpus, timeout, |comm| report(comm, "nccl", cli.panic_rank))
    };
    burnscale::exit_for_failures(ranks)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let timeout = Duration::from_secs(cli.timeout_s);
    #[cfg(feature = "cuda")]
    if cli.nccl {
        return nccl_main(&cli, timeout);
    }
    let engine = if launched_by_mpirun() {
        "mpi"
    } else {
        "threads"
    };
    check_ranks(cli.devices, timeout, |comm| {
        report(comm, engine, cli.panic_rank)
    })
}
