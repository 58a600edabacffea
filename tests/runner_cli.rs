//! The runner binaries end to end (`mingpt_char`, and `bert_classify`'s input checks): the
//! 16-bit paths train, sample and exit 0; bad input gets a clear message naming the problem,
//! a non-zero exit, and no panic.

use std::path::PathBuf;
use std::process::Command;

/// The example `name` that `cargo test` built beside this test binary.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    profile_dir.join("examples").join(name)
}

fn mingpt_char() -> PathBuf {
    example("mingpt_char")
}

#[test]
fn sixteen_bit_runs_train_sample_and_exit_cleanly() {
    for (precision, optimizer) in [
        ("bf16-true", "adamw"),
        ("16-true", "sgd"),
        ("16-mixed", "adamw"),
    ] {
        let out = Command::new(mingpt_char())
            .args([
                "--precision",
                precision,
                "--optimizer",
                optimizer,
                "--max-steps",
                "5",
                "--batch-size",
                "4",
                "--eval-batches",
                "1",
                "--sample-len",
                "40",
            ])
            .output()
            .expect("mingpt_char runs");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{precision}: {stderr}");
        assert!(!stderr.contains("panicked"), "{precision}: {stderr}");
        let sample = stdout
            .split("--- sample ---\n")
            .nth(1)
            .and_then(|rest| rest.split("\n-----").next())
            .unwrap_or_default();
        assert!(
            sample.chars().count() > "O God, O God!".len() + 20,
            "{precision}: no sample in\n{stdout}"
        );
    }
}

fn fails_with(args: &[&str], needle: &str) {
    example_fails_with("mingpt_char", args, needle);
}

