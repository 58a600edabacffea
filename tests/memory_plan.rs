//! The memory planner predicts, before the first step, the process peak the counting
//! allocator then measures: within 5% under every precision, optimizer and technique, and
//! the optimizer state to the byte (one rank; the sharded strategies are checked under
//! mpirun by `examples/plan_check.rs`, one process per rank). A test binary of its own, as
//! the peak is process-wide (and one test, running the configurations in turn).

mod common;

use burnscale::collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
use burnscale::plan_check::{ONE_RANK, TOLERANCE, run, setup};
use burnscale::shard::Checkpointing;
use burnscale::train::auto::resolve;
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::plan::{Probe, off};
use burnscale::train::{RunSummary, TrainError, train_on};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The per-rank peak planned for `flags` (resolved as a run would be).
fn planned(flags: &[&str]) -> usize {
    let (model, task, args, device) = setup(flags).unwrap();
    let resolved = resolve(&model, &task, &args, &device).unwrap();
    let probe = resolved.probe.expect("--plan measures the probe");
    burnscale::train::plan::MemoryPlan::new(&model, &resolved.args, 1, 1, probe)
        .unwrap()
        .rank_share()
}

#[test]
fn auto_runs_the_fastest_configuration_planned_within_the_budget() {
    common::in_turn(|| {
        let plain = planned(&[]);
        let checkpointed = planned(&["--checkpoint-activations"]);
        assert!(checkpointed < plain, "{checkpointed} {plain}");
        let auto = |budget: usize| {
            let budget = budget.to_string();
            run(&["--strategy", "auto", "--memory-budget", &budget])
        };

        // Room for the plain run: it is the fastest, so it runs. (Each run's probe reads what
        // else is live then, so budgets keep clear of the plans' edges.)
        let roomy = auto(plain + plain / 20).unwrap();
        let choice = roomy.auto.as_ref().expect("auto reports its choice");
        assert_eq!(choice.chosen.flags, "--strategy single --precision 32-true");
        assert!(choice.over_budget.is_empty());

        let depth = 4;
        // Less: checkpointing, the next fastest, of the fewest of the lowest blocks that fit
        // (bisected), and the plain run and fewer checkpointed blocks named as over it. (The top
        // block's alone saves nothing at the peak: backward recomputes it first, its activations
        // beside all the others'.)
        let budget = (plain + checkpointed) / 2;
        let tight = auto(budget).unwrap();
        let choice = tight.auto.as_ref().unwrap();
        // The summary's flags are the choice's, which train it again without planning.
        let Some(n) = tight.args.checkpoint_blocks else {
            panic!("{}", choice.explain());
        };
        assert!((1..depth).contains(&n), "{}", choice.explain());
        assert_eq!(
            choice.chosen.flags,
            format!("--strategy single --precision 32-true --checkpoint-blocks {n}")
        );
        assert!(choice.chosen.planned_bytes <= budget);
        assert!(choice.over_budget.iter().all(|c| c.planned_bytes > budget));
        // The plans named are those configurations' (each probe's baseline moves by a few MiB
        // with what earlier runs left; the plans differ by far more).
        assert!(off(choice.over_budget[0].planned_bytes, plain).abs() < 0.05);
        let measured = tight.peak_mem_bytes.unwrap();
        assert!(
            off(budget, measured) > -TOLERANCE,
            "the chosen run took {} against a budget of {}",
            human_bytes(measured),
            human_bytes(budget)
        );

        // Nothing fits: every candidate's plan is named, and no step runs.
        let err = auto(1 << 20).unwrap_err().to_string();
        assert!(
            err.contains("less than planned") && err.contains("--checkpoint-activations"),
            "{err}"
        );
        assert!(err.contains("bf16-true"), "{err}");
        // A strategy given is held to the budget too.
        let budget = (checkpointed / 2).to_string();
        let err = run(&["--checkpoint-activations", "--memory-budget", &budget])
            .unwrap_err()
            .to_string();
        assert!(err.contains("try --strategy auto"), "{err}");
        assert!(
            matches!(
                resolve_error(&["--memory-budget", &budget]),
                Some(TrainError::OverBudget { .. })
            ),
            "a plan over the budget is its own error"
        );
    })
}

