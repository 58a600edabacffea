//! Where ranks run (Fabric's `accelerator`): on the CPU (ranks as threads or MPI processes,
//! collectives through host memory), or one rank per CUDA GPU with NCCL collectives; or, to
//! study the GPU's code path on a machine without one, on cubecl's CPU runtime (the CUDA
//! backend's fusion, kernels and memory pool, compiled for the CPU through LLVM).

use std::time::Duration;

use burn::prelude::*;
use burnscale_collective::{
    Communicator, launched_by_mpirun, launcher_local_rank, mpi_local_gpu, run_ranks,
};
use clap::ValueEnum;
use serde::Serialize;

use crate::TrainError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accelerator {
    Cpu,
    Cuda,
    /// cubecl's CPU runtime (a `cubecl-cpu` build): ranks as on `cpu`, tensors on the
    /// runtime Burn's GPU backends share, so a step fuses and launches the kernels a GPU's
    /// would, and its pool reports device memory as a GPU's does. Far slower than `cpu`.
    #[value(name = "cubecl-cpu")]
    #[serde(rename = "cubecl-cpu")]
    CubeclCpu,
}

impl Accelerator {
    /// `chosen`, or by default CUDA in a `cuda` build on a machine with a GPU, else the CPU.
    pub fn or_default(chosen: Option<Accelerator>) -> Accelerator {
        chosen.unwrap_or(if gpu_count() > 0 {
            Accelerator::Cuda
        } else {
            Accelerator::Cpu
        })
    }

    /// The flag's value naming it (`cubecl-cpu`).
    pub fn name(self) -> String {
        self.to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_string())
    }

    /// Runs `f` for each rank this process hosts (`devices` threads, or its one MPI rank),
    /// with the index of its device on this node (see [`Accelerator::local_index`]): on the
    /// CPU over threads or MPI, on CUDA one rank per GPU over NCCL. Fails before starting any
    /// rank when there are fewer GPUs than ranks.
    pub fn run_ranks<T: Send>(
        self,
        devices: usize,
        timeout: Duration,
        f: impl Fn(&dyn Communicator, usize) -> T + Sync,
    ) -> Result<Vec<Result<T, String>>, TrainError> {
        let local = |comm: &dyn Communicator| local_index(comm.rank());
        self.check(devices)?;
        match self {
            Accelerator::Cpu | Accelerator::CubeclCpu => {
                Ok(run_ranks(devices, timeout, |comm| f(comm, local(comm)))?)
            }
            Accelerator::Cuda => {
                #[cfg(feature = "cuda")]
                return Ok(burnscale_collective::run_gpu_ranks(
                    devices,
                    timeout,
                    |comm| f(comm, local(comm)),
                )?);
                #[cfg(not(feature = "cuda"))]
                unreachable!("a build without cuda sees no GPU")
            }
        }
    }

    /// Whether this process can run its ranks (`devices` threads, or its one MPI rank) here:
    /// on CUDA, one GPU for each.
    pub fn check(self, devices: usize) -> Result<(), TrainError> {
        let gpus = match self {
            Accelerator::Cpu => return Ok(()),
            Accelerator::CubeclCpu if cfg!(feature = "cubecl-cpu") => return Ok(()),
            Accelerator::CubeclCpu => return Err(TrainError::InvalidArgs(
                "--accelerator cubecl-cpu: this binary was built without cubecl's CPU runtime; rebuild with --features cubecl-cpu".into(),
            )),
            Accelerator::Cuda => gpu_count(),
        };
        let needed = match launched_by_mpirun() {
            true => mpi_local_gpu(gpus) + 1,
            false => devices,
        };
        if needed > gpus {
            return Err(TrainError::InvalidArgs(no_gpu(needed, gpus)));
        }
        Ok(())
    }

    /// Where a model is built for training: the first rank's device, with autodiff (the
    /// runner moves each other rank's copy to its own).
    pub fn first_device(self) -> Result<Device, TrainError> {
        self.check(1)?;
        Ok(self.device(&Device::flex().autodiff(), local_index(0)))
    }

    /// The device of the rank whose device index on this node is `local`: `like` itself on
    /// the CPU, else GPU `local` (or cubecl's CPU runtime) with `like`'s autodiff and
    /// gradient checkpointing (after [`Accelerator::check`]).
    pub fn device(self, like: &Device, local: usize) -> Device {
        match self {
            Accelerator::Cpu => like.clone(),
            #[cfg(feature = "cuda")]
            Accelerator::Cuda => autodiff_as(Device::cuda(local), like),
            #[cfg(not(feature = "cuda"))]
            Accelerator::Cuda => unreachable!("checked: GPU {local} in a build without cuda"),
            #[cfg(feature = "cubecl-cpu")]
            Accelerator::CubeclCpu => autodiff_as(Device::cpu(), like),
            #[cfg(not(feature = "cubecl-cpu"))]
            Accelerator::CubeclCpu => unreachable!("checked: a build without cubecl-cpu"),
        }
    }
}

/// `device` with `like`'s autodiff and gradient checkpointing.
#[cfg(any(feature = "cuda", feature = "cubecl-cpu"))]
fn autodiff_as(device: Device, like: &Device) -> Device {
    use burn::tensor::GradientCheckpointingStrategy::Balanced;
    match like.gradient_checkpointing_strategy() {
        None => device,
        Some(Balanced) => device.autodiff().gradient_checkpointing(),
        Some(_) => device.autodiff(),
    }
}

/// The index on this node of the device of this process's rank `rank`: the rank itself for
/// thread ranks, under mpirun [`mpi_local_gpu`].
fn local_index(rank: usize) -> usize {
    match launched_by_mpirun() {
        true => mpi_local_gpu(gpu_count()),
        false => rank,
    }
}

/// CUDA GPUs this process sees (0 in a build without the `cuda` feature).
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    return Device::enumerate(burn::tensor::DeviceType::Cuda).len();
    #[cfg(not(feature = "cuda"))]
    0
}

fn no_gpu(needed: usize, gpus: usize) -> String {
    if cfg!(not(feature = "cuda")) {
        return "--accelerator cuda: this binary was built without CUDA; rebuild with --features cuda, or use --accelerator cpu".into();
    }
    match launched_by_mpirun() {
        true => format!(
            "--accelerator cuda: this process is rank {} on its node, but it sees {gpus} GPU(s): start at most {gpus} processes per node (or give each its own GPU)",
            launcher_local_rank()
        ),
        false => format!(
            "--accelerator cuda: {needed} rank(s) need one GPU each, but this machine has {gpus}: lower --devices, or use --accelerator cpu"
        ),
    }
}
