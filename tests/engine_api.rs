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

/// The values of `model`'s parameters, in visit order (ids differ between builds).
fn in_order(model: &Gpt) -> Vec<Vec<f32>> {
    let values = burnscale::shard::host::values(model);
    burnscale::shard::params::param_ids(model)
        .iter()
        .map(|id| values[id].clone())
        .collect()
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
            // Two micro-steps and a step, with the refused step between them or not.
            let norms = |refused: bool| {
                run_ranks(world, DEFAULT_TIMEOUT, |comm| {
                    let mut engine = Sharded::new(strategy, model(), comm, &device).unwrap();
                    let mut task = task();
                    // The norm is the engine's, whatever the optimizer does with the gradients.
                    let keep = |model: Gpt, _| model;
                    micro_step(&mut engine, &mut task, comm, false).unwrap();
                    let early = refused.then(|| engine.step(0.0, keep));
                    micro_step(&mut engine, &mut task, comm, true).unwrap();
                    let stepped = engine.step(0.0, keep).unwrap();
                    (early.map(Result::err), stepped.grad_norm)
                })
                .unwrap()
                .into_iter()
                .map(Result::unwrap)
            };
            let clean: Vec<f64> = norms(false).map(|(_, norm)| norm).collect();
            for ((early, norm), want) in norms(true).zip(clean) {
                assert!(
                    matches!(early, Some(Some(ShardError::UnreducedGradients))),
                    "{strategy:?} x{world}: {early:?}"
                );
                // Both micro-steps' gradients, neither lost nor counted twice by the refusal.
                assert_eq!(norm, want, "{strategy:?} x{world}");
                assert!(norm > 0.0, "{strategy:?} x{world}: norm {norm}");
            }
        }
    }
}

/// Values that do not fit what a rank holds (a value cut short, or one for a parameter the
/// model lacks) are refused naming it, before any is set: a panic was the answer before.
#[test]
fn held_values_the_engine_cannot_hold_are_refused_with_nothing_replaced() {
    use burn::module::ParamId;
    let device = Device::default().autodiff();
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let outcomes = run_ranks(2, DEFAULT_TIMEOUT, |comm| {
            let mut engine = Sharded::new(strategy, model(), comm, &device).unwrap();
            let held = engine.held_parameters();
            let data = |flat: &burnscale::shard::params::Flat| {
                let mut values: Vec<_> = flat
                    .iter()
                    .map(|(id, v)| {
                        (
                            id.to_string(),
                            v.to_data().iter::<f32>().collect::<Vec<_>>(),
                        )
                    })
                    .collect();
                values.sort_by(|a, b| a.0.cmp(&b.0));
                values
            };
            let before = data(&held);
            let (&cut_id, cut) = held.iter().max_by_key(|(_, v)| v.dims()[0]).unwrap();
            let short = cut.clone().slice(0..cut.dims()[0] - 1);
            let mut errors = Vec::new();
            for (id, value) in [(cut_id, short), (ParamId::new(), cut.clone())] {
                // The others given back whole: only the bad one may be refused.
                let mut values = held.clone();
                values.insert(id, value);
                errors.push(engine.set_held_parameters(values).unwrap_err().to_string());
            }
            (errors, before == data(&engine.held_parameters()))
        })
        .unwrap();
        for outcome in outcomes {
            let (errors, kept) = outcome.unwrap();
            assert!(
                errors[0].contains("values, this rank holds"),
                "{strategy:?}: {}",
                errors[0]
            );
            assert!(
                errors[1].contains("is not one of the model's"),
                "{strategy:?}: {}",
                errors[1]
            );
            assert!(
                kept,
                "{strategy:?}: a refused call changed the held parameters"
            );
        }
    }
}

/// A step of no micro-batches has no share to give one: refused, not a NaN loss.
#[test]
fn a_share_of_no_micro_batches_is_refused() {
    let device = Device::default().autodiff();
    let outcomes = run_ranks(1, DEFAULT_TIMEOUT, |comm| {
        let mut engine = Sharded::new(Strategy::Ddp, model(), comm, &device).unwrap();
        let (input, target) = task().next_batch(&device, BatchPart { rank: 0, world: 1 });
        engine.micro_step(input, target, &Share::Even(0), true)
    })
    .unwrap();
    let refused = outcomes.into_iter().next().unwrap().unwrap().unwrap_err();
    assert!(matches!(refused, ShardError::NoMicroBatches), "{refused}");
}

/// A parameter of no elements (`[0, d]`) is refused by every rank and strategy, naming it:
/// splitting it by rows panicked.
#[test]
fn an_empty_parameter_is_refused_naming_it() {
    struct EmptyFirst(bool);
    impl ModuleMapper for EmptyFirst {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match std::mem::replace(&mut self.0, true) {
                true => param,
                false => {
                    let mut dims = param.val().dims();
                    dims[0] = 0;
                    param.map(|value| Tensor::zeros(dims, &value.device()))
                }
            }
        }
    }
    let device = Device::default().autodiff();
    for (strategy, world) in [
        (Strategy::Zero1, 1),
        (Strategy::Ddp, 2),
        (Strategy::Zero3, 2),
    ] {
        let outcomes = run_ranks(world, DEFAULT_TIMEOUT, |comm| {
            let model = model().map(&mut EmptyFirst(false));
            Sharded::new(strategy, model, comm, &device)
                .err()
                .map(|e| e.to_string())
        })
        .unwrap();
        for outcome in outcomes {
            let err = outcome.unwrap().unwrap_or_default();
            assert!(
                err.contains("has no elements (shape [0, ")
                    && err.contains("cannot hold an empty one"),
                "{strategy:?} on {world}: {err}"
            );
        }
    }
}

