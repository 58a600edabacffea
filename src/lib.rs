//! burnscale: train and finetune models too big for plain data parallelism, on Burn.
//!
//! The crates, re-exported: [`train`] (the runner, its CLI and reports) and the models
//! ([`mingpt`]). See README.md for what works today.

pub use burnscale_collective as collective;
pub use burnscale_mingpt as mingpt;
pub use burnscale_train as train;

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
