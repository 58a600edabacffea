//! Every strategy on N in-process ranks takes the same optimizer steps as `--strategy single`
//! with the same global batch (N = 3 gives uneven shards), with and without gradient
//! accumulation and clipping. `examples/shard_check.rs` runs the same check under mpirun.

use burnscale::collective::run_ranks;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::equivalence::{check, check_with_dropout};

fn check_all_strategies(extra: &[&str]) {
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for world in 1..=4 {
            let ranks =
                run_ranks(world, DEFAULT_TIMEOUT, |comm| check(comm, strategy, extra)).unwrap();
            for (rank, outcome) in ranks.into_iter().enumerate() {
                let differences = outcome.unwrap().unwrap();
                assert!(
                    differences.is_empty(),
                    "{strategy} x{world} {extra:?} rank {rank}:\n{}",
                    differences.join("\n")
                );
            }
        }
    }
}

#[test]
fn every_strategy_matches_single() {
    check_all_strategies(&["--grad-clip", "0"]);
}

#[test]
fn every_strategy_matches_single_with_accumulation_and_clipping() {
    // A clip far below the tiny model's gradient norm (~1), so every step is clipped.
    check_all_strategies(&["--accumulate", "2", "--grad-clip", "0.05"]);
}

#[test]
fn zero3_recomputation_drops_what_its_forward_dropped() {
    // ZeRO-3 runs blocks forward outside autodiff and recomputes them in backward: both must
    // apply the same dropout masks as a plain single-device step.
    for strategy in ["zero3", "ddp"] {
        let ranks = run_ranks(1, DEFAULT_TIMEOUT, |comm| {
            check_with_dropout(comm, strategy, 0.1, &["--grad-clip", "0"])
        })
        .unwrap();
        let differences = ranks.into_iter().next().unwrap().unwrap().unwrap();
        assert!(
            differences.is_empty(),
            "{strategy}:\n{}",
            differences.join("\n")
        );
    }
}
