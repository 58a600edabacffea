//! Collective bandwidth: the threads engine, the MPI engine, and raw MPI (the `mpi` crate on
//! `Vec<f32>`), side by side for 1, 16 and 128 MiB and 2 and 4 ranks.
//!
//!     cargo bench --features mpi --bench collectives
//!
//! Bus bandwidth follows NCCL-tests: all_reduce 2(N-1)/N · bytes / time; all_gather and
//! reduce_scatter (N-1)/N · bytes / time, with `bytes` the full buffer. The MPI columns come
//! from re-running this binary under `mpirun -np N` (needs `--features mpi` and Open MPI); the
//! NCCL rows (built with `--features cuda`) run one thread per GPU where N GPUs are present,
//! on host buffers (`nccl-host`): each call copies them to the GPU and back, so they time
//! the staging too, not the device tensors a training step reduces.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use burnscale::collective::threads::ThreadComm;
use burnscale::collective::{Buffer, Communicator, ReduceOp};
use burnscale::train::memory::CountingAllocator;

// The allocator every runner binary uses: freed tensor buffers are reused, not refaulted.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const SIZES_MB: [usize; 3] = [1, 16, 128];
const WORLDS: [usize; 2] = [2, 4];
const OPS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

fn reps(mb: usize) -> usize {
    match mb {
        0..=1 => 50,
        2..=16 => 10,
        _ => 3,
    }
}

fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        _ => (n - 1.0) / n,
    }
}

/// Seconds per call of `op` on `comm` for a full buffer of `mb` MiB.
fn time_engine(comm: &dyn Communicator, op: &str, mb: usize) -> f64 {
    let n = mb * (1 << 20) / 4;
    let world = comm.world_size();
    let mut full = Buffer::F32(vec![1.0; n]);
    let shard = Buffer::F32(vec![1.0; n / world]);
    let mut out = Buffer::F32(Vec::new());
    timed(comm, mb, || {
        match op {
            "all_reduce" => comm.all_reduce(&mut full, ReduceOp::Sum),
            "all_gather" => comm.all_gather_into(&shard, &mut out),
            _ => comm.reduce_scatter_into(&full, &mut out, ReduceOp::Sum),
        }
        .expect("collective")
    })
}

/// Runs `f` after a warm-up, between barriers, and returns seconds per call.
fn timed(comm: &dyn Communicator, mb: usize, mut f: impl FnMut()) -> f64 {
    f();
    comm.barrier().expect("barrier");
    let start = Instant::now();
    for _ in 0..reps(mb) {
        f();
    }
    comm.barrier().expect("barrier");
    start.elapsed().as_secs_f64() / reps(mb) as f64
}

fn row(engine: &str, op: &str, world: usize, mb: usize, secs: f64) -> String {
    let busbw = bus_factor(op, world) * (mb << 20) as f64 / secs / 1e9;
    format!(
        "{engine:<10} {op:<15} {world:>2} {mb:>4} MiB {:>10.3} ms {busbw:>8.2} GB/s",
        secs * 1e3
    )
}

/// The NCCL engine on `world` GPUs (one thread each), if this machine has them; how many of
/// its measurements failed.
#[cfg(feature = "cuda")]
fn nccl_rows(world: usize) -> usize {
    use burnscale::collective::nccl::NcclComm;

    match NcclComm::device_count() {
        Ok(gpus) if gpus >= world => {}
        Ok(gpus) => {
            println!("nccl, N={world}: not run ({gpus} GPUs)");
            return 0;
        }
        Err(e) => {
            println!("nccl, N={world}: not run ({e})");
            return 0;
        }
    }
    let mut failed = 0;
    let gpus: Vec<usize> = (0..world).collect();
    for mb in SIZES_MB {
        for op in OPS {
            let secs = NcclComm::run(&gpus, Duration::from_secs(600), |comm| {
                time_engine(comm, op, mb)
            });
            match secs.map(|ranks| ranks.into_iter().next()) {
                Ok(Some(Ok(secs))) => println!("{}", row("nccl-host", op, world, mb, secs)),
                other => {
                    println!("nccl {op} {world} {mb} MiB failed: {other:?}");
                    failed += 1;
                }
            }
        }
    }
    failed
}

#[cfg(feature = "mpi")]
fn mpi_rank_main() {
    use burnscale::collective::mpi::MpiComm;
    use mpi::collective::SystemOperation;
    use mpi::traits::CommunicatorCollectives;

    let comm = MpiComm::init(Duration::from_secs(600)).expect("MPI init");
    let world = comm.world_size();
    for mb in SIZES_MB {
        let n = mb * (1 << 20) / 4;
        for op in OPS {
            let ours = time_engine(&comm, op, mb);
            let raw = comm.raw();
            let full = vec![1.0f32; n];
            let shard = vec![1.0f32; n / world];
            let mut out_full = vec![0.0f32; n];
            let mut out_shard = vec![0.0f32; n / world];
            let raw_secs = timed(&comm, mb, || match op {
                "all_reduce" => {
                    raw.all_reduce_into(&full[..], &mut out_full[..], SystemOperation::sum())
                }
                "all_gather" => raw.all_gather_into(&shard[..], &mut out_full[..]),
                _ => raw.reduce_scatter_block_into(
                    &full[..],
                    &mut out_shard[..],
                    SystemOperation::sum(),
                ),
            });
            if comm.rank() == 0 {
                println!("{}", row("mpi", op, world, mb, ours));
                println!("{}", row("raw-mpi", op, world, mb, raw_secs));
            }
        }
    }
}

fn mpi_rows(world: usize) -> Result<Vec<String>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &world.to_string(),
        ])
        .arg(exe)
        .output()
        .map_err(|e| format!("cannot start mpirun: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .take(3)
            .collect());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

fn main() -> ExitCode {
    #[cfg(feature = "mpi")]
    if burnscale::collective::launched_by_mpirun() {
        mpi_rank_main();
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<10} {:<15} {:>2} {:>8} {:>13} {:>13}",
        "engine", "op", "N", "size", "time", "busbw"
    );
    let mut failed = 0;
    for world in WORLDS {
        for mb in SIZES_MB {
            for op in OPS {
                let secs = ThreadComm::run(world, Duration::from_secs(600), |comm| {
                    time_engine(&comm, op, mb)
                });
                match secs.into_iter().next() {
                    Some(Ok(secs)) => println!("{}", row("threads", op, world, mb, secs)),
                    other => {
                        println!("threads {op} {world} {mb} MiB failed: {other:?}");
                        failed += 1;
                    }
                }
            }
        }
        #[cfg(feature = "cuda")]
        {
            failed += nccl_rows(world);
        }
        if cfg!(feature = "mpi") {
            match mpi_rows(world) {
                Ok(rows) => rows.iter().for_each(|r| println!("{r}")),
                Err(e) => println!("mpi, N={world}: not run ({e})"),
            }
        } else {
            println!("mpi, N={world}: not run (build with --features mpi)");
        }
    }
    if failed > 0 {
        eprintln!("{failed} measurement(s) failed");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
