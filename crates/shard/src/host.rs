//! What crosses between a device and host memory: offloaded parameters and optimizer state
//! moved to and from the host, and host copies of parameters. Every such move through this
//! module is counted ([`transferred_bytes`]); the engine makes none unless offloading was
//! asked for. Two moves outside a step are not: the parameters' first move to the host
//! (`Sharded::offload_params`) and values a checkpoint sets back where they live
//! (`Sharded::set_held_parameters`).

use std::cell::Cell;
use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;

thread_local! {
    /// Bytes this thread moved between tensors and host memory through this module.
    static TRANSFERRED: Cell<u64> = const { Cell::new(0) };
}

/// Bytes moved between tensors and host memory by this thread (one rank: a thread rank, or
/// an MPI process's) so far, each tensor counted in its dtype. It counts the same moves on
/// every backend, so on a CPU (where the host is the device) it shows the copies a GPU run of
/// the same engine makes.
pub fn transferred_bytes() -> u64 {
    TRANSFERRED.with(Cell::get)
}

fn count(bytes: usize) {
    TRANSFERRED.with(|t| t.set(t.get() + bytes as u64));
}

/// `tensor` moved between the device and the host (`to` is either), counted.
pub fn transfer<const D: usize>(tensor: Tensor<D>, to: &Device) -> Tensor<D> {
    count(tensor.shape().num_elements() * tensor.dtype().size());
    tensor.to_device(to)
}

/// Every float parameter of `module`, read into host memory in f32 (counted).
pub fn values<M: Module>(module: &M) -> HashMap<ParamId, Vec<f32>> {
    struct Values(HashMap<ParamId, Vec<f32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            count(value.shape().num_elements() * value.dtype().size());
            let value = value.into_data().convert::<f32>().try_into_vec();
            self.0.insert(param.id, value.expect("converted to f32"));
        }
    }
    let mut visit = Values(HashMap::new());
    module.visit(&mut visit);
    visit.0
}
