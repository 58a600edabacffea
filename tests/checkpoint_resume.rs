//! Sharded checkpoints: a run stopped at a checkpoint and resumed takes exactly the steps the
//! uninterrupted run took (same world size and strategy, bit for bit, dropout included); a
//! checkpoint resumes at another world size and strategy to f32 rounding; a damaged or
//! foreign checkpoint is an error naming what is wrong; an interrupted save is never taken
//! for a checkpoint.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::prelude::*;
use burnscale::collective::run_ranks;
use burnscale::equivalence::ADAFACTOR_ATTENTION_BIAS;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::nn::weights;
use burnscale::tasks::NextToken;
use burnscale::train::checkpoint::{Checkpoint, optimizer_path};
use burnscale::train::{
    Batch, BatchPart, OnStep, RunSummary, Score, StepMetrics, StopFlag, TrainArgs, TrainError,
    TrainTask, train, train_on,
};
use common::{assert_steps_close, seeded_model, steps};

/// A directory of the test's own, empty.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burnscale-ckpt-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn tokens() -> Vec<i64> {
    (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect()
}

/// Trains minGPT-tiny on the global batch of 12 samples per micro-step, `world` ranks
/// reading 12/world each, for 9 steps (cosine schedule after a warm-up, AdamW, clipping),
/// checkpointing into `dir` every 3.
fn run(
    dir: &Path,
    strategy: &str,
    world: usize,
    dropout: f64,
    extra: &[&str],
) -> Result<(Gpt, RunSummary), TrainError> {
    run_task(dir, strategy, world, dropout, extra, |task, _| task)
}

/// [`run`] on the task `wrap` makes of its data (given the run's arguments too).
fn run_task<T: TrainTask<Model = Gpt>>(
    dir: &Path,
    strategy: &str,
    world: usize,
    dropout: f64,
    extra: &[&str],
    wrap: impl FnOnce(NextToken, &mut TrainArgs) -> T,
) -> Result<(Gpt, RunSummary), TrainError> {
    let (batch, devices) = ((12 / world).to_string(), world.to_string());
    let base = [
        "--strategy",
        strategy,
        "--devices",
        &devices,
        "--batch-size",
        &batch,
        "--max-steps",
        "9",
        "--warmup-steps",
        "2",
        "--lr",
        "1e-2",
        "--checkpoint-dir",
        dir.to_str().unwrap(),
        "--checkpoint-every",
        "3",
    ];
    let config = GptConfig::tiny().with_dropout(dropout);
    let mut args = TrainArgs::from_flags(&[&base[..], extra].concat())
        .unwrap()
        .with_model_config(&config)
        .unwrap();
    args.gather_model = true;
    let model = seeded_model(5, |device| Gpt::new(&config, device).unwrap());
    let mut task = wrap(
        NextToken::new(tokens(), 8, args.batch_size, 5).unwrap(),
        &mut args,
    );
    let (model, summary) = train(model, &mut task, &args, &model_device())?;
    Ok((model.expect("asked for the model"), summary))
}

fn model_device() -> burn::prelude::Device {
    burn::prelude::Device::default().autodiff()
}

/// Leaves only the checkpoint of `step` in `dir`.
fn keep_only(dir: &Path, step: usize) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        if entry.file_name() != format!("step-{step:08}").as_str() {
            fs::remove_dir_all(entry.path()).unwrap();
        }
    }
}

#[test]
fn a_resumed_run_takes_the_uninterrupted_runs_steps_bit_for_bit() {
    let offload_dir = scratch("offload-dir");
    let offload_dir = offload_dir.to_str().unwrap();
    for (strategy, world, extra) in [
        ("single", 1, &[][..]),
        ("ddp", 2, &[]),
        ("zero1", 2, &[]),
        ("zero2", 2, &["--accumulate", "2"]),
        ("zero3", 2, &[]),
        ("zero3", 2, &["--precision", "16-mixed"]),
        ("zero2", 2, &["--precision", "bf16-true"]),
        // SGD: AdamW's epsilon (1e-8) is zero in f16, so an exact zero gradient (the
        // attention key bias's) steps by 0/0 there, as PyTorch's AdamW on f16 weights does.
        ("ddp", 2, &["--precision", "16-true", "--optimizer", "sgd"]),
        (
            "zero3",
            2,
            &["--precision", "bf16-mixed", "--offload", "params"],
        ),
        ("zero3", 2, &["--offload-dir", offload_dir]),
        ("zero1", 2, &["--offload", "optimizer"]),
        // The state read back from disk keeps its 16 bits (burn-optim's own reading gives f32).
        (
            "single",
            1,
            &["--precision", "bf16-true", "--offload-dir", offload_dir],
        ),
        // 8-bit AdamW: byte codes and per-block absmax, saved and read back by rows.
        (
            "zero3",
            2,
            &["--optimizer", "adam8bit", "--min-8bit-size", "256"],
        ),
        (
            "zero2",
            2,
            &[
                "--optimizer",
                "adam8bit",
                "--min-8bit-size",
                "256",
                "--precision",
                "bf16-true",
            ],
        ),
        (
            "single",
            1,
            &[
                "--optimizer",
                "adam8bit",
                "--min-8bit-size",
                "256",
                "--offload-dir",
                offload_dir,
            ],
        ),
        // Frozen parameters: saved, without optimizer state, and left out again.
        ("zero3", 2, &["--freeze", "wte,h.1"]),
        ("zero1", 2, &["--freeze", "wte,wpe,h.0"]),
        // Adafactor: row moments by rows, a matrix's column moment (the same on every rank)
        // once, and its first moment.
        ("zero3", 2, &["--optimizer", "adafactor", "--beta1", "0.9"]),
        (
            "zero1",
            2,
            &["--optimizer", "adafactor", "--offload-dir", offload_dir],
        ),
    ] {
        let name = format!("{strategy}{world}{}", extra.join("").replace('/', "_"));
        let dir = scratch(&name);
        let (whole, uninterrupted) = run(&dir, strategy, world, 0.1, extra).unwrap();
        keep_only(&dir, 6);
        let mut flags = extra.to_vec();
        flags.push("--resume");
        let (resumed_model, resumed) = run(&dir, strategy, world, 0.1, &flags).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            steps(&resumed),
            steps(&uninterrupted)[6..],
            "{name}: the resumed steps"
        );
        assert_eq!(
            weights::collect(&resumed_model),
            weights::collect(&whole),
            "{name}: the final parameters"
        );
    }
}

