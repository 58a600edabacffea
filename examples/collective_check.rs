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
//!     target/release/examples/collective_check --nccl --devices 1   # one GPU: in-place tensors

use std::process::ExitCode;
use std::time::Duration;

use burn::prelude::*;
use burnscale::check_ranks;
use burnscale::collective::{Communicator, conformance, launched_by_mpirun};
use burnscale::train::parse_seconds;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    /// Ranks to run as threads [default: 2] (not under mpirun, where the world comes from MPI).
    #[arg(long)]
    devices: Option<usize>,
    /// Seconds a rank waits for the others in one collective.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    timeout_s: Duration,
    /// Fault injection: this rank panics after its first collective, to show that the
    /// others stop with an error instead of hanging.
    #[arg(long)]
    panic_rank: Option<usize>,
    /// Fault injection: this rank leaves the group after its first collective (as a rank
    /// whose run failed with an error returns), to show that the others stop with an error
    /// naming it instead of waiting for it.
    #[arg(long)]
    leave_rank: Option<usize>,
    /// Fault injection: this rank stops taking part after its first collective without
    /// leaving (stuck outside any collective), to show that the others time out and the job
    /// ends instead of hanging.
    #[arg(long)]
    stall_rank: Option<usize>,
    /// Run the suite on the NCCL engine, one rank per GPU.
    #[cfg(feature = "cuda")]
    #[arg(long)]
    nccl: bool,
}

/// Prints this rank's results; returns how many failed.
fn report(comm: &dyn Communicator, engine: &str, cli: &Cli, device: &Device) -> usize {
    let faults = [cli.panic_rank, cli.leave_rank, cli.stall_rank];
    if faults.iter().any(Option::is_some) {
        if let Some(rank) = faults
            .into_iter()
            .flatten()
            .find(|&r| r >= comm.world_size())
        {
            println!(
                "FAIL [{engine} rank {}] no rank {rank} to inject a fault into: the world has {}",
                comm.rank(),
                comm.world_size()
            );
            return 1;
        }
        if let Err(e) = comm.barrier() {
            println!("FAIL [{engine} rank {}] barrier: {e}", comm.rank());
            return 1;
        }
        if cli.panic_rank == Some(comm.rank()) {
            panic!("rank {} panics on purpose (--panic-rank)", comm.rank());
        }
        while cli.stall_rank == Some(comm.rank()) {
            std::thread::sleep(Duration::from_secs(1));
        }
        if cli.leave_rank == Some(comm.rank()) {
            println!(
                "FAIL [{engine} rank {}] leaves the group on purpose (--leave-rank)",
                comm.rank()
            );
            return 1;
        }
    }
    let results = conformance::run(comm, device);
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

/// The suite on NCCL communicators, one per GPU (as threads, or under mpirun processes), with
/// each rank's tensors on its own GPU.
#[cfg(feature = "cuda")]
fn nccl_main(cli: &Cli, timeout: Duration) -> ExitCode {
    // The GPU `run_gpu_ranks` put the communicator on.
    let gpu = |comm: &dyn Communicator| match launched_by_mpirun() {
        true => burnscale::collective::mpi_nccl_gpu()
            .expect("run_gpu_ranks found this process's GPU the same way"),
        false => comm.rank(),
    };
    let devices = cli
        .devices
        .unwrap_or(if launched_by_mpirun() { 1 } else { 2 });
    let ranks = burnscale::collective::run_gpu_ranks(devices, timeout, |comm| {
        report(comm, "nccl", cli, &Device::cuda(gpu(comm)))
    });
    burnscale::exit_for_failures(ranks)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let timeout = cli.timeout_s;
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
        report(comm, engine, &cli, &Device::default())
    })
}