/// A run resumed under `auto` continues in its checkpoint's precision, the one `--resume`
/// accepts, whatever its own `--precision` (auto's first candidate otherwise), and says so.
#[test]
fn auto_resumes_in_the_checkpoints_precision() {
    common::in_turn(|| {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().to_str().unwrap();
        let saving = ["--checkpoint-dir", dir, "--checkpoint-every", "1"];
        // 16-mixed: none of auto's candidates for a run given 32-true.
        run(&[
            &saving[..],
            &["--precision", "16-mixed", "--max-steps", "1"],
        ]
        .concat())
        .unwrap();

        let resumed = run(&[
            &saving[..],
            &["--resume", "--strategy", "auto", "--memory-budget", "64GiB"],
        ]
        .concat())
        .unwrap();
        assert_eq!(resumed.checkpoints.as_ref().unwrap().resumed_from, Some(1));
        let choice = resumed.auto.as_ref().unwrap();
        assert_eq!(
            choice.chosen.flags,
            "--strategy single --precision 16-mixed"
        );
        assert_eq!(
            choice.unused,
            ["--precision 32-true (the checkpoint --resume continues is 16-mixed)"]
        );
    })
}

/// Each candidate `auto` weighs is planned from a probe of its own kind: a step with the
/// optimizer state on disk reads the state in and writes it back, which the probe of the
/// in-memory candidates before it does not.
#[test]
fn auto_plans_the_optimizer_state_on_disk_from_its_own_probe() {
    common::in_turn(|| {
        let dir = tempfile::tempdir().unwrap();
        let disk = ["--offload-dir", dir.path().to_str().unwrap()];
        let in_memory = planned(&["--checkpoint-activations"]);
        let on_disk = planned(&[&disk[..], &["--checkpoint-activations"]].concat());
        assert!(on_disk < in_memory, "{on_disk} {in_memory}");

        let budget = ((in_memory + on_disk) / 2).to_string();
        let auto = ["--strategy", "auto", "--memory-budget", &budget];
        let (model, task, args, device) = setup(&[&disk[..], &auto[..]].concat()).unwrap();
        let resolved = resolve(&model, &task, &args, &device).unwrap();
        assert!(resolved.args.offload_dir.is_some());
        assert_ne!(resolved.args.checkpointing(), Checkpointing::None);
        let own = Probe::measure(&model, &task, &resolved.args, &device).unwrap();
        let step = resolved.probe.unwrap().step;
        assert!(off(step, own.step).abs() < 0.01, "{step} {}", own.step);
    })
}

/// A thread's first matmul leaves buffers the backend keeps for good (gemm's packing
/// buffers, the thread's own); the probe counts them once, outside the model, not as what
/// the first block it measures keeps (which the plan multiplies by the depth).
#[test]
fn the_probe_counts_what_a_block_keeps_not_what_the_backend_keeps_for_good() {
    common::in_turn(|| {
        let (first, second) = std::thread::spawn(|| {
            let (model, task, args, device) = setup(&[]).unwrap();
            let probe = || Probe::measure(&model, &task, &args, &device).unwrap();
            (probe(), probe())
        })
        .join()
        .unwrap();
        for (what, first, second) in [
            ("embeddings", first.embed, second.embed),
            ("block", first.block, second.block),
            ("head", first.head, second.head),
        ] {
            assert!(
                off(first, second).abs() < 0.01,
                "{what}: {} on the thread's first probe, {} on its second",
                human_bytes(first),
                human_bytes(second)
            );
        }
    })
}

fn resolve_error(flags: &[&str]) -> Option<TrainError> {
    let (model, task, args, device) = setup(flags).unwrap();
    resolve(&model, &task, &args, &device).err()
}

/// How far the process peak planned for the run of `flags` is from the one measured, and a
/// line that says so (printed).
fn planned_against_measured(flags: &[&str], summary: &RunSummary) -> (f64, String) {
    let plan = summary.plan.as_ref().expect("--plan makes a plan");
    let measured = summary.peak_mem_bytes.unwrap();
    let off = off(plan.process_peak, measured);
    let line = format!(
        "[{}] measured {} planned {} ({:+.1}%, peak in {:?})",
        flags.join(" "),
        human_bytes(measured),
        human_bytes(plan.process_peak),
        100.0 * off,
        plan.peak_phase
    );
    eprintln!("{line}");
    (off, line)
}