fn example_succeeds(name: &str, args: &[&str]) {
    let out = Command::new(example(name))
        .args(args)
        .output()
        .expect("the example runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
}

fn example_fails_with(name: &str, args: &[&str], needle: &str) {
    let out = Command::new(example(name))
        .args(args)
        .output()
        .expect("the example runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(stderr.contains(needle), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
}

#[test]
fn bad_flags_are_named() {
    fails_with(&["--n-head", "5"], "must be divisible by n_head");
    // The last of a flag given twice, as argparse takes it.
    fails_with(
        &["--n-head", "4", "--n-head", "5"],
        "must be divisible by n_head",
    );
    fails_with(&["--block-size", "0"], "block_size");
    // One flag sets the config's three dropouts: it is named, not the first of them.
    fails_with(
        &["--dropout", "1"],
        "for '--dropout <DROPOUT>': dropout 1 is not in [0, 1)",
    );
    fails_with(&["--model", "gpt5"], "unknown model preset `gpt5`");
    fails_with(
        &["--strategy", "single", "--devices", "2"],
        "--strategy single trains on one rank",
    );
    fails_with(
        &["--devices", "0"],
        "--devices must be at least 1 (got 16, 1, 2500, 0)",
    );
    fails_with(
        &["--offload", "params", "--strategy", "ddp"],
        "--offload params keeps ZeRO-3's parameter shards",
    );
    // f16 weights and AdamW state: the loss turns NaN within a few steps, and the run stops.
    fails_with(
        &[
            "--precision",
            "16-true",
            "--max-steps",
            "20",
            "--sample-len",
            "0",
        ],
        "under --precision 16-true",
    );
    fails_with(
        &["--checkpoint-blocks", "99"],
        "--checkpoint-blocks 99 is more blocks than the model has (4)",
    );
    fails_with(
        &["--checkpoint-blocks", "2", "--checkpoint-activations"],
        "cannot be used with",
    );
    fails_with(
        &["--checkpoint-blocks", "0"],
        "--checkpoint-blocks 0 checkpoints nothing",
    );
    fails_with(
        &["--checkpoint-mode", "selective"],
        "--checkpoint-mode selective says what checkpointed blocks keep: give --checkpoint-activations or --checkpoint-blocks N",
    );
    fails_with(&["--checkpoint-mode", "ops"], "invalid value 'ops'");
    fails_with(&["--strategy", "zero9"], "invalid value 'zero9'");
    fails_with(&["--accelerator", "tpu"], "invalid value 'tpu'");
    // An accelerator the build lacks (a cuda build on a machine without a GPU says so instead).
    if !cfg!(feature = "cuda") {
        fails_with(&["--accelerator", "cuda"], "built without CUDA");
    }
    if !cfg!(feature = "cubecl-cpu") {
        fails_with(
            &["--accelerator", "cubecl-cpu"],
            "built without cubecl's CPU runtime",
        );
    }
    if !cfg!(feature = "tch") {
        fails_with(
            &["--accelerator", "libtorch"],
            "built without Burn's LibTorch backend",
        );
    }
    fails_with(
        &["--data", "/nonexistent/text.txt"],
        "/nonexistent/text.txt",
    );
    // A setting the optimizer would not read, or could not step with.
    fails_with(&["--momentum", "0.5"], "--momentum is not read");
    fails_with(&["--beta2", "1"], "--beta2 must be in [0, 1), got 1");
    // A flag with nothing to act on.
    fails_with(
        &["--grad-reduce-dtype", "bf16"],
        "--grad-reduce-dtype bf16 is the dtype gradients are reduced in over the ranks, but the world has one rank",
    );
    fails_with(
        &[
            "--strategy",
            "zero3",
            "--reshard-after-forward",
            "false",
            "--precision",
            "32-true",
        ],
        "a rank alone computing in its weights' dtype (--precision 32-true, not offloaded) gathers nothing",
    );
    fails_with(
        &["--eval-batches", "0"],
        "validation batches (--eval-batches) must be at least 1",
    );
    // Files written at the end are checked at the start: here under a regular file, which no
    // machine can hold as a directory (a run that made /nonexistent once failed this).
    let file = tempfile::NamedTempFile::new().unwrap();
    let json = file.path().join("s.json");
    fails_with(
        &["--summary-json", json.to_str().unwrap()],
        &format!("{} is not a directory", file.path().display()),
    );
}

/// A text longer than the position table is truncated to `--max-length`, which may not
/// exceed the table (MiniLM's: 512).
#[test]
fn bert_classify_names_a_max_length_past_the_position_table() {
    example_fails_with(
        "bert_classify",
        &["--max-length", "600"],
        "--max-length 600 must be between 3 and the model's 512 positions",
    );
}

/// A classifier to start from that is not there is named before the corpus is tokenized.
#[test]
fn bert_classify_names_weights_it_cannot_read() {
    example_fails_with(
        "bert_classify",
        &["--weights", "/nonexistent/spam.safetensors"],
        "--weights /nonexistent/spam.safetensors: cannot read it",
    );
}

/// A classifier saved after training on another split of the corpus (its record beside it)
/// is refused before the corpus is tokenized: its test emails would include training ones.
#[test]
fn bert_classify_refuses_weights_trained_on_another_split() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("spam.safetensors");
    std::fs::write(&weights, b"").unwrap();
    let split = r#"{"max_length": 128, "seed": 42, "test_fraction": 0.2}"#;
    let record = format!(r#"{{"data": {{"data": "spam-assassin", "split": {split}}}}}"#);
    std::fs::write(dir.path().join("spam.config.json"), record).unwrap();
    example_fails_with(
        "bert_classify",
        &["--weights", weights.to_str().unwrap(), "--max-length", "64"],
        "(--max-length 128, this run 64, as ",
    );
}

/// A flag that cannot apply to the model or the world is named before the weights are read
/// (or fetched, or a corpus tokenized): here before a weights file that does not exist.
#[test]
fn flags_the_model_refuses_are_named_before_its_weights_are_read() {
    let weights = [
        "--model",
        "tiny",
        "--weights",
        "/nonexistent/vit.safetensors",
    ];
    for (flags, needle) in [
        (
            &["--freeze", "encoder.typo"][..],
            "--freeze encoder.typo: no parameter of the model has that path",
        ),
        (
            &["--checkpoint-blocks", "99"],
            "--checkpoint-blocks 99 is more blocks",
        ),
        (&["--devices", "2"], "--strategy single trains on one rank"),
        (
            &["--dropout=-0.1"],
            "for '--dropout <DROPOUT>': dropout -0.1 is not in",
        ),
        // Loaded weights come whole in f32: nothing is left to create in 16 bits.
        (
            &["--precision", "bf16-true", "--init-on-device"],
            "but --weights /nonexistent/vit.safetensors loads them whole in f32 first",
        ),
    ] {
        example_fails_with("vit_finetune", &[&weights[..], flags].concat(), needle);
    }
    for (example, flags) in [
        ("bert_classify", &[][..]),
        (
            "mingpt_char",
            &["--weights", "/nonexistent/gpt.safetensors"],
        ),
    ] {
        let flags = [flags, &["--precision", "bf16-true", "--init-on-device"]].concat();
        example_fails_with(example, &flags, "loads them whole in f32 first");
    }
}

#[test]
fn vit_finetune_names_its_evaluation_and_split_flags() {
    example_fails_with(
        "vit_finetune",
        &["--data", "cifar10:/nonexistent", "--test-fraction", "0.5"],
        "CIFAR-10 has its own",
    );
    example_fails_with(
        "vit_finetune",
        &["--test-fraction", "0"],
        "--test-fraction 0 is not in (0, 1)",
    );
    example_fails_with(
        "vit_finetune",
        &["--weights", "none", "--model", "tiny", "--eval-batch", "0"],
        "images per evaluation batch (--eval-batch) must be at least 1",
    );
}

/// A run resumed on another split of its data would test on images it trained on: it is
/// stopped, naming what differs; the same split, its default fraction written out, resumes.
#[test]
fn a_run_resumed_on_another_split_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().to_str().unwrap();
    let tiny = [
        "--weights",
        "none",
        "--model",
        "tiny",
        "--checkpoint-dir",
        ckpt,
    ];
    example_succeeds(
        "vit_finetune",
        &[&tiny[..], &["--max-steps", "1", "--warmup-steps", "0"]].concat(),
    );
    let resumed = ["--max-steps", "2", "--resume", "--test-fraction", "0.3"];
    example_fails_with(
        "vit_finetune",
        &[&tiny[..], &resumed].concat(),
        "model config: data split --test-fraction 0.2, this run 0.3",
    );
    let same = ["--max-steps", "2", "--resume", "--test-fraction", "0.2"];
    example_succeeds("vit_finetune", &[&tiny[..], &same].concat());
}

/// A minGPT run resumed on another text, of the same characters (whose ids still read),
/// would train on other windows and validate on what it trained on: it is stopped.
#[test]
fn a_char_model_resumed_on_another_text_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let text = |name: &str, words: [&str; 2]| {
        let path = dir.path().join(name);
        std::fs::write(&path, words.repeat(300).join(" ")).unwrap();
        path.to_str().unwrap().to_string()
    };
    let (first, second) = (
        text("a.txt", ["to be", "or not"]),
        text("b.txt", ["or not", "to be"]),
    );
    let ckpt = dir.path().join("ckpt");
    let run = [
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--eval-batches",
        "1",
        "--sample-len",
        "0",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ];
    example_succeeds(
        "mingpt_char",
        &[&run[..], &["--max-steps", "1", "--data", &first]].concat(),
    );
    let resumed = ["--max-steps", "2", "--resume", "--data", &second];
    example_fails_with(
        "mingpt_char",
        &[&run[..], &resumed].concat(),
        "model config: data",
    );
}

