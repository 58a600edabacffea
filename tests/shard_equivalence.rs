//! Every strategy on N in-process ranks takes the steps of the plain Burn loop
//! (`burnscale::reference`) with the same global batch (N = 3 gives uneven shards): the same
//! loss and gradient norm at every step and the same parameters at the end, under SGD
//! (scale-sensitive) and AdamW, with and without gradient accumulation and clipping.
//! `examples/shard_check.rs` runs the same check under mpirun.

use burn::prelude::*;
use burnscale::collective::run_ranks;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::equivalence::{
    ADAM8BIT, ADAMW, KEPT_GATHERED, SGD, check_padded, check_with_dropout,
};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::nn::weights;
use burnscale::tasks::NextToken;
use burnscale::train::{TrainArgs, train};

mod common;
use common::{assert_check_agrees, assert_every_strategy_matches_plain, assert_matches_plain};

fn every_strategy(optimizer: &[&str], extra: &[&str]) {
    assert_every_strategy_matches_plain(&[optimizer, extra].concat(), 1..=4);
}

#[test]
fn every_strategy_takes_the_plain_sgd_steps() {
    every_strategy(SGD, &[]);
}

#[test]
fn every_strategy_takes_the_plain_adamw_steps() {
    every_strategy(ADAMW, &[]);
}

/// `--freeze`: the token table and the top block (which backward still goes through, to the
/// block below), or the embeddings and the bottom block (which run outside autodiff, backward
/// stopping above them), take no step under any strategy, as Burn's autodiff and burn-optim
/// leave them in the plain loop, and the rest its steps: whole units and part of one frozen,
/// on uneven shards, with checkpointed blocks, with zero3's units kept gathered, and with
/// dropout on one rank (whose masks are the plain loop's). With the lowest block that trains
/// frozen up to its first linear, that linear reads an input that needs no gradient (as
/// BERT's query reads its layer's input).
#[test]
fn frozen_parameters_take_no_step_under_every_strategy() {
    let (top, bottom) = (["--freeze", "wte,h.1"], ["--freeze", "wte,wpe,h.0"]);
    let to_first_linear = ["--freeze", "wte,wpe,h.0,h.1.ln_1"];
    for freeze in [top, bottom, to_first_linear] {
        for optimizer in [SGD, ADAMW] {
            every_strategy(optimizer, &freeze);
        }
        let checkpointed = ["--checkpoint-activations"];
        for (strategy, extra) in [
            ("zero2", &checkpointed[..]),
            ("zero3", &checkpointed[..]),
            ("zero3", KEPT_GATHERED),
        ] {
            assert_matches_plain(strategy, 2, &[ADAMW, &freeze, extra].concat());
        }
        for (strategy, extra) in [
            ("zero3", &["--offload", "params"][..]),
            ("ddp", &checkpointed[..]),
        ] {
            let flags = [ADAMW, &freeze, extra].concat();
            let ranks = run_ranks(1, DEFAULT_TIMEOUT, |comm| {
                check_with_dropout(comm, strategy, 0.1, &flags)
            })
            .unwrap();
            let found = ranks.into_iter().next().unwrap().unwrap().unwrap();
            assert!(
                found.agrees(),
                "{strategy} {flags:?} with dropout:\n{}",
                found.differences.join("\n")
            );
        }
    }
}

/// SGD with momentum (the velocity each rank keeps for what it steps) and Adam (decay as an
/// L2 term in the gradient), both burn-optim's in the plain loop, stepped parameter by
/// parameter on the shards in the engine.
#[test]
fn every_strategy_takes_the_plain_momentum_and_adam_steps() {
    let momentum = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"];
    let adam = [
        "--optimizer",
        "adam",
        "--lr",
        "1e-2",
        "--weight-decay",
        "0.1",
    ];
    for flags in [&momentum[..], &adam[..]] {
        assert_every_strategy_matches_plain(&[flags, &["--grad-clip", "0"]].concat(), 1..=3);
    }
}

