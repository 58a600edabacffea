//! burnscale: train and finetune models too big for plain data parallelism, on Burn.
//!
//! The crates, re-exported: [`train`] (the runner, its CLI and reports), [`shard`] (DDP and
//! ZeRO-1/2/3), [`collective`] (process groups), [`nn`] (shared layers and the block-list
//! view of a model) and the models ([`mingpt`], [`vit`], [`bert`], [`bigbird`]); [`reference`](mod@reference)
//! is the plain Burn loop the engine is checked against ([`equivalence`]). See README.md for
//! what works today.

pub use burnscale_bert as bert;
pub use burnscale_bigbird as bigbird;
pub use burnscale_collective as collective;
pub use burnscale_mingpt as mingpt;
pub use burnscale_nn as nn;
pub use burnscale_precision as precision;
pub use burnscale_shard as shard;
pub use burnscale_train as train;
pub use burnscale_vit as vit;

pub mod equivalence;
pub mod images;
pub mod plan_check;
pub mod pretrained;
pub mod pypi;
pub mod reference;
pub mod spam;
pub mod tasks;

/// A committed reference script (`scripts/<name>`): the one under the current directory when
/// there is one (a benchmark binary carried to a GPU machine runs in the repository's copy
/// there, wherever it lies), else this source tree's.
pub fn reference_script(name: &str) -> std::path::PathBuf {
    let here = std::path::Path::new("scripts").join(name);
    match here.is_file() {
        true => here,
        false => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scripts")
            .join(name),
    }
}

/// Ends a self-check program: runs `report` (which returns its failure count) once per rank,
/// on `devices` thread ranks (default 2) or on the MPI world under mpirun; exits non-zero if
/// any rank failed, panicked or could not start.
pub fn check_ranks(
    devices: Option<usize>,
    timeout: std::time::Duration,
    report: impl Fn(&dyn collective::Communicator) -> usize + Sync,
) -> std::process::ExitCode {
    let devices = devices.unwrap_or(if collective::launched_by_mpirun() {
        1
    } else {
        2
    });
    exit_for_failures(collective::run_ranks(devices, timeout, report))
}

/// A self-check's exit: success only if every rank started, ran to the end and reported no
/// failure (a rank that panicked counts as one).
pub fn exit_for_failures(
    ranks: Result<Vec<Result<usize, String>>, collective::CollectiveError>,
) -> std::process::ExitCode {
    let failed: usize = match ranks {
        Ok(ranks) => ranks.into_iter().map(|r| r.unwrap_or(1)).sum(),
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    };
    if failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// `--dropout`'s parser: a probability in [0, 1), refused under the flag's own name (a model
/// config names the fields it sets, `embd_pdrop`).
pub fn parse_dropout(text: &str) -> Result<f64, String> {
    let p: f64 = text.parse().map_err(|e| format!("{e}"))?;
    burnscale_nn::config::check_probabilities(&[("dropout", p)]).map(|()| p)
}

/// A runner binary's command line as `C` parses it, with `defaults` (flag id, value) in
/// place of the runner's own defaults where that example's job wants others (clap's help
/// shows them); a flag given twice takes its last value (as argparse does: a launch script's
/// `$DEFAULTS --lr 3e-4` overrides); exits with clap's message on bad flags.
pub fn parse_with_defaults<C: clap::Parser>(defaults: &[(&'static str, &'static str)]) -> C {
    let mut command = C::command().args_override_self(true);
    for &(id, value) in defaults {
        command = command.mut_arg(id, |a| a.default_value(value));
    }
    let matches = command.get_matches();
    C::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// [`train`](burnscale_train::train) as the runner binaries run it: from its call until it
/// returns, Ctrl-C, SIGTERM and SIGUSR1 (which mpirun forwards) end the run after its step
/// ([`StopFlag::on_signals`](burnscale_train::StopFlag::on_signals)); before and after, they
/// do what they did without it (end the program, or run a handler of the program's own). A
/// stop flag given in `args` listens to them (and still stops the run when the program
/// raises it); one that listens already keeps its actions after the run.
pub fn train_stopping_on_signals<T: burnscale_train::TrainTask>(
    model: T::Model,
    task: &mut T,
    args: &burnscale_train::TrainArgs,
    device: &burn::prelude::Device,
) -> anyhow::Result<(Option<T::Model>, burnscale_train::RunSummary)> {
    // Released however `train` ends, a panic included (a program that catches it keeps its
    // signals).
    struct Releases(burnscale_train::StopFlag);
    impl Drop for Releases {
        fn drop(&mut self) {
            self.0.release();
        }
    }
    let flag = args.stop.clone().unwrap_or_default();
    let _releases = flag.listen_to_signals()?.then(|| Releases(flag.clone()));
    let args = burnscale_train::TrainArgs {
        stop: Some(flag),
        ..args.clone()
    };
    Ok(burnscale_train::train(model, task, &args, device)?)
}

/// Ends a runner binary: prints the error chain on one line (no backtrace, even with
/// `RUST_BACKTRACE` set: these are user errors) and exits non-zero. A cause whose text its
/// error already shows (typed errors print their source) is not repeated.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_line(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

fn error_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

/// Runs this binary again with `args` (a benchmark's worker mode, so that each measured
/// configuration has a process, and a counting-allocator peak, of its own) and reads the
/// JSON object the worker prints on its last line.
pub fn run_worker<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
) -> anyhow::Result<serde_json::Value> {
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command.args(args);
    worker_json(command)
}

/// [`run_worker`] as `ranks` MPI processes (`mpirun -np ranks`), of which rank 0 alone
/// prints the JSON object.
pub fn run_mpi_worker<S: AsRef<std::ffi::OsStr>>(
    ranks: usize,
    args: impl IntoIterator<Item = S>,
) -> anyhow::Result<serde_json::Value> {
    let mut command = std::process::Command::new("mpirun");
    command
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &ranks.to_string(),
        ])
        .arg(std::env::current_exe()?)
        .args(args);
    worker_json(command)
}

fn worker_json(mut command: std::process::Command) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let out = command
        .output()
        .with_context(|| format!("cannot start the worker {command:?}"))?;
    if !out.status.success() {
        // A worker the OOM killer ended has no stderr: its status says how it ended.
        anyhow::bail!(
            "worker {command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .last()
        .with_context(|| format!("the worker {command:?} printed nothing"))?;
    serde_json::from_str(last)
        .with_context(|| format!("the worker {command:?} ended on a line that is not JSON: {last}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_lines_show_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let typed = burnscale_nn::weights::WeightError::Io {
            path: "w.safetensors".into(),
            source: io,
        };
        let err = anyhow::Error::new(typed).context("loading the model");
        assert_eq!(
            error_line(&err),
            "loading the model: cannot read weights file w.safetensors: no such file"
        );
    }
}