/// A ViT saved by a run and loaded back with `--weights FILE` sees its images normalised as
/// that run did (ImageNet's, DINOv2's), not as an HF checkpoint without a preprocessor's, and
/// is not tested on another split of the images it trained on.
#[test]
fn a_saved_vit_is_loaded_back_with_its_normalisation_and_split() {
    use burnscale::vit::{dinov2, loader};
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("vit.safetensors");
    let tiny = ["--model", "tiny", "--max-steps", "1", "--warmup-steps", "0"];
    let save = ["--weights", "none", "--save", saved.to_str().unwrap()];
    example_succeeds("vit_finetune", &[&tiny[..], &save].concat());
    assert_eq!(
        loader::image_normalization(&saved).unwrap(),
        (dinov2::MEAN, dinov2::STD)
    );
    let load = ["--weights", saved.to_str().unwrap()];
    example_succeeds("vit_finetune", &[&tiny[..], &load].concat());
    for (flags, needle) in [
        (["--seed", "1"], "(--seed 42, this run 1, as "),
        (
            ["--test-fraction", "0.3"],
            "(--test-fraction 0.2, this run 0.3, as ",
        ),
    ] {
        example_fails_with("vit_finetune", &[&tiny[..], &load, &flags].concat(), needle);
    }
}

#[test]
fn bad_weight_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":").unwrap();
    fails_with(
        &["--weights", truncated.to_str().unwrap()],
        "is it truncated?",
    );
    // torch.save's formats (a zip, a pickle) are named as PyTorch's, not as damaged.
    for (name, head) in [
        ("model.pt", &b"PK\x03\x04rest"[..]),
        ("model.bin", b"\x80\x02}q\x00"),
    ] {
        let torch = dir.path().join(name);
        std::fs::write(&torch, head).unwrap();
        fails_with(
            &["--weights", torch.to_str().unwrap()],
            "looks like a PyTorch checkpoint",
        );
    }
    // A safetensors file whose header length (640) starts as a pickle does stays one.
    std::fs::write(&truncated, b"\x80\x02\x00\x00\x00\x00\x00\x00{\"a\":").unwrap();
    fails_with(
        &["--weights", truncated.to_str().unwrap()],
        "is it truncated?",
    );
    let missing = dir.path().join("missing.safetensors");
    fails_with(
        &["--weights", missing.to_str().unwrap()],
        "missing.safetensors",
    );
    // Weights trained on another text's characters (recorded beside them by --save).
    let other = dir.path().join("other.safetensors");
    let config = dir.path().join("other.config.json");
    std::fs::write(&config, r#"{"characters": "abc"}"#).unwrap();
    fails_with(
        &["--weights", other.to_str().unwrap()],
        "trained on other characters (3 in",
    );
    // One that cannot be read is no missing one (whose ids are taken as this text's).
    std::fs::write(&config, b"{\"characters\": \"\xff\"}").unwrap();
    fails_with(
        &["--weights", other.to_str().unwrap()],
        &format!("cannot read {}", config.display()),
    );
}