/// `--adam-epsilon` reaches Adam, AdamW and 8-bit AdamW alike in the engine and the plain
/// loop: at 1e-3 it changes the steps of the elements whose gradients are below it, far
/// beyond f32's tolerance, so either side keeping 1e-8 fails.
#[test]
fn every_adam_takes_the_given_epsilon() {
    let adam = ["--optimizer", "adam", "--lr", "1e-2", "--grad-clip", "0"];
    for optimizer in [&adam[..], ADAMW, ADAM8BIT] {
        let flags = [optimizer, &["--adam-epsilon", "1e-3"]].concat();
        assert_matches_plain("single", 1, &flags);
        assert_matches_plain("zero3", 2, &flags);
    }
}

#[test]
fn accumulation_averages_micro_batches() {
    every_strategy(SGD, &["--accumulate", "2"]);
    every_strategy(ADAMW, &["--accumulate", "2"]);
}

/// Targets ignored unevenly (padding): the step's loss, and so its gradients, is the mean
/// over every token scored on any rank and micro-batch, as the plain loop's over the
/// whole global batch; a mean of the ranks' and micro-batches' means moves SGD's update.
#[test]
fn ignored_targets_average_over_the_global_batch() {
    for flags in [SGD, ADAMW] {
        let flags = [flags, &["--accumulate", "2"]].concat();
        assert_check_agrees(check_padded, "single", 1, &flags);
        for strategy in ["ddp", "zero1", "zero2", "zero3"] {
            for world in [2, 3] {
                assert_check_agrees(check_padded, strategy, world, &flags);
            }
        }
    }
}

#[test]
fn clipping_uses_the_global_norm_across_shards() {
    // A clip far below the tiny model's gradient norm (~1), so every step is clipped.
    every_strategy(SGD, &["--accumulate", "2", "--grad-clip", "0.05"]);
    every_strategy(ADAMW, &["--grad-clip", "0.05"]);
}

/// Gradients reduced in 16 bits (`--grad-reduce-dtype`): each rank's part is rounded before
/// the mean, and the steps are the plain loop's within the 16-bit dtype's tolerance; and the
/// flag acts: reducing in 16 bits ends with other parameters than reducing in f32.
#[test]
fn gradients_reduced_in_16_bits_take_the_plain_steps() {
    for dtype in ["bf16", "f16"] {
        for optimizer in [SGD, ADAMW] {
            for strategy in ["ddp", "zero1", "zero2", "zero3"] {
                for world in [2, 3] {
                    let flags = [optimizer, &["--grad-reduce-dtype", dtype]].concat();
                    assert_matches_plain(strategy, world, &flags);
                }
            }
        }
    }
    let trained = |dtype: &str| {
        let flags = [
            "--strategy",
            "zero2",
            "--devices",
            "2",
            "--batch-size",
            "6",
            "--max-steps",
            "3",
            "--grad-reduce-dtype",
            dtype,
        ];
        let args = TrainArgs::from_flags(&[&flags[..], SGD].concat()).unwrap();
        let config = GptConfig::tiny().with_dropout(0.0);
        let model = common::seeded_model(5, |device| Gpt::new(&config, device).unwrap());
        let tokens = (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect();
        let mut task = NextToken::new(tokens, 8, 6, 5).unwrap();
        let (model, _) = train(model, &mut task, &args, &Device::default().autodiff()).unwrap();
        weights::collect(&model.expect("zero2 keeps the whole model"))
    };
    let f32 = trained("f32");
    assert!(f32 == trained("f32"), "a run repeats itself");
    for dtype in ["bf16", "f16"] {
        assert!(
            f32 != trained(dtype),
            "--grad-reduce-dtype {dtype}: a silent no-op"
        );
    }
}

/// The learning-rate schedule (a linear warm-up, then a cosine to `--min-lr-ratio` at the last
/// step) is transformers', which the plain loop computes from its definition: every strategy
/// takes its steps, offloaded too.
#[test]
fn the_schedule_is_transformers_cosine_with_warmup() {
    let schedule = [
        "--schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--min-lr-ratio",
        "0.1",
    ];
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        assert_matches_plain(strategy, 2, &[SGD, &schedule].concat());
    }
    assert_matches_plain("single", 1, &[ADAMW, &schedule].concat());
    let offloaded = [ADAMW, &schedule, &["--offload", "optimizer"]].concat();
    assert_matches_plain("zero3", 2, &offloaded);
}

