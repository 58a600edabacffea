//! On cubecl's devices `--plan` is a dry run of the steps (crates/train/src/device_plan.rs):
//! its plan is the pools' reservation the run then reaches, and the run after it trains as
//! one without it does. Built with `--features cubecl-cpu` (cubecl's CPU runtime: burn-fusion
//! and cubecl's pools, as on a GPU); `cargo test --release --features cubecl-cpu --test
//! device_plan`.
#![cfg(feature = "cubecl-cpu")]

use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::plan::off;
use burnscale::train::{RunSummary, TrainArgs, train};

/// How far a plan may be from the device peak measured.
const TOLERANCE: f64 = 0.10;

/// Three steps of a 2-block minGPT of width 64 on cubecl's CPU runtime, with dropout.
fn run(flags: &[&str]) -> RunSummary {
    let base = [
        "--accelerator",
        "cubecl-cpu",
        "--batch-size",
        "4",
        "--max-steps",
        "3",
        "--seed",
        "7",
    ];
    let args = TrainArgs::from_flags(&[&base[..], flags].concat()).unwrap();
    let device = args.device().unwrap();
    device.seed(7);
    let config = GptConfig::new(2, 2, 64, 65, 32).with_dropout(0.1);
    let model = Gpt::new(&config, &device).unwrap();
    let tokens: Vec<i64> = (0..4000).map(|i| (i * 7 % 65) as i64).collect();
    let mut task = NextToken::new(tokens, 32, args.batch_size, 7).unwrap();
    train(model, &mut task, &args, &device).unwrap().1
}

fn losses(summary: &RunSummary) -> Vec<f64> {
    summary.history.iter().map(|step| step.loss).collect()
}

/// One test: the device's pools are the whole process's, so runs are read one at a time.
#[test]
fn the_dry_run_plans_the_device_peak_and_leaves_training_as_it_was() {
    for flags in [
        &[][..],
        &["--precision", "bf16-true", "--checkpoint-activations"],
        &["--strategy", "zero3", "--devices", "2"],
    ] {
        let planned = run(&[flags, &["--plan"]].concat());
        let plain = run(flags);
        // A constant cached during the dry run (a dropout range, position ids) was never
        // written: kept, it would change the losses.
        assert_eq!(losses(&planned), losses(&plain), "{flags:?}");
        for rank in &planned.ranks {
            let plan = rank.planned_device_peak_mem_bytes.expect("--plan plans");
            let measured = rank.device_peak_mem_bytes.expect("cubecl's pools are read");
            assert!(
                off(plan, measured).abs() <= TOLERANCE,
                "{flags:?}, rank {}: planned {plan} against {measured} measured",
                rank.rank
            );
        }
        assert!(plain.ranks[0].planned_device_peak_mem_bytes.is_none());
    }
}
