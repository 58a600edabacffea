//! burnscale's training runner: the shared CLI, optimizers and schedules from burn-optim,
//! gradient accumulation and clipping, and honest memory and speed reports.

pub mod accelerator;
pub mod adafactor;
pub mod adam8bit;
#[cfg(feature = "cube")]
pub mod adamw_kernel;
pub mod auto;
pub mod checkpoint;
mod cli;
pub mod data;
pub mod device_plan;
mod error;
mod fault;
pub mod freeze;
pub mod fused_adamw;
pub mod memory;
mod offload;
mod optim;
pub mod plan;
mod prepare;
mod report;
mod runner;
pub mod speed;
mod stop;

pub use burnscale_precision::Precision;
pub use cli::{
    ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, ADAMW_WEIGHT_DECAY, AdamSettings, CheckpointMode, LR,
    MIN_8BIT_SIZE, MIN_LR_RATIO, Matmul, Offload, OptimizerKind, RELATIVE_STEP_LR, ReduceDtype,
    SGD_MOMENTUM, Schedule, Strategy, TrainArgs, parse_seconds, value_name,
};
pub use error::TrainError;
pub use optim::{LrSchedule, ParamOptimizer, eight_bit_paths};
pub use report::{
    CheckpointReport, ModelStateBytes, RankMemory, RunSummary, SaveReport, Throughput,
};
pub use runner::{
    Batch, BatchPart, OnStep, Score, StepMetrics, TrainTask, check_model, train, train_on,
};
pub use stop::StopFlag;