#[test]
fn checkpointed_blocks_take_the_plain_steps() {
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        for world in [1, 3] {
            let flags = [SGD, &["--checkpoint-activations"]].concat();
            assert_matches_plain(strategy, world, &flags);
        }
        // Accumulated: each micro-batch's blocks recomputed into the sums.
        let flags = [SGD, &["--checkpoint-activations", "--accumulate", "2"]].concat();
        assert_matches_plain(strategy, 2, &flags);
    }
}

/// Blocks keeping their linears' outputs (`--checkpoint-mode selective`), under AdamW: every
/// strategy on 3 ranks; and frozen parts, a block's MLP (its linears' weights take no gradient
/// through the re-run's op) and everything below the second block's first linear (which reads
/// an input that needs no gradient).
#[test]
fn selectively_checkpointed_blocks_take_the_plain_steps() {
    let selective = ["--checkpoint-activations", "--checkpoint-mode", "selective"];
    for strategy in ["ddp", "zero1", "zero2", "zero3"] {
        assert_matches_plain(strategy, 3, &[ADAMW, &selective].concat());
    }
    for freeze in ["h.1.mlp", "wte,wpe,h.0,h.1.ln_1"] {
        for strategy in ["ddp", "zero3"] {
            let flags = [ADAMW, &selective, &["--freeze", freeze]].concat();
            assert_matches_plain(strategy, 2, &flags);
        }
    }
}

/// ZeRO-3 keeping each unit gathered from its forward to its backward; with checkpointing it
/// recomputes from the parameters it kept, without gathering them again. (A rank alone in
/// f32 gathers nothing, and is refused the flag.)
#[test]
fn zero3_kept_gathered_takes_the_plain_steps() {
    for optimizer in [SGD, ADAMW] {
        for world in 2..=4 {
            assert_matches_plain("zero3", world, &[optimizer, KEPT_GATHERED].concat());
        }
    }
    let clipped = ["--accumulate", "2", "--grad-clip", "0.05"];
    assert_matches_plain("zero3", 2, &[SGD, KEPT_GATHERED, &clipped].concat());
    let checkpointed = ["--checkpoint-activations"];
    assert_matches_plain("zero3", 3, &[ADAMW, KEPT_GATHERED, &checkpointed].concat());
}

#[test]
fn blockwise_steps_drop_what_a_plain_step_drops() {
    // --checkpoint-activations runs blocks forward outside autodiff and recomputes them in
    // backward; ZeRO-3, and accumulation's later micro-batches, run each block on a graph of
    // its own (resharded, its linears regathered): all must apply the masks of a plain step
    // (one rank, whose dropout stream is the plain loop's; alone, ZeRO-3 reshards only what
    // it copied to compute with, here its shards offloaded to the host).
    for optimizer in [SGD, ADAMW] {
        for (strategy, extra) in [
            ("zero3", &["--offload", "params"][..]),
            (
                "zero3",
                &["--offload", "params", "--checkpoint-activations"][..],
            ),
            ("zero3", &[][..]),
            // Kept gathered from forward to backward (offloaded, so that there is a copy).
            (
                "zero3",
                &["--offload", "params", "--reshard-after-forward", "false"][..],
            ),
            ("ddp", &["--checkpoint-activations"][..]),
            ("single", &[][..]),
            ("single", &["--accumulate", "2"][..]),
            ("zero1", &["--accumulate", "2"][..]),
        ] {
            let flags = [optimizer, extra].concat();
            let ranks = run_ranks(1, DEFAULT_TIMEOUT, |comm| {
                check_with_dropout(comm, strategy, 0.1, &flags)
            })
            .unwrap();
            let found = ranks.into_iter().next().unwrap().unwrap().unwrap();
            eprintln!(
                "{strategy} {flags:?} with dropout: used {:.1e} of the tolerance",
                found.worst
            );
            assert!(
                found.agrees(),
                "{strategy} {flags:?}:\n{}",
                found.differences.join("\n")
            );
        }
    }
}
