//! Parameters and gradients moved between a module and host `Vec<f32>`s keyed by parameter
//! id: what the collectives exchange. Every such move is counted ([`transferred_bytes`]).

use std::cell::Cell;
use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;

use crate::layout::Slot;

pub type HostValues = HashMap<ParamId, Vec<f32>>;

thread_local! {
    /// Bytes this thread moved between tensors and host memory through this module.
    static TRANSFERRED: Cell<u64> = const { Cell::new(0) };
}

/// Bytes moved between tensors and host memory by this thread (one rank: a thread rank, or
/// an MPI process's) so far: tensors read into host vectors, counted in the tensor's dtype,
/// and host vectors written into tensors. It counts the same conversions on every backend,
/// so on a CPU it shows the copies a GPU run of the same engine would make.
pub fn transferred_bytes() -> u64 {
    TRANSFERRED.with(Cell::get)
}

fn count(bytes: usize) {
    TRANSFERRED.with(|t| t.set(t.get() + bytes as u64));
}

fn to_vec<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    count(tensor.shape().num_elements() * tensor.dtype().size());
    tensor
        .into_data()
        .convert::<f32>()
        .try_into_vec()
        .expect("converted to f32")
}

/// Each of `slots`' shard for `rank`, sliced from the parameters of `module` (only the owned
/// rows are copied out).
pub fn shards<M: Module>(module: &M, slots: &HashMap<ParamId, &Slot>, rank: usize) -> HostValues {
    struct Shards<'a> {
        slots: &'a HashMap<ParamId, &'a Slot>,
        rank: usize,
        out: HostValues,
    }
    impl ModuleVisitor for Shards<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(slot) = self.slots.get(&param.id) else {
                return;
            };
            let (start, real) = slot.owned_rows(self.rank);
            let mut shard = if real > 0 {
                to_vec(param.val().narrow(0, start, real))
            } else {
                Vec::new()
            };
            shard.resize(slot.shard_numel(), 0.0);
            self.out.insert(param.id, shard);
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

/// The float parameters of `module` named in `ids`, on the host: only those are initialised
/// if they were lazy.
pub fn values_of<M: Module>(module: &M, ids: &[ParamId]) -> HostValues {
    struct Values<'a>(&'a [ParamId], HostValues);
    impl ModuleVisitor for Values<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.contains(&param.id) {
                self.1.insert(param.id, to_vec(param.val()));
            }
        }
    }
    let mut visit = Values(ids, HashMap::new());
    module.visit(&mut visit);
    visit.1
}

/// Every float parameter of `module`, on the host.
pub fn values<M: Module>(module: &M) -> HostValues {
    struct Values(HostValues);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id, to_vec(param.val()));
        }
    }
    let mut visit = Values(HashMap::new());
    module.visit(&mut visit);
    visit.0
}

/// Moves the gradients of `module`'s parameters out of `grads`, adding them into `sums`.
pub fn add_grads<M: Module>(module: &M, grads: &mut GradientsParams, sums: &mut HostValues) {
    struct Add<'a> {
        grads: &'a mut GradientsParams,
        sums: &'a mut HostValues,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(grad) = self.grads.remove::<D>(param.id) else {
                return;
            };
            let grad = to_vec(grad);
            match self.sums.get_mut(&param.id) {
                Some(sum) => sum.iter_mut().zip(grad).for_each(|(s, g)| *s += g),
                None => {
                    self.sums.insert(param.id, grad);
                }
            }
        }
    }
    module.visit(&mut Add { grads, sums });
}

/// `module` with the parameters named in `values` replaced by tensors of the given dims on
/// `device`, each in its parameter's dtype (tracked for gradients if `require_grad`); the
/// others untouched. A lazy parameter is replaced without running its initialiser (its
/// value arrives in f32).
pub fn set_values<M: Module>(
    module: M,
    values: HashMap<ParamId, (Vec<f32>, Vec<usize>)>,
    device: &Device,
    require_grad: bool,
) -> M {
    struct Set<'a> {
        values: HashMap<ParamId, (Vec<f32>, Vec<usize>)>,
        device: &'a Device,
        require_grad: bool,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((value, dims)) = self.values.remove(&param.id) else {
                return param;
            };
            let (id, dtype, mapper) = if param.is_initialized() {
                let (id, old, mapper) = param.consume();
                (id, FloatDType::from(old.dtype()), Some(mapper))
            } else {
                (param.id, FloatDType::F32, None)
            };
            count(4 * value.len());
            let mut tensor =
                Tensor::<D>::from_data(TensorData::new(value, dims), self.device).cast(dtype);
            if self.require_grad {
                tensor = tensor.require_grad();
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
        require_grad,
    })
}

/// `module` with every parameter on the plain (non-autodiff) device: a forward through it
/// records no graph and keeps no activations (shares the values, copies nothing).
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

/// Gradients for `module`'s parameters from host values, each shaped as its parameter and in
/// its dtype.
pub fn to_grads<M: Module>(module: &M, mut host: HostValues, device: &Device) -> GradientsParams {
    struct ToGrads<'a> {
        host: &'a mut HostValues,
        device: &'a Device,
        grads: GradientsParams,
    }
    impl ModuleVisitor for ToGrads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(value) = self.host.remove(&param.id) {
                count(4 * value.len());
                let data = TensorData::new(value, param.shape());
                let dtype = FloatDType::from(param.val().dtype());
                self.grads.register(
                    param.id,
                    Tensor::<D>::from_data(data, self.device).cast(dtype),
                );
            }
        }
    }
    let mut visit = ToGrads {
        host: &mut host,
        device,
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