/// A checkpoint consolidated into one file keeps the run's configuration beside it, minGPT's
/// characters with it: weights trained on another text are refused as `--save`'s are.
#[test]
fn consolidated_weights_keep_their_characters() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, text) = (dir.path().join("ckpt"), dir.path().join("other.txt"));
    std::fs::write(&text, "abcd efgh ".repeat(400)).unwrap();
    let (text, ckpt) = (text.to_str().unwrap(), ckpt.to_str().unwrap());
    example_succeeds(
        "mingpt_char",
        &[
            "--data",
            text,
            "--max-steps",
            "1",
            "--batch-size",
            "2",
            "--eval-batches",
            "1",
        ]
        .into_iter()
        .chain([
            "--sample-len",
            "0",
            "--block-size",
            "16",
            "--checkpoint-dir",
            ckpt,
        ])
        .collect::<Vec<_>>(),
    );
    // A directory for the file is refused before any tensor is read, naming it; a path
    // with no checkpoint is named for what is there, not "no checkpoint".
    let taken = dir.path().to_str().unwrap();
    example_fails_with("consolidate", &[ckpt, taken], "it is a directory");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let empty = empty.to_str().unwrap();
    example_fails_with(
        "consolidate",
        &[empty, "x.safetensors"],
        "empty holds no complete checkpoint (a step-N directory with meta.json)",
    );
    let out = dir.path().join("out.safetensors");
    example_succeeds("consolidate", &[ckpt, out.to_str().unwrap()]);
    fails_with(
        &["--weights", out.to_str().unwrap(), "--block-size", "16"],
        "trained on other characters (9 in",
    );
}

