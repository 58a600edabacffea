//! Offload (`--offload optimizer|params`, `--offload-dir`) changes where the model states
//! live, never a step: every strategy with its state offloaded takes the steps of the plain
//! Burn loop, and state on disk is counted as offloaded (that it is not held in memory is
//! measured in `offload_memory.rs`).

use burn::prelude::*;
use burnscale::collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
use burnscale::equivalence::ADAMW;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::{TrainArgs, TrainError, train_on};

mod common;

/// AdamW, whose two moments per parameter are the state that offload moves.
fn matches_plain(strategy: &str, world: usize, offload: &[&str]) {
    let flags = [ADAMW, &["--grad-clip", "0.05"], offload].concat();
    common::assert_matches_plain(strategy, world, &flags);
}

#[test]
fn offloaded_optimizer_state_takes_the_same_steps() {
    for strategy in ["single", "ddp", "zero1", "zero2", "zero3"] {
        let world = if strategy == "single" { 1 } else { 2 };
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().to_str().unwrap();
        matches_plain(strategy, world, &["--offload", "optimizer"]);
        matches_plain(strategy, world, &["--offload-dir", dir]);
    }
}

#[test]
fn offloaded_zero3_shards_take_the_same_steps() {
    for world in [2, 3] {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().to_str().unwrap();
        matches_plain("zero3", world, &["--offload", "params"]);
        // Kept gathered from forward to backward, the shards still live on the host.
        matches_plain(
            "zero3",
            world,
            &["--offload", "params", "--reshard-after-forward", "false"],
        );
        matches_plain(
            "zero3",
            world,
            &["--offload", "params", "--offload-dir", dir],
        );
    }
}

fn train_tiny(flags: &[&str]) -> Result<burnscale::train::RunSummary, TrainError> {
    let model = common::seeded_model(3, |device| {
        Gpt::new(&GptConfig::tiny().with_dropout(0.0), device).unwrap()
    });
    let base = ["--max-steps", "3", "--batch-size", "4"];
    let args = TrainArgs::from_flags(&[&base[..], flags].concat()).unwrap();
    let tokens = (0..2000).map(|i| (i * 7 % 11) as i64).collect();
    let mut task = NextToken::new(tokens, 8, 4, 3).unwrap();
    let comm = ThreadComm::group(1, DEFAULT_TIMEOUT).remove(0);
    let device = Device::default().autodiff();
    train_on(&comm, model, &mut task, &args, &device).map(|(_, summary)| summary)
}

#[test]
fn state_on_disk_counts_as_offloaded_and_leaves_no_files() {
    let dir = tempfile::tempdir().unwrap();
    let summary = train_tiny(&["--offload-dir", dir.path().to_str().unwrap()]).unwrap();
    let states = summary.model_state;
    // AdamW: two f32 moments per parameter, all in files, none in memory.
    assert_eq!(states.optimizer, 0);
    assert_eq!(states.offloaded, 8 * summary.num_params);
    assert_eq!(
        summary.model_state_bytes_per_rank,
        states.params + states.grads
    );
    assert_eq!(
        summary.model_state_predicted_bytes,
        summary.model_state_bytes_per_rank
    );
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "the rank's scratch files are removed when training ends"
    );

    let plain = train_tiny(&[]).unwrap();
    assert_eq!(plain.model_state.optimizer, 8 * plain.num_params);
    assert_eq!(plain.model_state.offloaded, 0);
}

#[test]
fn an_unusable_offload_dir_is_named() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let dir = file.path().join("states");
    let err = train_tiny(&["--offload-dir", dir.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--offload-dir") && err.contains(&dir.display().to_string()),
        "{err}"
    );
}
