//! A module's parameters and gradients as flat tensors keyed by parameter id, on the
//! module's own device: what the engine slices into shards and the collectives move. Nothing
//! here leaves the device.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::DType as TensorDType;
use burnscale_nn::autodiff_on;

use crate::layout::Slot;

/// Flat values (parameters or gradients) by parameter id.
pub type Flat = HashMap<ParamId, Tensor<1>>;

fn flat<const D: usize>(tensor: Tensor<D>) -> Tensor<1> {
    let n = tensor.shape().num_elements();
    tensor.inner().reshape([n])
}

/// The float parameters of `module` named in `ids` (every one when `None`), flat and
/// without autodiff (sharing their values). Only those are initialised if they were lazy.
pub fn values<M: Module>(module: &M, ids: Option<&[ParamId]>) -> Flat {
    struct Values<'a>(Option<&'a [ParamId]>, Flat);
    impl ModuleVisitor for Values<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none_or(|ids| ids.contains(&param.id)) {
                self.1.insert(param.id, flat(param.val()));
            }
        }
    }
    let mut visit = Values(ids, HashMap::new());
    module.visit(&mut visit);
    visit.1
}

/// Each of `slots`' shard for `rank`, sliced from the parameters of `module` (flat).
pub fn shards<M: Module>(module: &M, slots: &HashMap<ParamId, &Slot>, rank: usize) -> Flat {
    struct Shards<'a> {
        slots: &'a HashMap<ParamId, &'a Slot>,
        rank: usize,
        out: Flat,
    }
    impl ModuleVisitor for Shards<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(slot) = self.slots.get(&param.id) {
                let shard = slot.shard_of(&flat(param.val()), self.rank);
                self.out.insert(param.id, shard);
            }
        }
    }
    let mut visit = Shards {
        slots,
        rank,
        out: HashMap::new(),
    };
    module.visit(&mut visit);
    visit.out
}

/// Moves the gradients of `module`'s parameters out of `grads`, adding them (in `dtype`)
/// into `sums`.
pub fn add_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    sums: &mut Flat,
    dtype: TensorDType,
) {
    struct Add<'a> {
        grads: &'a mut GradientsParams,
        sums: &'a mut Flat,
        dtype: TensorDType,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                add_grad(self.sums, param.id, grad, self.dtype);
            }
        }
    }
    module.visit(&mut Add { grads, sums, dtype });
}

/// Adds `grad`, the gradient of parameter `id` (in `dtype`, flat), into `sums`.
pub fn add_grad<const D: usize>(sums: &mut Flat, id: ParamId, grad: Tensor<D>, dtype: TensorDType) {
    let grad = flat(grad).cast(dtype);
    let sum = match sums.remove(&id) {
        Some(sum) => sum + grad,
        None => grad,
    };
    sums.insert(id, sum);
}

/// The 2-D parameters of `module` named in `ids`, in that order, sharing their values.
pub fn matrices<M: Module>(module: &M, ids: &[ParamId]) -> Vec<(ParamId, Tensor<2>)> {
    struct Matrices<'a>(&'a [ParamId], HashMap<ParamId, Tensor<2>>);
    impl ModuleVisitor for Matrices<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if D == 2 && self.0.contains(&param.id) {
                let t = param.val();
                let dims = t.dims();
                self.1.insert(param.id, t.reshape([dims[0], dims[1]]));
            }
        }
    }
    let mut visit = Matrices(ids, HashMap::new());
    module.visit(&mut visit);
    ids.iter()
        .map(|id| {
            (
                *id,
                visit.1.remove(id).expect("a 2-D parameter for every id"),
            )
        })
        .collect()
}

/// `module` with the parameters named in `ids` emptied (no elements; same ids, dims of 0),
/// the others untouched: what a graph's block keeps when backward gathers those again.
pub fn emptied<M: Module>(module: M, ids: &[ParamId]) -> M {
    if ids.is_empty() {
        return module;
    }
    struct Empty<'a>(&'a [ParamId]);
    impl ModuleMapper for Empty<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !self.0.contains(&param.id) {
                return param;
            }
            param.map(|t| Tensor::empty([0; D], (&t.device(), t.dtype())))
        }
    }
    module.map(&mut Empty(ids))
}