/// Ranks whose models differ all stop, naming the ranks: rank 0 too, which sends its values
/// and, told nothing, waited for the others in the next collective.
#[test]
fn ranks_whose_models_differ_all_stop_naming_them() {
    // Unseeded builds, drawn on the rank threads.
    let _generator = common::hold_generator();
    let device = Device::default().autodiff();
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let outcomes = run_ranks(3, DEFAULT_TIMEOUT, |comm| {
            let config = GptConfig::tiny().with_dropout(0.0);
            let config = match comm.rank() {
                2 => GptConfig {
                    n_embd: 2 * config.n_embd,
                    ..config
                },
                _ => config,
            };
            let model = Gpt::new(&config, &device).unwrap();
            Sharded::new(strategy, model, comm, &device)
                .err()
                .map(|e| e.to_string())
        })
        .unwrap();
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let err = outcome.unwrap().unwrap_or_default();
            assert!(
                err.contains(&format!("rank {rank}: the ranks' models differ: the models of ranks [2] are not rank 0's")),
                "{strategy:?} rank {rank}: {err}"
            );
        }
    }
}

/// Under zero3 a model built lazily in bf16 (`init_in`) is sharded from rank 0's values
/// alike on every rank, whose own copies are never drawn: each rank's shards are f32 (as the
/// values travel, until `.precision()` casts them), whether each rank built its own or the
/// ranks share clones of one, and a step with Burn's SGD gathers and trains. A rank whose
/// parameters were initialised kept their dtype before, and the first gather stopped on the
/// dtypes differing.
#[test]
fn a_lazy_bf16_model_shards_alike_on_every_rank() {
    use burn::tensor::{DType, FloatDType};
    use burnscale::precision::{init_in, param_dtypes};
    // Rank 0 draws its lazy parameters when the engine first reads them.
    let _generator = common::hold_generator();
    let device = Device::default().autodiff();
    let lazy = || {
        let model = Gpt::new(&GptConfig::tiny().with_dropout(0.0), &device).unwrap();
        init_in(model, FloatDType::BF16)
    };
    // Each rank's own model (as processes have), then clones of one (as thread ranks share
    // it in the runner): a clone's parameters are initialised once rank 0 reads them.
    let shared = lazy();
    let models = std::sync::Mutex::new(vec![shared.clone(), shared, lazy(), lazy()]);
    for _ in 0..2 {
        let outcomes = run_ranks(2, DEFAULT_TIMEOUT, |comm| {
            let model = models.lock().unwrap().pop().unwrap();
            let mut engine = Sharded::new(Strategy::Zero3, model, comm, &device)?;
            micro_step(&mut engine, &mut task(), comm, true)?;
            let mut optim = SgdConfig::new().init();
            engine.step(0.0, |model, grads| {
                let grads: GradientsParams = grads.into_gradients(&model);
                optim.step(0.1, model, grads)
            })?;
            Ok::<_, ShardError>(param_dtypes(&engine.full_model()?))
        })
        .unwrap();
        for outcome in outcomes {
            assert_eq!(outcome.unwrap().unwrap(), vec![DType::F32]);
        }
    }
}

/// Burn's own optimizers (AdamW here, through `StepGrads::into_gradients`) step every
/// strategy's part of the model, and ZeRO-1/2/3's steps equal DDP's: the shards they are
/// handed are leaves on autodiff, as Burn's optimizers require (a plain shard panicked in
/// Burn's `is_distributed`).
#[test]
fn burns_optimizers_step_every_strategy_alike() {
    use burn::optim::AdamWConfig;
    let device = Device::default().autodiff();
    let stepped = |strategy| {
        run_ranks(2, DEFAULT_TIMEOUT, |comm| {
            let mut engine = Sharded::new(strategy, model(), comm, &device).unwrap();
            let mut optim = AdamWConfig::new().init();
            for _ in 0..2 {
                micro_step(&mut engine, &mut task(), comm, true).unwrap();
                engine
                    .step(1.0, |model, grads| {
                        let grads: GradientsParams = grads.into_gradients(&model);
                        optim.step(1e-2, model, grads)
                    })
                    .unwrap();
            }
            in_order(&engine.full_model().unwrap())
        })
        .unwrap()
        .remove(0)
        .unwrap()
    };
    let ddp = stepped(Strategy::Ddp);
    assert!(ddp != in_order(&model()), "DDP's step changed nothing");
    for strategy in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let sharded = stepped(strategy);
        assert_eq!(sharded.len(), ddp.len(), "{strategy:?}: parameters missing");
        for (i, (want, got)) in ddp.iter().zip(&sharded).enumerate() {
            // The same f32 sums and updates, in another grouping of the reductions.
            let worst = common::worst_abs_diff(want, got);
            assert!(
                worst <= 1e-6,
                "{strategy:?}: parameter {i} differs from DDP by {worst}"
            );
        }
    }
}
