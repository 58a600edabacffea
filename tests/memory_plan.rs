//! The memory planner predicts, before the first step, the process peak the counting
//! allocator then measures: within 10% under every precision, optimizer and technique, and
//! the optimizer state to the byte (one rank; the sharded strategies are checked under
//! mpirun by `examples/plan_check.rs`, one process per rank). A test binary of its own, as
//! the peak is process-wide (and one test, running the configurations in turn).

use burnscale::plan_check::{ONE_RANK, TOLERANCE, run};
use burnscale::train::memory::{CountingAllocator, human_bytes};
use burnscale::train::plan::off;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn the_planned_peak_is_within_ten_percent_of_the_measured_one() {
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for flags in ONE_RANK {
        let summary = run(flags).unwrap();
        let plan = summary.plan.as_ref().expect("--plan makes a plan");
        let measured = summary.peak_mem_bytes;
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
}
