//! The threads engine: the conformance suite for 1 to 4 ranks, and failures that end in
//! errors naming the rank, never in a hang.

use std::time::{Duration, Instant};

use burn::prelude::*;
use burnscale_collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
use burnscale_collective::{Buffer, CollectiveError, Communicator, DType, ReduceOp, conformance};

#[test]
fn conformance_suite_passes_for_one_to_four_ranks() {
    for world in 1..=4 {
        let results = ThreadComm::run(world, DEFAULT_TIMEOUT, |comm| {
            conformance::run(&comm, &Device::default())
        });
        for (rank, result) in results.into_iter().enumerate() {
            let checks = result.unwrap_or_else(|panic| panic!("rank {rank} panicked: {panic}"));
            assert!(checks.len() >= 29, "the suite ran {} checks", checks.len());
            for (name, outcome) in checks {
                if let Err(e) = outcome {
                    panic!("world {world}, rank {rank}, {name}: {e}");
                }
            }
        }
    }
}

#[test]
fn a_rank_that_panics_fails_the_others_with_its_rank() {
    let start = Instant::now();
    let results = ThreadComm::run(3, DEFAULT_TIMEOUT, |comm| {
        let mut buf = Buffer::from_f32(DType::F32, vec![1.0; 16]);
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        if comm.rank() == 1 {
            panic!("rank 1 hit a bug mid-training");
        }
        comm.all_reduce(&mut buf, ReduceOp::Sum)
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "no waiting for the timeout"
    );
    assert!(
        results[1]
            .as_ref()
            .unwrap_err()
            .contains("rank 1 hit a bug")
    );
    for rank in [0, 2] {
        match results[rank].as_ref().unwrap() {
            Err(CollectiveError::PeerFailed { failed: 1, me, .. }) => assert_eq!(*me, rank),
            other => panic!("rank {rank}: expected PeerFailed naming rank 1, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_never_comes_times_out_the_others() {
    let timeout = Duration::from_secs(1);
    // Ranks 0 and 1 enter the barrier together: on a loaded machine one of them starting late
    // by the timeout would be timed out too, and blamed.
    let together = std::sync::Barrier::new(2);
    let results = ThreadComm::run(3, timeout, |comm| {
        if comm.rank() == 2 {
            // Slow, not stuck: it arrives after the others gave up (long after, as a loaded
            // machine may start their wait late), and fails too; well within STUCK_GRACE,
            // after which it would end the process.
            std::thread::sleep(Duration::from_secs(5));
        } else {
            together.wait();
        }
        comm.barrier()
    });
    for rank in [0, 1] {
        // The first rank to give up reports the timeout and blames rank 2 for the group.
        match results[rank].as_ref().unwrap() {
            Err(CollectiveError::Timeout { missing, .. }) => assert_eq!(missing, &vec![2]),
            Err(CollectiveError::PeerFailed {
                failed: 2, reason, ..
            }) => {
                assert!(reason.contains("did not reach barrier"), "{reason}")
            }
            other => panic!("rank {rank}: expected an error naming rank 2, got {other:?}"),
        }
    }
    let late = results[2].as_ref().unwrap();
    assert!(
        matches!(late, Err(CollectiveError::PeerFailed { .. })),
        "{late:?}"
    );
}

/// A rank stuck outside any collective, which no other thread can stop: the others time out
/// waiting for it, and STUCK_GRACE later the process ends with exit code 75, naming it. Run
/// in a child process (this test binary again), which it ends.
#[test]
fn a_rank_stuck_outside_any_collective_ends_the_process() {
    let test = "a_rank_stuck_outside_any_collective_ends_the_process";
    if in_child() {
        ThreadComm::run(3, Duration::from_millis(500), |comm| {
            while comm.rank() == 1 {
                std::thread::sleep(Duration::from_secs(1));
            }
            comm.barrier()
        });
        return;
    }
    let stderr = ends_with_75(test);
    assert!(
        stderr.contains("rank(s) [1] still running")
            && stderr.contains("rank 1: it did not reach barrier"),
        "{stderr}"
    );
}

/// A rank stuck while another panicked: nobody waits for it, yet the run has failed, so
/// STUCK_GRACE later the process ends, naming both.
#[test]
fn a_rank_stuck_after_another_panicked_ends_the_process() {
    let test = "a_rank_stuck_after_another_panicked_ends_the_process";
    if in_child() {
        // A timeout far longer than the panic takes to be recorded (its hook runs first), so
        // that rank 2 meets the panic, not a timeout; the grace is 10 s either way.
        ThreadComm::run(3, Duration::from_secs(5), |comm| {
            comm.barrier()?;
            match comm.rank() {
                0 => loop {
                    std::thread::sleep(Duration::from_secs(1));
                },
                1 => panic!("rank 1 hit a bug"),
                _ => comm.barrier(),
            }
        });
        return;
    }
    let stderr = ends_with_75(test);
    assert!(
        stderr.contains("rank(s) [0] still running") && stderr.contains("rank 1: it panicked"),
        "{stderr}"
    );
}

const CHILD: &str = "BURNSCALE_STUCK_RANK_CHILD";

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs `test` of this binary as a child process, which must end with exit code 75 within
/// 30 s; returns its stderr.
fn ends_with_75(test: &str) -> String {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .env(CHILD, "1")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("the process still ran after 30 s: it hung on the stuck rank");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    stderr
}

#[test]
fn mismatched_calls_are_named() {
    let results = ThreadComm::run(2, DEFAULT_TIMEOUT, |comm| {
        if comm.rank() == 0 {
            comm.all_gather(&Buffer::from_f32(DType::F32, vec![1.0]))
                .map(|_| ())
        } else {
            comm.all_gather(&Buffer::from_f32(DType::Bf16, vec![1.0]))
                .map(|_| ())
        }
    });
    for result in results {
        let err = result.unwrap().unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("Bf16"), "{err}");
    }
}

/// A timeout past what a deadline can hold (`Duration::MAX`, through the public API that the
/// CLI's cap does not guard) waits as the longest one does, rather than panicking at the
/// first collective.
#[test]
fn the_longest_timeout_does_not_overflow_a_deadline() {
    let results = ThreadComm::run(2, Duration::MAX, |comm| {
        let mut buf = Buffer::from_f32(DType::F32, vec![1.0]);
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        comm.barrier().map(|()| buf.to_f32())
    });
    for result in results {
        assert_eq!(result.unwrap().unwrap(), vec![2.0]);
    }
}

/// Ranks that name different roots for one broadcast are told so, rather than each taking an
/// empty buffer for the root's.
#[test]
fn a_broadcast_from_different_roots_is_named() {
    let results = ThreadComm::run(2, DEFAULT_TIMEOUT, |comm| {
        let mut buf = Buffer::from_f32(DType::F32, vec![1.0; 4]);
        comm.broadcast(&mut buf, 1 - comm.rank())
    });
    for result in results {
        let err = result.unwrap().unwrap_err().to_string();
        assert!(
            err.contains("broadcast from root 1") && err.contains("from root 0"),
            "{err}"
        );
    }
}
