//! The engine driven by a program of its own (not through `train`): a model as built, on
//! one rank as on several, and misuse of its API an error, not a step that trains otherwise
//! than asked.

use burn::module::{ModuleMapper, Param};
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::collective::{Communicator, run_ranks};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::shard::{ShardError, Sharded, Share, Strategy};
use burnscale::tasks::NextToken;
use burnscale::train::{BatchPart, TrainTask};

mod common;

/// A tiny minGPT, seeded.
fn model() -> Gpt {
    common::seeded_model(5, |device| {
        Gpt::new(&GptConfig::tiny().with_dropout(0.0), device).unwrap()
    })
}

/// One micro-step of `engine` (rank `comm.rank()`'s part of a batch of `task`).
fn micro_step(
    engine: &mut Sharded<'_, Gpt>,
    task: &mut NextToken,
    comm: &dyn Communicator,
    last: bool,
) -> Result<(), ShardError> {
    let part = BatchPart {
        rank: comm.rank(),
        world: comm.world_size(),
    };
    let device = Device::default().autodiff();
    let (input, target) = task.next_batch(&device, part);
    engine.micro_step(input, target, &Share::Even(2), last)
}

fn task() -> NextToken {
    NextToken::new((0..400).map(|i| i % 11).collect(), 8, 4, 5).unwrap()
}

/// A parameter mapped after it was initialised (scaled, cast, moved: tracked through its
/// map, not a leaf) trains as a leaf of its own under a replica alone as with others: alone,
/// the model was kept as given, and backward dropped the mapped parameters' gradients.
#[test]
fn a_lone_replica_trains_its_mapped_parameters() {
    struct Scale;
    impl ModuleMapper for Scale {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|value| value * 1.0)
        }
    }
    let device = Device::default().autodiff();
    for world in [1, 2] {
        let changed = run_ranks(world, DEFAULT_TIMEOUT, |comm| {
            let mapped = model().map(&mut Scale);
            let mut engine = Sharded::new(Strategy::Ddp, mapped, comm, &device).unwrap();
            let before = burnscale::shard::host::values(&engine.full_model().unwrap());
            micro_step(&mut engine, &mut task(), comm, true).unwrap();
            let mut optim = SgdConfig::new().init();
            engine
                .step(0.0, |model, grads| {
                    let grads: GradientsParams = grads.into_gradients(&model);
                    optim.step(0.1, model, grads)
                })
                .unwrap();
            let after = burnscale::shard::host::values(&engine.full_model().unwrap());
            (
                before.len(),
                before.iter().filter(|(id, v)| after[id] != **v).count(),
            )
        })
        .unwrap();
        for outcome in changed {
            let (params, changed) = outcome.unwrap();
            // All but the attention key bias's exact zeros, which SGD leaves as they are.
            assert!(
                changed + 2 >= params,
                "x{world}: {changed} of {params} changed"
            );
        }
    }
}

/// A step after micro-steps none of which passed `last` (whole gradients, DDP and ZeRO-1,
/// are reduced on it) would step nothing and carry the gradients into the next step, twice
/// over: it is refused, and the step taken once the last micro-step is given measures the
/// gradients of both.
#[test]
fn a_step_before_the_last_micro_step_is_an_error() {
    let device = Device::default().autodiff();
    for strategy in [Strategy::Ddp, Strategy::Zero1] {
        for world in [1, 2] {
            let outcomes = run_ranks(world, DEFAULT_TIMEOUT, |comm| {
                let mut engine = Sharded::new(strategy, model(), comm, &device).unwrap();
                let mut task = task();
                // The norm is the engine's, whatever the optimizer does with the gradients.
                let keep = |model: Gpt, _| model;
                micro_step(&mut engine, &mut task, comm, false).unwrap();
                let early = engine.step(0.0, keep);
                micro_step(&mut engine, &mut task, comm, true).unwrap();
                let stepped = engine.step(0.0, keep).unwrap();
                (early.err(), stepped.grad_norm)
            })
            .unwrap();
            for outcome in outcomes {
                let (early, norm) = outcome.unwrap();
                assert!(
                    matches!(early, Some(ShardError::UnreducedGradients)),
                    "{strategy:?} x{world}: {early:?}"
                );
                assert!(norm > 0.0, "{strategy:?} x{world}: norm {norm}");
            }
        }
    }
}
