//! The model given to [`crate::train`], made ready for the ranks' engines: initialised (a
//! lazily built model draws its values once, in visit order, as a single device would; in
//! the precision's dtype with `--init-on-device`) and copied to each rank's device. The engine
//! starts every rank from rank 0's values: broadcast, or under zero3 sharded from rank 0,
//! which initialises a lazy model one parameter at a time so that no rank holds it whole.
//!
//! Where the ranks' dry runs settle `--strategy auto` on their devices, the model waits for
//! their choice ([`Prepare::AfterPlan`]): made ready before it, a model for which zero3 is
//! then chosen would have been whole, initialised, on every rank's device. A lazy model then
//! draws its values from the backend's generator after the dry runs, not when `train` starts.

use std::sync::{Arc, OnceLock};

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use burnscale_collective::Communicator;
use burnscale_precision::{cast_initialized, init_in, init_in_later};
use burnscale_shard::params::{fork, materialize};

use crate::cli::Strategy;
use crate::{TrainArgs, TrainError};

/// When the model is made ready.
#[derive(Debug, Clone)]
pub(crate) enum Prepare {
    /// Before the ranks start: the configuration is settled.
    Now,
    /// On each rank once its device plan has settled `auto`'s choice; `--init-on-device`'s
    /// dtype is the choice's (a lazy model's initialisers read it then).
    AfterPlan(Arc<OnceLock<FloatDType>>),
}

impl Prepare {
    pub(crate) fn new(args: &TrainArgs) -> Self {
        match args.strategy == Strategy::Auto && args.plans_device() {
            true => Prepare::AfterPlan(Arc::default()),
            false => Prepare::Now,
        }
    }

    /// What is done before the ranks start, on the calling thread: the ranks of a process
    /// share a lazy model's values (Burn initialises each once for all clones), and ranks
    /// on threads drawing them at once would draw from the backend's one generator in
    /// racing order.
    pub(crate) fn before_ranks<M: Module>(&self, model: M, args: &TrainArgs) -> M {
        match self {
            Prepare::Now => {
                let model = match args.init_on_device {
                    true => init_in(model, args.precision.param_dtype()),
                    false => model,
                };
                if args.strategy != Strategy::Zero3 {
                    materialize(&model);
                }
                model
            }
            Prepare::AfterPlan(dtype) if args.init_on_device => init_in_later(model, dtype.clone()),
            Prepare::AfterPlan(_) => model,
        }
    }

    /// This rank's model on its `device`, under the settled configuration `args`. Every rank
    /// calls it at the same point (after its device plan, where there is one): after `auto`'s
    /// choice of a strategy that keeps the model whole it is a collective.
    pub(crate) fn on_rank<M: Module>(
        &self,
        model: M,
        args: &TrainArgs,
        comm: &dyn Communicator,
        device: &Device,
    ) -> Result<M, TrainError> {
        let model = match self {
            Prepare::Now => model,
            Prepare::AfterPlan(dtype) => {
                let chosen = args.precision.param_dtype();
                // The ranks of a process share the cell, and agreed on the choice.
                let set = *dtype.get_or_init(|| chosen);
                if set != chosen {
                    return Err(TrainError::DryRun(format!(
                        "the ranks chose different precisions (weights in {chosen:?} here, {set:?} on another rank of this process)"
                    )));
                }
                if args.strategy != Strategy::Zero3 {
                    // Rank 0 draws first, in visit order; the other ranks of its process then
                    // find the values drawn, and a process of its own draws its own, which
                    // rank 0's broadcast replaces.
                    if comm.rank() == 0 {
                        materialize(&model);
                    }
                    comm.barrier()?;
                    materialize(&model);
                }
                model
            }
        };
        // Under zero3 only rank 0's values are read, where they are (the engine casts its
        // shards).
        if args.strategy == Strategy::Zero3 {
            return Ok(model);
        }
        let model = fork(model, device);
        // Parameters given initialised take `--init-on-device`'s dtype once it is chosen
        // (lazy ones were created in it), on the rank's own device.
        Ok(match self {
            Prepare::AfterPlan(_) if args.init_on_device => {
                cast_initialized(model, args.precision.param_dtype())
            }
            _ => model,
        })
    }
}
