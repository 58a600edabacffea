//! burnscale: train and finetune models too big for plain data parallelism, on Burn.
//!
//! The crates, re-exported: [`train`] (the runner, its CLI and reports), [`shard`] (DDP and
//! ZeRO-1/2/3), [`collective`] (process groups), [`nn`] (shared layers and the block-list
//! view of a model) and the models ([`mingpt`]). See README.md for what works today.

pub use burnscale_collective as collective;
pub use burnscale_mingpt as mingpt;
pub use burnscale_nn as nn;
pub use burnscale_shard as shard;
pub use burnscale_train as train;

pub mod equivalence;
pub mod tasks;

/// Ends a runner binary: prints the error chain on one line (no backtrace, even with
/// `RUST_BACKTRACE` set: these are user errors) and exits non-zero.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