/// `train_on` is handed its ranks, after the point where `train`'s probe runs: it refuses to
/// plan host memory rather than run unplanned (its `--plan` printed nothing, its budget bound
/// nothing).
#[test]
fn train_on_refuses_a_host_memory_plan() {
    // Its set-up allocates beside the other tests' readings.
    common::in_turn(|| {
        let (model, mut task, args, device) = setup(&[]).unwrap();
        assert!(args.plan);
        let comm = ThreadComm::group(1, DEFAULT_TIMEOUT).remove(0);
        let err = train_on(&comm, model, &mut task, &args, &device).expect_err("refused");
        assert!(err.to_string().contains("call train"), "{err}");
    })
}

#[test]
fn the_planned_peak_is_within_five_percent_of_the_measured_one() {
    common::in_turn(|| {
        let mut worst = (0.0f64, String::new());
        let mut failures = Vec::new();
        for flags in ONE_RANK {
            let summary = run(flags).unwrap();
            let plan = summary.plan.as_ref().expect("--plan makes a plan");
            let (off, line) = planned_against_measured(flags, &summary);
            if off.abs() > worst.0 {
                worst = (off.abs(), line.clone());
            }
            if off.abs() > TOLERANCE {
                failures.push(line);
            }
            if plan.optimizer != summary.model_state.optimizer {
                failures.push(format!(
                    "[{}] optimizer state planned {} B, held {} B",
                    flags.join(" "),
                    plan.optimizer,
                    summary.model_state.optimizer
                ));
            }
            assert_eq!(summary.planned_peak_mem_bytes, Some(plan.process_peak));
            assert_eq!(
                summary.ranks[0].planned_peak_mem_bytes,
                Some(plan.process_peak)
            );
        }
        eprintln!("worst: {:.1}% {}", 100.0 * worst.0, worst.1);
        assert!(
            failures.is_empty(),
            "off by more than {:.0}%:\n{}",
            100.0 * TOLERANCE,
            failures.join("\n")
        );
    })
}

/// Runs of a thread-rank configuration, at most, until one measures its ranks' peaks at once:
/// usually the first or second, but CI on 2026-11-29 missed five in a row (ZeRO-3 with
/// checkpointing 5.1% to 7.7% below the plan), and beside a busy loop runs here needed 1 to
/// 10: as many as it takes within a minute.
const THREAD_RUNS: usize = 30;

/// Ranks that are threads share this process, and hold their collective buffers at once: the
/// plan sums them. With a 32768-token table (and head), each its own bucket of 8.4M
/// elements, at batch 1, the gradient reduction sets the peak, where the thread engine's
/// all-reduce runs in place and its reduce-scatter posts the packed bucket as it is (a plan
/// that counted a receive buffer of a bucket for them read +9.4% and +5.7%).
///
/// ZeRO-3 with checkpointing, at batch 8, peaks in backward through a block, on temporaries
/// both ranks hold at once: its gathers keep them in step (a plan that counted one rank's
/// temporaries at a time read -14.5% and -15.1%).
///
/// The plan is the process peak when both ranks reach their own peak at once, which they
/// need not: the OS schedules the threads, and a rank a moment behind the other misses the
/// other's spike (zero2 measured 496 to 524 MiB run to run against 524 planned). So no run
/// may measure more than the tolerance above the plan, and the highest of up to
/// [`THREAD_RUNS`] runs must come within it below.
#[test]
fn the_planned_peak_of_two_thread_ranks_is_within_five_percent() {
    common::in_turn(|| {
        let mut failures = Vec::new();
        let reduction = |strategy| {
            [
                "--vocab",
                "32768",
                "--batch-size",
                "1",
                "--strategy",
                strategy,
            ]
        };
        let configs: [&[&str]; 3] = [
            &reduction("ddp"),
            &reduction("zero2"),
            &["--strategy", "zero3", "--checkpoint-activations"],
        ];
        for config in configs {
            let flags = [config, &["--devices", "2"]].concat();
            // The run that measured the most: the least planned above it.
            let mut highest: Option<(f64, String)> = None;
            for _ in 0..THREAD_RUNS {
                let summary = run(&flags).unwrap();
                let plan = summary.plan.as_ref().expect("--plan makes a plan");
                assert_eq!(plan.ranks_in_process, 2);
                let (off, line) = planned_against_measured(&flags, &summary);
                if highest.as_ref().is_none_or(|(least, _)| off < *least) {
                    highest = Some((off, line));
                }
                if off <= TOLERANCE {
                    break;
                }
            }
            if let Some((_, line)) = highest.filter(|(off, _)| off.abs() > TOLERANCE) {
                failures.push(line);
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    })
}
