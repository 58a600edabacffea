//! Where ranks run (Fabric's `accelerator`): on the CPU (ranks as threads or MPI processes,
//! collectives through host memory), or one rank per CUDA GPU with NCCL collectives; or, to
//! study the GPU's code path on a machine without one, on cubecl's CPU runtime (the CUDA
//! backend's fusion, kernels and memory pool, compiled for the CPU through LLVM); or on Burn's
//! LibTorch backend, whose kernels are PyTorch's (cuBLAS, cuDNN), to compare them with cubecl's.

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
    /// Burn's LibTorch backend (a `tch` build): rank i on LibTorch's CUDA GPU i when LibTorch
    /// sees GPUs, else on its CPU. Collectives go through host memory, as on `cpu`.
    Libtorch,
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
        crate::cli::value_name(self)
    }

    /// Runs `f` for each rank this process hosts (`devices` threads, or its one MPI rank),
    /// with the index of its device on this node (see `Accelerator::local_index`): on the
    /// CPU over threads or MPI, on CUDA one rank per GPU over NCCL. Fails before starting any
    /// rank when there are fewer GPUs than ranks.
    pub fn run_ranks<T: Send>(
        self,
        devices: usize,
        timeout: Duration,
        f: impl Fn(&dyn Communicator, usize) -> T + Sync,
    ) -> Result<Vec<Result<T, String>>, TrainError> {
        let local = |comm: &dyn Communicator| self.local_index(comm.rank());
        self.check(devices)?;
        match self {
            Accelerator::Cpu | Accelerator::CubeclCpu | Accelerator::Libtorch => {
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
    /// on GPUs, one for each.
    pub fn check(self, devices: usize) -> Result<(), TrainError> {
        let unbuilt = |feature: &str, what: &str| {
            Err(TrainError::InvalidArgs(format!(
                "--accelerator {}: this binary was built without {what}; rebuild with --features {feature}",
                self.name()
            )))
        };
        match self {
            Accelerator::Cpu => return Ok(()),
            Accelerator::CubeclCpu if cfg!(not(feature = "cubecl-cpu")) => {
                return unbuilt("cubecl-cpu", "cubecl's CPU runtime");
            }
            Accelerator::CubeclCpu => return Ok(()),
            Accelerator::Cuda if cfg!(not(feature = "cuda")) => {
                return unbuilt("cuda (or use --accelerator cpu)", "CUDA");
            }
            Accelerator::Libtorch if cfg!(not(feature = "tch")) => {
                return unbuilt("tch (README: LibTorch)", "Burn's LibTorch backend");
            }
            // On LibTorch's CPU any number of ranks share the cores.
            Accelerator::Libtorch if !self.on_gpu() => return Ok(()),
            Accelerator::Cuda | Accelerator::Libtorch => {}
        }
        let gpus = self.gpus();
        let needed = match launched_by_mpirun() {
            true => mpi_local_gpu(gpus) + 1,
            false => devices,
        };
        if needed <= gpus {
            return Ok(());
        }
        let name = self.name();
        Err(TrainError::InvalidArgs(match launched_by_mpirun() {
            true => format!(
                "--accelerator {name}: this process is rank {} on its node, but it sees {gpus} GPU(s): start at most {gpus} processes per node (or give each its own GPU)",
                launcher_local_rank()
            ),
            false => format!(
                "--accelerator {name}: {needed} rank(s) need one GPU each, but this machine has {gpus}: lower --devices, or use --accelerator cpu"
            ),
        }))
    }

    /// Where a model is built for training: the first rank's device, with autodiff (the
    /// runner moves each other rank's copy to its own).
    pub fn first_device(self) -> Result<Device, TrainError> {
        self.check(1)?;
        Ok(self.device(&Device::flex().autodiff(), self.local_index(0)))
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
            #[cfg(feature = "tch")]
            #[allow(deprecated)]
            // burn-tch is deprecated in Burn 0.22, and kept to compare with
            Accelerator::Libtorch => match self.on_gpu() {
                false => autodiff_as(Device::libtorch(), like),
                true => autodiff_as(Device::libtorch_cuda(local), like),
            },
            #[cfg(not(feature = "tch"))]
            Accelerator::Libtorch => unreachable!("checked: a build without tch"),
        }
    }

    /// GPUs this process sees for these ranks (0 for the CPU's, and in a build without them).
    fn gpus(self) -> usize {
        match self {
            Accelerator::Cuda => gpu_count(),
            Accelerator::Libtorch => libtorch_gpu_count(),
            Accelerator::Cpu | Accelerator::CubeclCpu => 0,
        }
    }

    /// Whether the ranks' devices are cubecl's (their memory in cubecl's pools).
    pub fn is_cubecl(self) -> bool {
        matches!(self, Accelerator::Cuda | Accelerator::CubeclCpu)
    }

    /// Whether the ranks' devices are GPUs.
    pub fn on_gpu(self) -> bool {
        self.gpus() > 0
    }

    /// The index on this node of the device of this process's rank `rank`: the rank itself
    /// for thread ranks, under mpirun [`mpi_local_gpu`].
    fn local_index(self, rank: usize) -> usize {
        match launched_by_mpirun() {
            true => mpi_local_gpu(self.gpus()),
            false => rank,
        }
    }
}

/// `device` with `like`'s autodiff and gradient checkpointing.
#[cfg(any(feature = "cuda", feature = "cubecl-cpu", feature = "tch"))]
fn autodiff_as(device: Device, like: &Device) -> Device {
    use burn::tensor::GradientCheckpointingStrategy::Balanced;
    match like.gradient_checkpointing_strategy() {
        None => device,
        Some(Balanced) => device.autodiff().gradient_checkpointing(),
        Some(_) => device.autodiff(),
    }
}

/// CUDA GPUs this process sees (0 in a build without the `cuda` feature).
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    return Device::enumerate(burn::tensor::DeviceType::Cuda).len();
    #[cfg(not(feature = "cuda"))]
    0
}

/// CUDA GPUs LibTorch sees (0 in a build without the `tch` feature).
fn libtorch_gpu_count() -> usize {
    #[cfg(feature = "tch")]
    return Device::enumerate(burn::tensor::DeviceType::LibTorch).len();
    #[cfg(not(feature = "tch"))]
    0
}

/// The name of the machine this process runs on; `None` where it cannot be read.
pub(crate) fn host_name() -> Option<String> {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
}
