//! burnscale's training runner: the shared CLI, optimizers and schedules from burn-optim,
//! gradient accumulation and clipping, and honest memory and speed reports.

mod cli;
pub mod data;
mod error;
pub mod memory;
mod optim;
mod report;
mod runner;
pub mod speed;

pub use cli::{Offload, OptimizerKind, Precision, Schedule, Strategy, TrainArgs, value_name};
pub use error::TrainError;
pub use optim::{LrSchedule, ParamOptimizer, clip_global_norm};
pub use report::{ModelStateBytes, RunSummary, Throughput};
pub use runner::{StepMetrics, TrainTask, param_bytes, train};