/// Resumed at another world size, a rank goes on with the dropout stream of the checkpoint's
/// rank of its number rather than drawing that stream's first masks again: a zero2 x 2 run's
/// step-3 checkpoint resumed on one rank has drawn twice as many keys by step 6.
#[test]
fn a_rank_resumed_at_another_world_size_draws_new_dropout_masks() {
    let dir = scratch("dropout-reshard");
    run(&dir, "zero2", 2, 0.1, &[]).unwrap();
    keep_only(&dir, 3);
    let calls = |step: usize| {
        let meta = fs::read_to_string(dir.join(format!("step-{step:08}/meta.json"))).unwrap();
        let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
        meta["dropout"][0][1].as_u64().unwrap()
    };
    let saved = calls(3);
    run(&dir, "single", 1, 0.1, &["--resume"]).unwrap();
    assert!(saved > 0);
    assert_eq!(calls(6), 2 * saved);
    fs::remove_dir_all(&dir).unwrap();
}

/// A run resumed with other schedule or optimizer settings follows its own and names those
/// that differ from the checkpoint's run (in its summary, as on stderr); resumed as it ran,
/// none.
#[test]
fn a_resumed_run_names_the_settings_it_changed() {
    let dir = scratch("changed-flags");
    run(&dir, "single", 1, 0.0, &[]).unwrap();
    let changed = |flags: &[&str]| {
        keep_only(&dir, 6);
        let resumed = [flags, &["--resume"]].concat();
        let (_, summary) = run(&dir, "single", 1, 0.0, &resumed).unwrap();
        summary.checkpoints.unwrap().changed_flags
    };
    assert_eq!(changed(&[]), Vec::<String>::new());
    let other = ["--lr", "2e-2", "--weight-decay", "0.05", "--beta2", "0.99"];
    assert_eq!(
        changed(&other),
        [
            "--lr 0.01, this run 0.02",
            "--beta2 0.95, this run 0.99",
            "--weight-decay 0.1, this run 0.05"
        ]
    );
    // Parameters frozen now that trained before (their state kept for later), or the reverse
    // (stepped from a fresh state).
    assert_eq!(
        changed(&["--freeze", "wpe,h.0"]),
        ["--freeze none, this run wpe,h.0"]
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// A requeue's command, `--initial-loss-scale` in it, resumes a 16-mixed run, also after a
/// resume without the flag; another starting scale, which the saved scale would override, is
/// refused by name.
#[test]
fn a_16_mixed_run_resumes_with_its_own_initial_loss_scale() {
    let dir = scratch("loss-scale");
    let scaled = |scale: Option<&str>, steps: &str| {
        let mut flags = vec!["--precision", "16-mixed", "--max-steps", steps, "--resume"];
        if let Some(scale) = scale {
            flags.extend(["--initial-loss-scale", scale]);
        }
        run(&dir, "zero2", 2, 0.0, &flags)
    };
    scaled(Some("1024"), "3").unwrap();
    scaled(None, "6").unwrap();
    let (_, summary) = scaled(Some("1024"), "9").unwrap();
    assert_eq!((summary.first_step, summary.steps), (7, 9));
    let err = scaled(Some("512"), "12").unwrap_err().to_string();
    assert!(
        err.contains("--initial-loss-scale 1024, this run 512"),
        "{err}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_resumes_at_another_world_size_and_strategy() {
    resharded(&[]);
}

/// Adafactor's row moments re-sliced by rows, its column moments read whole.
#[test]
fn an_adafactor_checkpoint_resumes_at_another_world_size_and_strategy() {
    resharded(&[
        "--optimizer",
        "adafactor",
        "--adafactor-relative-step",
        "--lr",
        "1e-2",
    ]);
}

/// A zero3 x 4 run's step-3 checkpoint resumed as zero2 x 2, whose step-6 checkpoint is
/// resumed as single: the same steps and parameters as the uninterrupted run.
fn resharded(flags: &[&str]) {
    let name = flags.join("");
    let (a, b) = (
        scratch(&format!("reshard-a{name}")),
        scratch(&format!("reshard-b{name}")),
    );
    let resumed: Vec<&str> = [flags, &["--resume"]].concat();
    let (whole, uninterrupted) = run(&a, "zero3", 4, 0.0, flags).unwrap();
    fs::create_dir_all(&b).unwrap();
    fs::rename(a.join("step-00000003"), b.join("step-00000003")).unwrap();
    fs::remove_dir_all(&a).unwrap();
    let (_, as_zero2) = run(&b, "zero2", 2, 0.0, &resumed).unwrap();
    keep_only(&b, 6);
    let (single_model, as_single) = run(&b, "single", 1, 0.0, &resumed).unwrap();
    fs::remove_dir_all(&b).unwrap();

    let expected = steps(&uninterrupted);
    let got: Vec<_> = steps(&as_zero2)[..3]
        .iter()
        .chain(&steps(&as_single))
        .copied()
        .collect();
    assert_eq!(got.len(), 6);
    assert_steps_close(&got, &expected[3..]);
    let (got, want) = (weights::collect(&single_model), weights::collect(&whole));
    for (path, w) in &want {
        // The attention key bias's gradient is float noise (softmax ignores a shift shared
        // by every key), which Adafactor normalises into steps of its whole (here tiny) step
        // size in a random direction (equivalence.rs): its middle third (q, k, v) is left out,
        // and the rest, whose update Adafactor scales by RMSs over the whole vector, noise
        // and all, is held to equivalence.rs's bound for it (these biases start at 0: their
        // values are their updates).
        let third = w.values.len() / 3;
        let (noise, relative) = match !flags.is_empty() && path.ends_with("c_attn.bias") {
            true => (third..2 * third, ADAFACTOR_ATTENTION_BIAS),
            false => (0..0, 1e-4),
        };
        let floor = if noise.is_empty() { 1e-3 } else { 0.0 };
        let g = &got[path];
        let (diff, norm) = g
            .values
            .iter()
            .zip(&w.values)
            .enumerate()
            .filter(|(i, _)| !noise.contains(i))
            .fold((0f64, 0f64), |(d, n), (_, (a, b))| {
                (d + ((a - b) as f64).powi(2), n + (*b as f64).powi(2))
            });
        assert!(
            diff.sqrt() <= relative * norm.sqrt().max(floor),
            "{path}: {diff:e} of {norm:e}"
        );
    }
}

#[test]
fn a_damaged_or_foreign_checkpoint_is_an_error_naming_it() {
    let dir = scratch("faults");
    run(&dir, "zero2", 2, 0.0, &["--max-steps", "3"]).unwrap();
    let file = dir.join("step-00000003/rank-00001.safetensors");
    let pristine = fs::read(&file).unwrap();

    // A flipped byte.
    let mut bytes = pristine.clone();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    fs::write(&file, &bytes).unwrap();
    let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("CRC-32"),
        "{err}"
    );

    // A truncated file.
    fs::write(&file, &pristine[..pristine.len() / 2]).unwrap();
    let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    fs::write(&file, &pristine).unwrap();

    // A value of meta.json damaged into another that parses: here the dropout stream's
    // position, which would resume silently (dropout is 0 here).
    let meta_path = dir.join("step-00000003/meta.json");
    let sealed: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&meta_path).unwrap()).unwrap();
    let mut damaged = sealed.clone();
    damaged["dropout"][1][1] = serde_json::json!(damaged["dropout"][1][1].as_u64().unwrap() + 1);
    fs::write(&meta_path, damaged.to_string()).unwrap();
    let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("meta.json is damaged: CRC-32"), "{err}");

    // A meta.json edited by hand, without its CRC-32 (as an older build wrote it): a tensor
    // without dimensions (split, or replicated), or with more elements than can be counted.
    let mut unsealed = sealed;
    unsealed.as_object_mut().unwrap().remove("crc32");
    let meta = unsealed.to_string();
    fs::write(&meta_path, &meta).unwrap();
    let edits: [(&str, Vec<u64>, bool); 3] = [
        ("/params/0", vec![], false),
        ("/states/0/tensors/0", vec![], true),
        ("/params/0", vec![1 << 40, 1 << 40], false),
    ];
    for (tensor, dims, replicated) in edits {
        let mut edited: serde_json::Value = serde_json::from_str(&meta).unwrap();
        let t = edited.pointer_mut(tensor).unwrap();
        t["dims"] = serde_json::json!(dims);
        t["replicated"] = replicated.into();
        fs::write(&meta_path, edited.to_string()).unwrap();
        let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("meta.json") && err.contains(&format!("has dimensions {dims:?}")),
            "{err}"
        );
    }
    let mut edited: serde_json::Value = serde_json::from_str(&meta).unwrap();
    // A shape far larger than the files: an error before any of it is held (consolidating
    // it asked the allocator for 1.4 TB, which aborted the process).
    edited["params"][0]["dims"] = serde_json::json!([76, 4_800_000_000u64]);
    let consolidated = |edited: &serde_json::Value| {
        fs::write(&meta_path, edited.to_string()).unwrap();
        let mut ckpt = Checkpoint::open(&dir.join("step-00000003")).unwrap();
        ckpt.consolidate(&dir.join("whole.safetensors"), false)
            .unwrap_err()
            .to_string()
    };
    let err = consolidated(&edited);
    assert!(err.contains("larger than the checkpoint's files"), "{err}");
    // The files' recorded sizes edited alike: the files on disk are not those sizes.
    for file in edited["files"].as_array_mut().unwrap() {
        file["bytes"] = serde_json::json!(1u64 << 50);
    }
    let err = consolidated(&edited);
    assert!(err.contains("meta.json says 1125899906842624"), "{err}");
    fs::write(&meta_path, &meta).unwrap();

    // A checkpoint of a format this build does not read is named so, not as damaged: the
    // build that wrote it reads it.
    let mut edited: serde_json::Value = serde_json::from_str(&meta).unwrap();
    edited["format"] = serde_json::json!(99);
    fs::write(&meta_path, edited.to_string()).unwrap();
    let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("format 99, and this build reads format") && !err.contains("damaged"),
        "{err}"
    );
    fs::write(&meta_path, &meta).unwrap();

    // A checkpoint renamed for a later step: checkpoints are kept and pruned by their names'
    // steps, and one named for step 9 would outlive (and be resumed from instead of) the
    // steps after 3.
    let renamed = dir.join("step-00000009");
    fs::rename(dir.join("step-00000003"), &renamed).unwrap();
    let err = run(&dir, "zero2", 2, 0.0, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("it holds step 3, but its directory is named for step 9"),
        "{err}"
    );
    fs::rename(&renamed, dir.join("step-00000003")).unwrap();

    // Another model: wider, so every matrix differs; named by its config where the run
    // records one, else by the first tensors that differ and how many more.
    let args = TrainArgs::from_flags(&[
        "--resume",
        "--checkpoint-dir",
        dir.to_str().unwrap(),
        "--batch-size",
        "12",
        "--max-steps",
        "9",
    ])
    .unwrap();
    let wider = GptConfig::new(2, 2, 32, 11, 8);
    let model = || seeded_model(5, |device| Gpt::new(&wider, device).unwrap());
    let mut task = NextToken::new(tokens(), 8, 12, 5).unwrap();
    let err = train(model(), &mut task, &args, &model_device())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another model")
            && err.contains("`wte.weight` has shape [11, 16], the model [11, 32]")
            && err.contains("; and 21 more"),
        "{err}"
    );
    let recorded = args.with_model_config(&wider).unwrap();
    let err = train(model(), &mut task, &recorded, &model_device())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model config: n_embd 16, this run 32") && !err.contains("wte.weight"),
        "{err}"
    );

    // The same shapes under another configuration: what the parameter table cannot tell.
    let err = run(&dir, "zero2", 2, 0.1, &["--resume"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model config: attn_pdrop 0.0, this run 0.1"),
        "{err}"
    );

    // Another precision: the same f32 weights, but a run computed in another dtype (and
    // under 16-mixed, a loss scaler saved or not).
    let err = run(
        &dir,
        "zero2",
        2,
        0.0,
        &["--resume", "--precision", "bf16-mixed"],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("precision 32-true, this run bf16-mixed"),
        "{err}"
    );

    // Another optimizer.
    let err = run(&dir, "zero2", 2, 0.0, &["--resume", "--optimizer", "sgd"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("optimizer adamw, this run sgd"), "{err}");

    // Another seed: the batches after the checkpoint would be drawn in another order.
    let err = run(&dir, "zero2", 2, 0.0, &["--resume", "--seed", "7"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("seed 42, this run 7"), "{err}");

    // Another --accumulate: the data position is saved in micro-batches.
    let err = run(&dir, "zero2", 2, 0.0, &["--resume", "--accumulate", "2"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("micro-batches per optimizer step (--accumulate) 1, this run 2"),
        "{err}"
    );

    // An interrupted save (no meta.json) is not a checkpoint, and the next save clears it.
    fs::create_dir_all(dir.join(".step-00000006.partial")).unwrap();
    fs::create_dir_all(dir.join("step-00000006")).unwrap();
    fs::write(dir.join("step-00000006/rank-00000.safetensors"), b"half").unwrap();
    let (_, resumed) = run(&dir, "zero2", 2, 0.0, &["--resume", "--max-steps", "4"]).unwrap();
    assert_eq!(
        resumed.history.first().map(|m| m.step),
        Some(4),
        "resumed from step 3"
    );
    assert!(!dir.join(".step-00000006.partial").exists());
    fs::remove_dir_all(&dir).unwrap();
}

/// Under zero3 at the checkpoint's world size each rank reads only its own file: one whose
/// file is damaged fails alone, and the others stop naming it rather than wait for it.
#[test]
fn a_rank_that_cannot_restore_its_part_is_named_by_the_others() {
    let dir = scratch("restore-one");
    run(&dir, "zero3", 2, 0.0, &["--max-steps", "3"]).unwrap();
    let file = dir.join("step-00000003/rank-00001.safetensors");
    let mut bytes = fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    fs::write(&file, &bytes).unwrap();
    let args = TrainArgs::from_flags(&[
        "--strategy",
        "zero3",
        "--batch-size",
        "6",
        "--max-steps",
        "9",
        "--checkpoint-dir",
        dir.to_str().unwrap(),
        "--resume",
    ])
    .unwrap()
    .with_model_config(&GptConfig::tiny().with_dropout(0.0))
    .unwrap();
    let errors = run_ranks(2, Duration::from_secs(30), |comm| {
        let model = seeded_model(5, |device| Gpt::new(&GptConfig::tiny(), device).unwrap());
        let mut task = NextToken::new(tokens(), 8, 6, 5).unwrap();
        train_on(comm, model, &mut task, &args, &model_device())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect::<Vec<_>>();
    assert!(
        errors[1].contains("rank-00001.safetensors") && errors[1].contains("CRC-32"),
        "{errors:?}"
    );
    assert!(
        errors[0].contains("rank 1 could not read the newest checkpoint"),
        "{errors:?}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn old_checkpoints_go_only_once_a_new_one_is_complete() {
    let dir = scratch("keep");
    run(
        &dir,
        "zero1",
        2,
        0.0,
        &["--checkpoint-every", "2", "--keep-checkpoints", "2"],
    )
    .unwrap();
    let mut left: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-00000008", "step-00000009"]);

    // The newest damaged: the error names the complete one before it. Its files cut to less
    // than a tensor of the model, too: damage, not a checkpoint of another model.
    let files = ["rank-00000", "rank-00001"]
        .map(|rank| dir.join(format!("step-00000009/{rank}.safetensors")));
    let pristine = files.clone().map(|file| fs::read(file).unwrap());
    for (cut, len) in [(1, pristine[0].len() / 2), (2, 16)] {
        for (file, bytes) in files.iter().zip(&pristine).take(cut) {
            fs::write(file, &bytes[..len]).unwrap();
        }
        let err = run(&dir, "zero1", 2, 0.0, &["--resume", "--max-steps", "10"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("truncated") && err.contains("step-00000008, is complete"),
            "{err}"
        );
        for (file, bytes) in files.iter().zip(&pristine) {
            fs::write(file, bytes).unwrap();
        }
    }

    // A save that fails as it completes (a file where its directory goes): every rank
    // stops with the error, and the checkpoint before it stays whole.
    let failing = scratch("failing");
    fs::create_dir_all(&failing).unwrap();
    fs::write(failing.join("step-00000006"), b"in the way").unwrap();
    let err = run(&failing, "zero3", 2, 0.0, &[]).unwrap_err().to_string();
    assert!(err.contains("step-00000006"), "{err}");
    let (_, resumed) = run(&failing, "zero3", 2, 0.0, &["--resume", "--max-steps", "4"]).unwrap();
    assert_eq!(resumed.history.first().map(|m| m.step), Some(4));
    fs::remove_dir_all(&failing).unwrap();

    // A directory that cannot be made: an error before anything is lost.
    let blocked = dir.join("step-00000009/meta.json/sub");
    let err = run(&blocked, "zero1", 2, 0.0, &["--max-steps", "1"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("meta.json/sub"), "{err}");
    assert!(dir.join("step-00000009/meta.json").is_file());
    fs::remove_dir_all(&dir).unwrap();

    // One the run cannot write (nothing can be made in /proc): refused before its first step,
    // not found out at its first save, the steps before it lost.
    let err = run(
        Path::new("/proc/burnscale-checkpoints"),
        "zero1",
        2,
        0.0,
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--checkpoint-dir /proc/burnscale-checkpoints cannot be written"),
        "{err}"
    );
}

/// A resumed run's `--metrics-csv` keeps the rows of the steps before its checkpoint and goes
/// on from there; a refused resume leaves the file as it was.
#[test]
fn a_resumed_run_continues_its_metrics_file() {
    let dir = scratch("metrics");
    let csv = scratch("metrics.csv");
    let csv_flag = ["--metrics-csv", csv.to_str().unwrap()];
    run(&dir, "zero2", 2, 0.0, &csv_flag).unwrap();
    let uninterrupted = fs::read_to_string(&csv).unwrap();
    let rows: Vec<&str> = uninterrupted.lines().collect();
    assert_eq!(rows.len(), 10, "{uninterrupted}");
    keep_only(&dir, 6);

    let refused = run(
        &dir,
        "zero2",
        2,
        0.0,
        &[&csv_flag[..], &["--resume", "--seed", "7"]].concat(),
    );
    assert!(refused.is_err());
    assert_eq!(fs::read_to_string(&csv).unwrap(), uninterrupted);

    let (_, summary) = run(
        &dir,
        "zero2",
        2,
        0.0,
        &[&csv_flag[..], &["--resume"]].concat(),
    )
    .unwrap();
    // This run's steps, 7-9, timed after its first.
    assert_eq!(
        (summary.first_step, summary.steps, summary.timed_steps),
        (7, 9, 2)
    );
    let resumed = fs::read_to_string(&csv).unwrap();
    let resumed: Vec<&str> = resumed.lines().collect();
    assert_eq!(resumed.len(), 10, "{resumed:?}");
    assert_eq!(resumed[..7], rows[..7], "the header and steps 1-6 kept");
    // Steps 7-9 (step, lr, loss) of a file, to hold against the uninterrupted run's.
    let steps_7_to_9 = |rows: &[&str]| -> Vec<String> {
        rows[7..]
            .iter()
            .map(|row| row.split(',').take(3).collect::<Vec<_>>().join(","))
            .collect()
    };
    assert_eq!(
        steps_7_to_9(&resumed),
        steps_7_to_9(&rows),
        "steps 7-9 (step, lr, loss) as the uninterrupted run's"
    );
    // Time goes on from the earlier rows'.
    let elapsed = |row: &str| row.split(',').nth(5).unwrap().parse::<f64>().unwrap();
    assert!(elapsed(resumed[7]) >= elapsed(resumed[6]), "{resumed:?}");

    // A file written before the validation columns goes on too, its rows given empty ones.
    let without_validation = |row: &str| row.split(',').take(7).collect::<Vec<_>>().join(",");
    let older: Vec<String> = rows.iter().map(|r| without_validation(r)).collect();
    fs::write(&csv, older.join("\n") + "\n").unwrap();
    keep_only(&dir, 6);
    run(
        &dir,
        "zero2",
        2,
        0.0,
        &[&csv_flag[..], &["--resume"]].concat(),
    )
    .unwrap();
    let continued = fs::read_to_string(&csv).unwrap();
    let continued: Vec<&str> = continued.lines().collect();
    assert_eq!(continued[0], rows[0], "today's header");
    let padded: Vec<String> = older[1..7].iter().map(|r| format!("{r},,")).collect();
    assert_eq!(
        continued[1..7],
        padded,
        "steps 1-6 kept, with empty validation columns"
    );
    assert_eq!(steps_7_to_9(&continued), steps_7_to_9(&rows));
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_file(&csv).unwrap();
}

/// A task whose rank `rank` fails when it draws its micro-batch number `at`: in the middle
/// of a step.
#[derive(Clone)]
struct FailsAt {
    task: NextToken,
    rank: usize,
    at: usize,
    drawn: usize,
    fault: Fault,
}

#[derive(Clone)]
enum Fault {
    /// Panics, as a failing kernel or an out-of-memory abort would end it.
    Dies,
    Late(Duration),
    /// Asks the run to stop (Ctrl-C in an example).
    Stops(StopFlag),
    /// Puts a file where the checkpoint directory was (its disk gone): saving there fails.
    Breaks(PathBuf),
}

impl TrainTask for FailsAt {
    type Model = Gpt;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Gpt> {
        self.drawn += 1;
        if part.rank == self.rank && self.drawn == self.at {
            match &self.fault {
                Fault::Late(late) => std::thread::sleep(*late),
                Fault::Dies => panic!("rank {} dies drawing micro-batch {}", self.rank, self.at),
                Fault::Stops(stop) => stop.request(),
                Fault::Breaks(dir) => {
                    fs::remove_dir_all(dir).unwrap();
                    fs::write(dir, "not a directory").unwrap();
                }
            }
        }
        self.task.next_batch(device, part)
    }
    fn items(&self, input: &Tensor<2, Int>) -> usize {
        self.task.items(input)
    }
    fn counts_tokens(&self) -> bool {
        self.task.counts_tokens()
    }
    fn eval_batches(&self) -> usize {
        self.task.eval_batches()
    }
    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Gpt> {
        self.task.eval_batch(k, device)
    }
    fn score(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> Score {
        self.task.score(logits, targets)
    }
}

#[test]
fn a_rank_that_dies_mid_step_stops_the_others_and_leaves_the_last_checkpoint() {
    let (dir, whole) = (scratch("dies"), scratch("dies-whole"));
    let uninterrupted = steps(&run(&whole, "zero3", 2, 0.0, &[]).unwrap().1);
    // Micro-batch 5 is step 5's (one per step): after the step-3 checkpoint.
    let dies = |task, _: &mut TrainArgs| FailsAt {
        task,
        rank: 1,
        at: 5,
        drawn: 0,
        fault: Fault::Dies,
    };
    let started = std::time::Instant::now();
    let err = run_task(&dir, "zero3", 2, 0.0, &[], dies).unwrap_err();
    // The first failure is reported, naming its rank; the other rank stopped at its next
    // collective instead of waiting out the timeout.
    assert!(
        matches!(&err, TrainError::RankPanicked { rank: 1, message } if message.contains("dies")),
        "{err}"
    );
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
    let entries: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries, ["step-00000003"]);
    // That checkpoint is whole: resumed, the run takes the uninterrupted run's steps.
    let (_, resumed) = run(&dir, "zero3", 2, 0.0, &["--resume"]).unwrap();
    assert_eq!(steps(&resumed), uninterrupted[3..]);
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_dir_all(&whole).unwrap();
}

/// The last step's checkpoint failing (its directory gone) still leaves the trained model in
/// `--save`'s file, elsewhere, and the run's error says both; a checkpoint failing before the
/// last step stops the run there.
#[test]
fn a_last_checkpoint_that_fails_still_saves_the_model() {
    let (dir, whole) = (scratch("last-fails"), scratch("last-fails-whole"));
    let (file, whole_file) = (
        scratch("last-fails.safetensors"),
        scratch("whole.safetensors"),
    );
    run(
        &whole,
        "zero2",
        2,
        0.0,
        &["--save", whole_file.to_str().unwrap()],
    )
    .unwrap();
    let breaks = |at, dir: &Path| {
        let dir = dir.to_path_buf();
        move |task, _: &mut TrainArgs| FailsAt {
            task,
            rank: 1,
            at,
            drawn: 0,
            fault: Fault::Breaks(dir),
        }
    };
    let flags = ["--save", file.to_str().unwrap()];
    let err = run_task(&dir, "zero2", 2, 0.0, &flags, breaks(9, &dir)).unwrap_err();
    assert!(
        matches!(&err, TrainError::LastCheckpoint { saved, .. } if *saved == file),
        "{err}"
    );
    assert!(
        err.to_string().contains(&dir.display().to_string()),
        "{err}"
    );
    assert_eq!(fs::read(&file).unwrap(), fs::read(&whole_file).unwrap());
    // Before the last step, the run stops at the checkpoint that failed, saving nothing.
    for path in [&dir, &file] {
        let _ = fs::remove_file(path);
    }
    let err = run_task(&dir, "zero2", 2, 0.0, &flags, breaks(5, &dir)).unwrap_err();
    assert!(matches!(&err, TrainError::Checkpoint(_)), "{err}");
    assert!(!file.exists());
    let _ = fs::remove_file(&dir);
    fs::remove_dir_all(&whole).unwrap();
    fs::remove_file(&whole_file).unwrap();
}

/// Alone, a rank that panics comes back as one of several does, an error naming it: a
/// program that trains jobs sees the same error on one rank as on many (it unwound through
/// `train` into the caller).
#[test]
fn a_lone_rank_that_panics_is_an_error() {
    let dir = scratch("dies-alone");
    let dies = |task, _: &mut TrainArgs| FailsAt {
        task,
        rank: 0,
        at: 2,
        drawn: 0,
        fault: Fault::Dies,
    };
    let err = run_task(&dir, "single", 1, 0.0, &[], dies).unwrap_err();
    assert!(
        matches!(&err, TrainError::RankPanicked { rank: 0, message } if message.contains("dies")),
        "{err}"
    );
    let _ = fs::remove_dir_all(&dir);
}

/// A stop asked on one rank during step 5 (as Ctrl-C in an example): every rank ends that
/// step, its checkpoint is written and the run returns `Stopped` naming it, with the
/// optimizer state's scratch files under `--offload-dir` removed; resumed from it, the run
/// takes the uninterrupted run's later steps. Asked in the last step, it changes nothing.
#[test]
fn a_stop_asked_on_one_rank_ends_every_rank_after_the_step_with_its_checkpoint() {
    let (dir, whole) = (scratch("stop"), scratch("stop-whole"));
    let scratch_files = tempfile::tempdir().unwrap();
    let offload = ["--offload-dir", scratch_files.path().to_str().unwrap()];
    let uninterrupted = steps(&run(&whole, "zero2", 2, 0.0, &offload).unwrap().1);
    let stops_at = |at| {
        move |task, args: &mut TrainArgs| {
            let stop = StopFlag::new();
            args.stop = Some(stop.clone());
            FailsAt {
                task,
                rank: 1,
                at,
                drawn: 0,
                fault: Fault::Stops(stop),
            }
        }
    };
    let err = run_task(&dir, "zero2", 2, 0.0, &offload, stops_at(5)).unwrap_err();
    let step_5 = dir.join("step-00000005");
    assert!(
        matches!(&err, TrainError::Stopped { step: 5, checkpoint: Some(at) } if *at == step_5),
        "{err}"
    );
    assert!(
        err.to_string().contains("--resume goes on from it"),
        "{err}"
    );
    assert!(
        fs::read_dir(scratch_files.path()).unwrap().next().is_none(),
        "the ranks' scratch files are removed"
    );
    let (_, resumed) = run(
        &dir,
        "zero2",
        2,
        0.0,
        &[&offload[..], &["--resume"]].concat(),
    )
    .unwrap();
    assert_eq!(steps(&resumed), uninterrupted[5..]);
    fs::remove_dir_all(&dir).unwrap();
    // Asked in the last step, the run ends as it would have.
    fs::remove_dir_all(&whole).unwrap();
    let (_, last) = run_task(&whole, "zero2", 2, 0.0, &offload, stops_at(9)).unwrap();
    assert_eq!(steps(&last), uninterrupted);
    fs::remove_dir_all(&whole).unwrap();
}

/// A program following the run through `on_step` sees each step once (rank 0's call, of 2
/// ranks), in order, once the step's checkpoint is written, with the validation loss on the
/// steps that evaluate (every 4th and the last), as `--metrics-csv` has them and the summary
/// reports the last; a stop it raises ends the run after the next step.
#[test]
fn a_program_follows_the_run_step_by_step() {
    type Seen = Arc<Mutex<Vec<(StepMetrics, bool)>>>;
    let (dir, csv) = (scratch("follow"), scratch("follow.csv"));
    let flags = [
        "--eval-interval",
        "4",
        "--metrics-csv",
        csv.to_str().unwrap(),
    ];
    let follow = |seen: &Seen, stop_at: Option<usize>| {
        let (seen, dir) = (seen.clone(), dir.clone());
        move |task: NextToken, args: &mut TrainArgs| {
            let stop = StopFlag::new();
            args.stop = Some(stop.clone());
            args.on_step = Some(OnStep::new(move |m| {
                let saved = dir.join(format!("step-{:08}/meta.json", m.step)).exists();
                seen.lock().unwrap().push((*m, saved));
                if Some(m.step) == stop_at {
                    stop.request();
                }
            }));
            task.with_validation(tokens()[..500].to_vec(), 8, 3)
                .unwrap()
        }
    };
    let seen = Seen::default();
    let (_, summary) = run_task(&dir, "zero2", 2, 0.0, &flags, follow(&seen, None)).unwrap();
    let seen = seen.lock().unwrap().clone();
    let evaluated = |m: &StepMetrics| m.val_loss.is_some();
    assert_eq!(
        seen.iter().map(|(m, _)| m.step).collect::<Vec<_>>(),
        (1..=9).collect::<Vec<_>>()
    );
    assert_eq!(
        seen.iter()
            .map(|(m, saved)| (m.step, *saved))
            .collect::<Vec<_>>(),
        (1..=9).map(|s| (s, s % 3 == 0)).collect::<Vec<_>>(),
        "called once the step's checkpoint (every 3rd) is written"
    );
    assert_eq!(
        seen.iter()
            .filter(|(m, _)| evaluated(m))
            .map(|(m, _)| m.step)
            .collect::<Vec<_>>(),
        [4, 8, 9]
    );
    assert_eq!(seen[8].0.val_loss, Some(summary.val_loss));
    assert_eq!(
        seen.iter()
            .map(|(m, _)| (m.step, m.loss))
            .collect::<Vec<_>>(),
        summary
            .history
            .iter()
            .map(|m| (m.step, m.loss))
            .collect::<Vec<_>>()
    );
    let rows = fs::read_to_string(&csv).unwrap();
    let val_column = rows
        .lines()
        .skip(1)
        .map(|row| row.split(',').nth(7).unwrap().parse::<f64>().ok())
        .collect::<Vec<_>>();
    assert_eq!(
        val_column,
        seen.iter().map(|(m, _)| m.val_loss).collect::<Vec<_>>(),
        "{rows}"
    );

    // Raised in step 3's call, the stop ends the run after step 4, whose evaluation it skips.
    fs::remove_dir_all(&dir).unwrap();
    let stopped = Seen::default();
    let err = run_task(&dir, "zero2", 2, 0.0, &flags, follow(&stopped, Some(3))).unwrap_err();
    assert!(matches!(err, TrainError::Stopped { step: 4, .. }), "{err}");
    let stopped = stopped.lock().unwrap();
    assert_eq!(stopped.len(), 4);
    assert_eq!(
        (stopped[3].0.val_loss, stopped[3].1),
        (None, true),
        "not evaluated; its checkpoint written"
    );
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_file(&csv).unwrap();
}

/// A rank 5 s late to step 5's collectives: within the default timeout the run goes on;
/// with `--collective-timeout 2` it stops with an error naming the late rank (which, arriving
/// well within `STUCK_GRACE` (10 s) of that, stops at its collective rather than ending the
/// process). 3 s either side: a rank 0 that reaches the collective up to 3 s after rank 1
/// starts its wait still times out.
#[test]
fn a_rank_late_past_the_collective_timeout_stops_the_run_naming_it() {
    let dir = scratch("late");
    let late = |task, _: &mut TrainArgs| FailsAt {
        task,
        rank: 1,
        at: 5,
        drawn: 0,
        fault: Fault::Late(Duration::from_secs(5)),
    };
    run_task(&dir, "zero2", 2, 0.0, &[], late).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    let err = run_task(&dir, "zero2", 2, 0.0, &["--collective-timeout", "2"], late).unwrap_err();
    let message = err.to_string();
    eprintln!("{message}");
    assert!(
        message.contains("rank(s) [1]") && message.contains("timed out after 2.0 s"),
        "{message}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// A run stopped after its last checkpoint (before its `--save`), requeued as it was, takes
/// no step and saves the checkpoint's model; a checkpoint past `--max-steps` is refused.
#[test]
fn a_run_resumed_at_its_last_step_saves_the_checkpoints_model() {
    let dir = scratch("resume-at-end");
    let saved = dir.with_extension("saved.safetensors");
    let resaved = dir.with_extension("resaved.safetensors");
    let save = |path: &Path, steps: &str| {
        let flags = ["--max-steps", steps, "--save", path.to_str().unwrap()];
        run(&dir, "zero3", 2, 0.0, &[&flags[..], &["--resume"]].concat())
    };
    save(&saved, "3").unwrap();
    let (_, summary) = save(&resaved, "3").unwrap();
    assert_eq!(
        (summary.first_step, summary.steps, summary.timed_steps),
        (4, 3, 0)
    );
    let table = summary.table();
    assert!(
        table.contains("3 (resumed from step 3: none in this run)"),
        "{table}"
    );
    let read = |path: &Path| {
        let mut w = weights::read_safetensors(path).unwrap();
        w.sort_by(|a, b| a.key.cmp(&b.key));
        w
    };
    assert_eq!(read(&resaved), read(&saved));
    let err = save(&resaved, "2").unwrap_err().to_string();
    assert!(err.contains("at step 3, past --max-steps 2"), "{err}");
    for file in [saved, resaved] {
        fs::remove_file(file).unwrap();
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// `--save` keeps beside its file the run's recorded configuration, or none: one an earlier
/// run left there is removed, not kept beside weights it does not describe.
#[test]
fn a_save_leaves_no_other_runs_configuration_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("m.safetensors");
    let config = weights::config_path(&saved);
    fs::write(&config, r#"{"characters": "abc"}"#).unwrap();
    let flags = ["--max-steps", "1", "--batch-size", "4"];
    let args = TrainArgs::from_flags(&[&flags[..], &["--save", saved.to_str().unwrap()]].concat())
        .unwrap();
    let tiny = GptConfig::tiny();
    let save = |args: &TrainArgs| {
        let model = seeded_model(5, |device| Gpt::new(&tiny, device).unwrap());
        let mut task = NextToken::new(tokens(), 8, 4, 5).unwrap();
        train(model, &mut task, args, &model_device()).unwrap();
    };
    save(&args);
    assert!(saved.exists() && !config.exists());
    save(&args.with_model_config(&tiny).unwrap());
    let recorded: serde_json::Value = serde_json::from_slice(&fs::read(&config).unwrap()).unwrap();
    assert_eq!(recorded, serde_json::to_value(tiny).unwrap());
}

#[test]
fn a_consolidated_checkpoint_is_the_saved_model() {
    let dir = scratch("consolidate");
    let saved = dir.with_extension("saved.safetensors");
    let (trained, summary) = run(
        &dir,
        "zero3",
        2,
        0.0,
        &["--max-steps", "3", "--save", saved.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(summary.steps, 3);
    let mut ckpt = Checkpoint::find(&dir).unwrap();
    assert!(ckpt.describe().contains("step 3"), "{}", ckpt.describe());
    let out = dir.join("consolidated.safetensors");
    ckpt.consolidate(&out, false).unwrap();
    let sorted = |path: &Path| {
        let mut w = weights::read_safetensors(path).unwrap();
        w.sort_by(|a, b| a.key.cmp(&b.key));
        w
    };
    // The end-of-training --save streams the same values in the same (GPT-2) layout.
    assert_eq!(sorted(&out), sorted(&saved));
    // What `--weights` loads from it computes the trained model's logits.
    let config = GptConfig::tiny().with_dropout(0.0);
    let loaded = burnscale::mingpt::loader::load(&out, &config, &model_device());
    let ids: Vec<i64> = tokens()[..16].to_vec();
    let logits = |model: &Gpt| -> Vec<f32> {
        let idx =
            Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [2, 8]), &model_device());
        model.forward(idx).into_data().try_into_vec().unwrap()
    };
    assert_eq!(logits(&loaded.unwrap()), logits(&trained));

    // The optimizer state goes beside the model, which `--weights` still loads.
    let with_state = dir.join("with-optimizer.safetensors");
    let count = ckpt.consolidate(&with_state, true).unwrap();
    let params = weights::read_safetensors(&saved).unwrap().len();
    assert_eq!(count, 3 * params, "AdamW's two moments per parameter");
    let moments = weights::read_safetensors(&optimizer_path(&with_state)).unwrap();
    assert_eq!(moments.len(), 2 * params);
    // They are the moments of one rank's run of the same global batch, to the f32 rounding
    // of the other order of its sums: a shard out of place, or the two moments swapped, is
    // off by their size.
    let single_dir = scratch("consolidate-single");
    run(&single_dir, "single", 1, 0.0, &["--max-steps", "3"]).unwrap();
    let single_state = single_dir.join("with-optimizer.safetensors");
    let mut single = Checkpoint::find(&single_dir).unwrap();
    single.consolidate(&single_state, true).unwrap();
    let (got, want) = (
        sorted(&optimizer_path(&with_state)),
        sorted(&optimizer_path(&single_state)),
    );
    assert_eq!(got.len(), want.len());
    for (got, want) in got.iter().zip(&want) {
        assert_eq!(got.key, want.key);
        let scale = want
            .values
            .iter()
            .map(|v| v.abs())
            .fold(0.0, common::nan_max);
        let worst = common::worst_abs_diff(&got.values, &want.values);
        assert!(
            worst <= 1e-4 * scale,
            "{}: {worst} from the one-rank run's (largest {scale})",
            got.key
        );
    }
    let loaded = burnscale::mingpt::loader::load(&with_state, &config, &model_device());
    assert_eq!(logits(&loaded.unwrap()), logits(&trained));
    // Consolidated again without it, no earlier state is left beside the model.
    ckpt.consolidate(&with_state, false).unwrap();
    assert!(!optimizer_path(&with_state).exists());
    // A mistyped path is named as missing, not as an interrupted save.
    let typo = dir.join("no-such-dir");
    let err = Checkpoint::find(&typo)
        .err()
        .expect("no checkpoint")
        .to_string();
    assert!(
        err.contains("no-such-dir") && err.contains("No such file"),
        "{err}"
    );
    // A directory of no checkpoint is named as one, not as an interrupted save.
    let empty = dir.join("empty");
    fs::create_dir_all(&empty).unwrap();
    let err = Checkpoint::find(&empty).err().expect("none").to_string();
    assert!(
        err.ends_with("empty holds no complete checkpoint (a step-N directory with meta.json)"),
        "{err}"
    );
    fs::remove_file(&saved).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_dir_all(&single_dir).unwrap();
}