#[test]
fn summary_reports_every_ranks_memory_and_no_host_transfers() {
    let json = std::env::temp_dir().join(format!("burnscale-summary-{}.json", std::process::id()));
    let out = Command::new(mingpt_char())
        .args(["--strategy", "zero3", "--devices", "2", "--max-steps", "2"])
        .args([
            "--batch-size",
            "2",
            "--eval-batches",
            "1",
            "--sample-len",
            "0",
        ])
        .arg("--summary-json")
        .arg(&json)
        .output()
        .expect("mingpt_char runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).expect("the summary was written");
    let _ = std::fs::remove_file(&json);
    let summary: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(summary["host_transfer_bytes_per_step"], 0, "{text}");
    // The flags it trained with, which read back as a job, and the model's configuration.
    let args = burnscale::train::TrainArgs::from_json(&summary["args"]).expect("runner flags");
    assert_eq!(
        (args.strategy, args.devices, args.batch_size, args.max_steps),
        (burnscale::train::Strategy::Zero3, 2, 2, 2),
        "{text}"
    );
    assert_eq!(summary["model_config"]["n_layer"], 4, "{text}");
    // The optimizer's settings as resolved: mingpt_char's rate, AdamW's decay.
    let resolved = (&summary["args"]["lr"], &summary["args"]["weight_decay"]);
    assert_eq!(resolved, (&2e-3.into(), &0.1.into()), "{text}");
    assert_eq!(summary["args"]["schedule"], "cosine", "{text}");
    let ranks = summary["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2, "{text}");
    // The summary's peak is rank 0's (thread ranks read their process's peak, each when it
    // is done).
    assert_eq!(
        summary["peak_mem_bytes"], ranks[0]["peak_mem_bytes"],
        "{text}"
    );
    for rank in ranks {
        // On the CPU the device's memory is the process's (read after the training peak).
        let peak = rank["peak_mem_bytes"].as_u64().expect("the rank's peak");
        assert!(peak > 0, "{text}");
        assert!(
            rank["device_peak_mem_bytes"].as_u64() >= Some(peak),
            "{text}"
        );
    }
}

/// Ctrl-C (SIGINT) during a run on 2 thread ranks ends it after its step with a checkpoint
/// of that step, a non-zero exit and a message saying where the checkpoint is, no panic, and
/// the optimizer state's scratch files under `--offload-dir` removed.
#[test]
fn ctrl_c_ends_the_run_after_its_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (checkpoints, scratch) = (dir.path().join("ckpt"), dir.path().join("offload"));
    std::fs::create_dir(&scratch).unwrap();
    let child = Command::new(mingpt_char())
        .args(["--devices", "2", "--strategy", "zero2", "--batch-size", "4"])
        .args([
            "--eval-batches",
            "1",
            "--sample-len",
            "0",
            "--checkpoint-every",
            "1",
        ])
        .arg("--checkpoint-dir")
        .arg(&checkpoints)
        .arg("--offload-dir")
        .arg(&scratch)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("mingpt_char runs");
    let started = std::time::Instant::now();
    while !checkpoints.join("step-00000001").exists() {
        assert!(started.elapsed().as_secs() < 300, "no checkpoint of step 1");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let step: usize = stderr
        .split("stopped on request after step ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no stop message in {stderr}"));
    let checkpoint = checkpoints.join(format!("step-{step:08}"));
    assert!(checkpoint.is_dir(), "{stderr}");
    assert!(
        stderr.contains(&checkpoint.display().to_string()),
        "{stderr}"
    );
    assert!(
        std::fs::read_dir(&scratch).unwrap().next().is_none(),
        "the ranks' scratch files are removed"
    );
}

/// `mingpt_char` with `args` under a limit of `kib` KiB on the size of any file it writes
/// (RLIMIT_FSIZE, with SIGXFSZ ignored): a write past it fails with EFBIG ("File too large")
/// as one on a full disk fails, part written; the process goes on to handle the error.
fn mingpt_char_with_file_limit(kib: u64, args: &[&str]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let limit = libc::rlimit {
        rlim_cur: kib * 1024,
        rlim_max: kib * 1024,
    };
    let mut command = Command::new(mingpt_char());
    command.args(args);
    // SAFETY: between fork and exec the closure calls only setrlimit and signal, which are
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0
                || libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.output().expect("mingpt_char runs under the limit")
}

/// A checkpoint whose files cannot be written fails the run naming the file and the error,
/// and leaves no `.partial` directory behind to hold the disk the next save needs.
#[test]
fn a_checkpoint_that_cannot_be_written_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = mingpt_char_with_file_limit(
        64,
        &[
            "--model",
            "gpt-nano",
            "--devices",
            "2",
            "--strategy",
            "zero2",
            "--batch-size",
            "4",
            "--eval-batches",
            "1",
            "--sample-len",
            "0",
            "--max-steps",
            "2",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("rank-00000.safetensors") && stderr.contains("File too large"),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "the failed save left {left:?}: {stderr}");
}

/// A `--metrics-csv` row that cannot be written stops the run after that step's checkpoint
/// (not before it); the resumed run then continues the file from its complete rows, leaving
/// out the row cut short, and every row it holds is whole.
#[test]
fn a_metrics_row_that_cannot_be_written_stops_the_run_after_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, csv) = (dir.path().join("ckpt"), dir.path().join("metrics.csv"));
    // A model of 2,168 parameters: its checkpoint (~21 KiB) fits under the limit, and the
    // metrics file (~77 bytes a row) passes it after ~300 steps.
    let run = [
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "8",
        "--block-size",
        "8",
        "--batch-size",
        "1",
        "--optimizer",
        "sgd",
        "--eval-batches",
        "1",
        "--eval-interval",
        "0",
        "--sample-len",
        "0",
        "--max-steps",
        "500",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--metrics-csv",
        csv.to_str().unwrap(),
    ];
    let out = mingpt_char_with_file_limit(24, &run);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("metrics.csv") && stderr.contains("File too large"),
        "{stderr}"
    );
    let steps = |text: &str| -> Vec<usize> {
        text.lines()
            .skip(1)
            .map(|row| row.split(',').next().unwrap().parse().unwrap())
            .collect()
    };
    let text = std::fs::read_to_string(&csv).unwrap();
    // The failing row is cut short, or (where the rows before it end at the limit) missing.
    let cut = !text.ends_with('\n');
    let whole = match cut {
        true => text.rsplit_once('\n').unwrap().0,
        false => text.as_str(),
    };
    let failed = steps(whole).last().unwrap() + 1;
    assert!(
        ckpt.join(format!("step-{failed:08}")).is_dir(),
        "no checkpoint of step {failed}, whose row failed: {stderr}"
    );

    let out = Command::new(mingpt_char())
        .args(run)
        .arg("--resume")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.contains("cut short"), cut, "{stderr}");
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(
        text.lines().skip(1).all(|row| row.split(',').count() == 9),
        "a row is not whole"
    );
    let expected: Vec<usize> = (1..=500).filter(|&s| s != failed).collect();
    assert_eq!(steps(&text), expected);
}

/// `--devices 2` under mpirun (whose world comes from MPI) is refused before the program's
/// set-up, as the other flags against the launched world are: nothing is built or read first.
#[test]
fn in_process_ranks_under_mpirun_are_refused_before_the_set_up() {
    let out = Command::new(mingpt_char())
        .args(["--devices", "2"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("drop --devices"), "{stderr}");
    assert!(!stdout.contains("parameters"), "set up first: {stdout}");
}
