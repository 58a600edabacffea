//! Constant tensors built once per thread and device: dropout's index ranges, 8-bit AdamW's
//! codebooks, position ids and causal masks are the same at every step, and on a GPU each
//! would otherwise be an upload or a kernel or two per call.

use std::any::Any;
use std::cell::RefCell;

use burn::prelude::*;
use burn::tensor::kind::Basic;

/// One cached value: the device it lives on, what it is (a name and a key), and the value.
type Entry = (Device, &'static str, Box<dyn Any>, Box<dyn Any>);

thread_local! {
    static CACHE: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// The value `build` gives for (`name`, `key`) on `device`, built on the first call on this
/// thread for that device and kept for the thread's life (each thread rank has its own).
/// Callers keep the keys few: a length goes through [`for_length`].
pub fn cached<K: PartialEq + 'static, T: Clone + 'static>(
    name: &'static str,
    key: K,
    device: &Device,
    build: impl FnOnce() -> T,
) -> T {
    let found = CACHE.with_borrow(|cache| {
        cache
            .iter()
            .filter(|(on, n, k, _)| {
                *n == name && k.downcast_ref() == Some(&key) && same_context(on, device)
            })
            .find_map(|(_, _, _, value)| value.downcast_ref::<T>().cloned())
    });
    found.unwrap_or_else(|| {
        let value = build();
        CACHE.with_borrow_mut(|cache| {
            cache.push((device.clone(), name, Box::new(key), Box::new(value.clone())));
        });
        value
    })
}

/// Forgets what this thread cached: what a dry run built (cubecl's, where launches are
/// dropped) was never written, and must not serve the steps after it.
pub fn clear() {
    CACHE.with_borrow_mut(Vec::clear);
}

/// The tensor `build` gives for a length `n`, the power of two at or above `t` (cached under
/// `name` and `n`), cut to `t` along each of `dims`: sampling through every length up to a
/// block size keeps a handful of tensors, not one per length.
pub fn for_length<const D: usize, K: Basic + 'static>(
    name: &'static str,
    t: usize,
    dims: &[usize],
    device: &Device,
    build: impl FnOnce(usize) -> Tensor<D, K>,
) -> Tensor<D, K> {
    let n = t.next_power_of_two();
    let all = cached(name, n, device, || build(n));
    match n == t {
        true => all,
        false => dims.iter().fold(all, |x, &dim| x.narrow(dim, 0, t)),
    }
}

/// Position ids `0..t` (`[1, t]`) on `device`.
pub fn positions(t: usize, device: &Device) -> Tensor<2, Int> {
    for_length("positions", t, &[1], device, |n| {
        Tensor::arange(0..n as i64, device).reshape([1, n])
    })
}

/// Whether `a` and `b` are the same hardware with the same autodiff and checkpointing
/// (devices compare equal on hardware alone: a tensor built on the plain device a checkpointed
/// block runs forward on must not serve the autodiff device its recomputation runs on).
fn same_context(a: &Device, b: &Device) -> bool {
    a == b
        && a.is_autodiff() == b.is_autodiff()
        && a.gradient_checkpointing_strategy() == b.gradient_checkpointing_strategy()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Each value is built once per thread, device context, name and key, and a cached one
    /// is never handed to another context (plain, autodiff and checkpointing devices are
    /// three, and compare equal).
    #[test]
    fn values_are_built_once_per_device_context_and_key() {
        let plain = Device::default();
        let autodiff = plain.clone().autodiff();
        let checkpointing = plain.clone().autodiff().gradient_checkpointing();
        let builds = Cell::new(0);
        for _ in 0..2 {
            for device in [&plain, &autodiff, &checkpointing] {
                for (name, key) in [("a", 7usize), ("a", 9), ("b", 7)] {
                    let tensor = cached(name, key, device, || {
                        builds.set(builds.get() + 1);
                        Tensor::<1, Int>::arange(0..key as i64, device)
                    });
                    assert!(same_context(&tensor.device(), device), "{name} {key}");
                    assert_eq!(tensor.dims(), [key]);
                }
            }
        }
        assert_eq!(builds.get(), 9);
    }
}
