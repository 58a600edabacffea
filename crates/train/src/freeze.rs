//! `--freeze`: parameters left out of training, named by path. The engine trains every
//! parameter the model does not itself freeze; this only marks them, as
//! `requires_grad_(False)` does in PyTorch.

use std::collections::{BTreeSet, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burnscale_shard::layout::{self, Slot};
use burnscale_shard::params;

use crate::TrainError;

/// Whether the parameter at `path` is one of `prefixes`' (each a path or a prefix of whole
/// components).
pub fn frozen_by(prefixes: &[String], path: &str) -> bool {
    prefixes.iter().any(|prefix| {
        path.strip_prefix(prefix.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

/// `model` with the parameters `prefixes` name frozen (`require_grad` false; a lazy one stays
/// lazy), as [`frozen_ids`] checks them.
pub fn freeze<M: Module>(model: M, prefixes: &[String]) -> Result<M, TrainError> {
    if prefixes.is_empty() {
        return Ok(model);
    }
    struct Freeze(HashSet<ParamId>);
    impl ModuleMapper for Freeze {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.0.contains(&param.id) {
                true => param.set_require_grad(false),
                false => param,
            }
        }
    }
    let frozen = frozen_ids(&model, prefixes)?;
    Ok(model.map(&mut Freeze(frozen)))
}

/// The parameters of `model` that `prefixes` name. A prefix that names no parameter is an
/// error naming it and the model's top-level modules, as is one that leaves nothing to
/// train.
pub fn frozen_ids<M: Module>(
    model: &M,
    prefixes: &[String],
) -> Result<HashSet<ParamId>, TrainError> {
    if prefixes.is_empty() {
        return Ok(HashSet::new());
    }
    let slots = layout::slots(model, 1);
    let names = |prefix: &String| {
        slots
            .iter()
            .any(|s| frozen_by(std::slice::from_ref(prefix), &s.path))
    };
    if let Some(unknown) = prefixes.iter().find(|p| !names(p)) {
        let tops: BTreeSet<&str> = slots
            .iter()
            .filter_map(|s| s.path.split('.').next())
            .collect();
        return Err(TrainError::InvalidArgs(format!(
            "--freeze {unknown}: no parameter of the model has that path or path prefix (its top-level modules: {})",
            tops.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    let frozen = named(&slots, prefixes);
    if slots.iter().all(|s| frozen.contains(&s.id)) {
        return Err(TrainError::InvalidArgs(format!(
            "--freeze {} freezes every parameter of the model: there is nothing to train",
            prefixes.join(",")
        )));
    }
    Ok(frozen)
}

/// The parameters of `model` known to be frozen before it runs: those `prefixes` name, and
/// the initialised ones the model froze itself (a lazy parameter's setting shows only once it
/// is initialised, which a plan does not do).
pub fn known_frozen<M: Module>(model: &M, prefixes: &[String]) -> HashSet<ParamId> {
    struct Initialised(HashSet<ParamId>);
    impl ModuleVisitor for Initialised {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_initialized() && params::is_frozen(&param.val()) {
                self.0.insert(param.id);
            }
        }
    }
    let mut frozen = Initialised(HashSet::new());
    model.visit(&mut frozen);
    frozen.0.extend(named(&layout::slots(model, 1), prefixes));
    frozen.0
}

/// The ids of the `slots` that `prefixes` name.
fn named(slots: &[Slot], prefixes: &[String]) -> HashSet<ParamId> {
    slots
        .iter()
        .filter(|s| frozen_by(prefixes, &s.path))
        .map(|s| s.id)
        .collect()
}