/// How [`set_values`] leaves the values it sets.
#[derive(Debug, Clone, Copy)]
pub enum Track<'a> {
    /// Plain tensors on the values' own device, without autodiff (shards between uses).
    No,
    /// On the autodiff device, tracked for gradients, but for the frozen parameters named
    /// here (on that device too, untracked: a forward through them gives them no gradient).
    AllBut(&'a HashSet<ParamId>),
}

/// `module` with the parameters named in `values` replaced by those flat values reshaped to
/// the given dims, each cast to its parameter's dtype (a lazy parameter keeps the value's,
/// without running its initialiser), on `device` as `track` says. The others untouched.
pub fn set_values<M: Module>(
    module: M,
    values: HashMap<ParamId, (Tensor<1>, Vec<usize>)>,
    device: &Device,
    track: Track<'_>,
) -> M {
    struct Set<'a> {
        values: HashMap<ParamId, (Tensor<1>, Vec<usize>)>,
        device: &'a Device,
        track: Track<'a>,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((value, dims)) = self.values.remove(&param.id) else {
                return param;
            };
            let (id, dtype, mapper) = if param.is_initialized() {
                let (id, old, mapper) = param.consume();
                (id, Some(old.dtype()), Some(mapper))
            } else {
                (param.id, None, None)
            };
            let dims: [usize; D] = dims.try_into().expect("a slot's dims have its rank");
            let mut tensor = value.inner().reshape(dims);
            if let Some(dtype) = dtype {
                tensor = tensor.cast(dtype);
            }
            if let Track::AllBut(frozen) = self.track {
                tensor = autodiff_on(tensor, self.device);
                if !frozen.contains(&id) {
                    tensor = tensor.require_grad();
                }
            }
            match mapper {
                Some(mapper) => Param::from_mapped_value(id, tensor, mapper),
                None => Param::initialized(id, tensor),
            }
        }
    }
    module.map(&mut Set {
        values,
        device,
        track,
    })
}

/// Whether a parameter of value `value` is frozen: on an autodiff device and not tracked
/// (`require_grad` false). Untracked, rather than not requiring gradients: a parameter mapped
/// after initialisation (`to_device`) is tracked through its map, and trains.
pub fn is_frozen<const D: usize>(value: &Tensor<D>) -> bool {
    value.is_autodiff() && !value.is_tracked()
}

/// The parameters of `module` named in `ids` (every one when `None`) that are frozen
/// ([`is_frozen`]). Only those are initialised if they were lazy (a lazy parameter's setting
/// shows once it is).
pub fn frozen<M: Module>(module: &M, ids: Option<&[ParamId]>) -> HashSet<ParamId> {
    struct Frozen<'a>(Option<&'a [ParamId]>, HashSet<ParamId>);
    impl ModuleVisitor for Frozen<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none_or(|ids| ids.contains(&param.id)) && is_frozen(&param.val()) {
                self.1.insert(param.id);
            }
        }
    }
    let mut visit = Frozen(ids, HashSet::new());
    module.visit(&mut visit);
    visit.1
}

/// `module` on `device` (an autodiff device), each parameter a leaf there that is tracked
/// where it was tracked ([`is_frozen`]'s reading): a parameter mapped after initialisation,
/// tracked through its map, trains as a leaf of its own. Burn's `Module::fork` keeps only the
/// `require_grad` leaves tracked, which would freeze a mapped parameter. Initialises a lazy
/// parameter.
pub fn fork<M: Module>(module: M, device: &Device) -> M {
    struct Fork<'a>(&'a Device);
    impl ModuleMapper for Fork<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let tracked = tensor.is_tracked();
            let mut tensor = tensor.to_device(self.0).detach();
            if tracked {
                tensor = tensor.require_grad();
            }
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Fork(device))
}

