//! Speed: the device's measured peak GEMM rate in the dtype a run computes in, for the MFU
//! estimate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType};

use crate::accelerator::Accelerator;

/// Measured GEMM rate of `device` in `dtype` (a bf16 run is held to bf16 matmuls, where a
/// GPU's tensor cores are) in FLOP/s, measured once per device, dtype and process (ranks that
/// are threads share the figure instead of measuring while competing for the cores). MFU
/// divides the model's 6·P·tokens/s by this. `None` when the probe could not time its work
/// (see [`measure`]).
pub fn peak_gemm_flops(device: &Device, dtype: FloatDType, on: Accelerator) -> Option<f64> {
    static MEASURED: Mutex<Option<HashMap<String, Option<f64>>>> = Mutex::new(None);
    let mut measured = MEASURED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *measured
        .get_or_insert_with(HashMap::new)
        .entry(format!("{device:?} {dtype:?}"))
        .or_insert_with(|| measure(device, dtype, on))
}

/// Chains of square products, each feeding the next, timed to a read of the last one's sum
/// (the best of three, after a warm-up that compiles and tunes the kernel).
///
/// On the CPU one 1024³ product. On a GPU such a product takes microseconds, less than its
/// launch and the read that waits for it (an H200 timed that way read bf16 at ~30 TFLOP/s, and
/// a bf16 run's MFU at 130%): there the products are 8192³, and the rate is the marginal one of
/// a chain of eight over a chain of one, which leaves the launch and the read out. Two earlier
/// GPU probes read 9.8 and 16 PFLOP/s in f32, time that did not grow with the work; a chain of
/// eight that does not take at least four times a chain of one was not timed, and gives none.
fn measure(device: &Device, dtype: FloatDType, on: Accelerator) -> Option<f64> {
    let (side, chained) = match on {
        Accelerator::Cuda => (8192, 8),
        Accelerator::Cpu | Accelerator::CubeclCpu => (1024, 1),
    };
    // The scale keeps the values where they started along the chain.
    let scale = 1.0 / (side as f64).sqrt();
    let w = Tensor::<2>::random([side, side], Distribution::Normal(0.0, scale), device).cast(dtype);
    let x = Tensor::<2>::random([side, side], Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let run = |products: usize| {
        let start = Instant::now();
        let mut y = x.clone();
        for _ in 0..products {
            y = y.matmul(w.clone());
        }
        let _ = y.sum().into_data();
        start.elapsed().as_secs_f64()
    };
    let best = |products: usize| (0..3).map(|_| run(products)).fold(f64::INFINITY, f64::min);
    run(1);
    let flops = |products: usize| 2.0 * (side * side * side * products) as f64;
    if chained == 1 {
        return Some(flops(1) / best(1));
    }
    let (one, many) = (best(1), best(chained));
    (many >= 0.5 * chained as f64 * one).then(|| flops(chained - 1) / (many - one))
}