/// `module` with each plain parameter (a shard, kept without autodiff between uses) a leaf
/// on autodiff, with `device`'s gradient checkpointing (where each stays), tracked unless
/// named in `frozen`: what Burn's optimizers step, which ask each parameter whether it is
/// distributed. Parameters on autodiff already are left as they are; [`detached`] takes the
/// leaves back (sharing the values, copying nothing).
pub fn leaves<M: Module>(module: M, frozen: &HashSet<ParamId>, device: &Device) -> M {
    struct Leaves<'a>(&'a HashSet<ParamId>, &'a Device);
    impl ModuleMapper for Leaves<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            if tensor.is_autodiff() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let mut tensor = autodiff_on(tensor, self.1);
            if !self.0.contains(&id) {
                tensor = tensor.require_grad();
            }
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Leaves(frozen, device))
}

/// `module` with every parameter without autodiff: a forward through it records no graph
/// and keeps no activations (shares the values, copies nothing).
pub fn detached<M: Module>(module: &M) -> M {
    struct Detach;
    impl ModuleMapper for Detach {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor.inner(), mapper)
        }
    }
    module.clone().map(&mut Detach)
}

/// Gradients for `module`'s parameters from flat values, each shaped as its parameter and in
/// its dtype.
pub fn to_grads<M: Module>(module: &M, mut flat: Flat) -> GradientsParams {
    struct ToGrads<'a> {
        flat: &'a mut Flat,
        grads: GradientsParams,
    }
    impl ModuleVisitor for ToGrads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(value) = self.flat.remove(&param.id) {
                let dims: [usize; D] = param.shape().dims();
                let value = value.reshape(dims).cast(param.val().dtype());
                self.grads.register(param.id, value);
            }
        }
    }
    let mut visit = ToGrads {
        flat: &mut flat,
        grads: GradientsParams::new(),
    };
    module.visit(&mut visit);
    visit.grads
}

/// Bytes held by the float parameters of `module`.
pub fn param_bytes<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += param.shape().num_elements() * param.val().dtype().size();
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

/// Runs every lazy parameter initialiser now, in visit order. Burn initialises a parameter
/// on its first use (once for all clones), so ranks on threads would otherwise draw from
/// the backend's one random generator in racing order.
pub fn materialize<M: Module>(module: &M) {
    struct Touch;
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}

/// The parameter ids of `module`, in visit order.
pub fn param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    /// Frozen: on an autodiff device and untracked, lazy or not (initialised to be read); a
    /// parameter mapped after initialisation is tracked through its map, and a model without
    /// autodiff tracks nothing yet.
    #[test]
    fn frozen_parameters_are_the_untracked_ones_under_autodiff() {
        let device = Device::flex().autodiff();
        let frozen_of = |layer: &Linear| {
            let found = frozen(layer, None);
            (
                found.contains(&layer.weight.id),
                layer.bias.as_ref().is_some_and(|b| found.contains(&b.id)),
            )
        };
        let lazy = LinearConfig::new(4, 3).init(&device);
        assert_eq!(frozen_of(&lazy), (false, false));
        let mut lazy = LinearConfig::new(4, 3).init(&device);
        lazy.weight = lazy.weight.set_require_grad(false);
        assert_eq!(frozen_of(&lazy), (true, false));
        let mut loaded = LinearConfig::new(4, 3).init(&device);
        loaded.weight = Param::from_tensor(Tensor::zeros([4, 3], &device)).set_require_grad(false);
        assert_eq!(frozen_of(&loaded), (true, false));
        loaded.weight = Param::from_tensor(Tensor::zeros([4, 3], &device)).map(|w| w * 2.0);
        assert_eq!(frozen_of(&loaded), (false, false));
        let plain = LinearConfig::new(4, 3).init(&Device::flex());
        assert_eq!(frozen_of(&plain), (false, false));
    }
}
