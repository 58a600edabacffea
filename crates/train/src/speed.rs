//! Speed: the device's measured peak GEMM rate in the dtype a run computes in, for the MFU
//! estimate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::FloatDType;

use crate::accelerator::Accelerator;

/// Measured GEMM rate of `device` in `dtype` (a bf16 run is held to bf16 matmuls, where a
/// GPU's tensor cores are) in FLOP/s, measured once per device, dtype, matmul kernels
/// (cuBLAS's or the backend's) and process (ranks that are threads share the figure instead
/// of measuring while competing for the cores). MFU divides the model FLOPs a second
/// (`burnscale_nn::flops`) by this. `None` when the probe could not time its work (see
/// `measure`).
pub fn peak_gemm_flops(device: &Device, dtype: FloatDType, on: Accelerator) -> Option<f64> {
    static MEASURED: Mutex<Option<HashMap<String, Option<f64>>>> = Mutex::new(None);
    let mut measured = MEASURED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // The products the models' linear layers run: cuBLAS's, where they do.
    let cublas = burnscale_nn::gemm::on_cublas(device);
    *measured
        .get_or_insert_with(HashMap::new)
        .entry(format!("{device:?} {dtype:?} cublas {cublas}"))
        .or_insert_with(|| measure(device, dtype, on, cublas))
}

/// Chains of square products, each feeding the next, timed to a device sync with the last
/// product still held (the best of three, after a warm-up that compiles and tunes the kernel).
///
/// The last product must be held, not read through a reduction or a slice: Burn's fusion
/// compiles a product that only a `sum` or a `slice` consumes into one kernel with it, and
/// that kernel need not compute the whole product. On cubecl's CPU runtime a 1024³ product
/// read through its sum timed at 3.6-4.7 TFLOP/s on two cores (the same product held: 55
/// GFLOP/s); two GPU probes read that way gave 9.8 and 16 PFLOP/s in f32.
///
/// On the CPU one 1024³ product. On a GPU such a product takes microseconds, less than its
/// launch and the sync that waits for it (an H200 timed that way read bf16 at ~30 TFLOP/s, and
/// a bf16 run's MFU at 130%): there the products are 8192³, and the rate is the marginal one of
/// a chain of eight over a chain of one, which leaves the launch and the sync out. A chain of
/// eight that does not take at least four times a chain of one was not timed, and gives none.
fn measure(device: &Device, dtype: FloatDType, on: Accelerator, cublas: bool) -> Option<f64> {
    let (side, chained) = match on.on_gpu() {
        true => (8192, 8),
        false => (1024, 1),
    };
    let (x, w) = operands(side, dtype, device);
    let run = |products: usize| {
        let start = Instant::now();
        let mut y = x.clone();
        for _ in 0..products {
            y = match cublas {
                true => burnscale_nn::gemm(y, w.clone(), false, false),
                false => y.matmul(w.clone()),
            };
        }
        let synced = device.sync().ok();
        let elapsed = start.elapsed().as_secs_f64();
        drop(y);
        synced.map(|()| elapsed)
    };
    let best = |products: usize| {
        (0..3)
            .map(|_| run(products))
            .try_fold(f64::INFINITY, |best, t| t.map(|t| best.min(t)))
    };
    run(1)?;
    let flops = |products: usize| 2.0 * (side * side * side * products) as f64;
    if chained == 1 {
        return Some(flops(1) / best(1)?);
    }
    let (one, many) = (best(1)?, best(chained)?);
    (many >= 0.5 * chained as f64 * one).then(|| flops(chained - 1) / (many - one))
}

/// The probe's `side`² operands in `dtype`: `x` of variance 1 and `w` of variance 1/`side`, which
/// keeps the values where they started along the chain. Hashed from the element indices, not
/// drawn from the backend's generator: a run's first probe comes after the caller seeded that
/// generator for its own use (tests running at once build their models from it; one
/// built while a probe drew got other weights).
fn operands(side: usize, dtype: FloatDType, device: &Device) -> (Tensor<2>, Tensor<2>) {
    // Uniform on [-√3, √3) has variance 1.
    let draw = |key: u64, std: f64| {
        (burnscale_nn::counter_random::uniform::<2>(Shape::new([side, side]), key, device) - 0.5)
            .mul_scalar(12f64.sqrt() * std)
            .cast(dtype)
    };
    (draw(1, 1.0), draw(2, 1.0 / (side as f64).sqrt()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operands are the same on every call whatever else draws from the backend's
    /// generator meanwhile (tests on other threads do), and spread as the chain needs.
    #[test]
    fn operands_leave_the_generator_alone() {
        let device = Device::default();
        let values = |t: Tensor<2>| -> Vec<f32> { t.into_data().try_into_vec().unwrap() };
        let (x, w) = operands(256, FloatDType::F32, &device);
        let (x, w) = (values(x), values(w));
        let (again, _) = operands(256, FloatDType::F32, &device);
        assert!(x == values(again), "the operands differ between calls");
        for (name, v, var) in [("x", &x, 1f64), ("w", &w, 1.0 / 256.0)] {
            let n = v.len() as f64;
            let mean = v.iter().map(|a| *a as f64).sum::<f64>() / n;
            let var_found = v.iter().map(|a| (*a as f64 - mean).powi(2)).sum::<f64>() / n;
            assert!(mean.abs() < 0.01 * var.sqrt(), "{name}: mean {mean}");
            assert!(
                (var_found / var - 1.0).abs() < 0.02,
                "{name}: variance {var_found}, not {var}"
            );
        }
        let correlation =
            x.iter().zip(&w).map(|(a, b)| (a * b) as f64).sum::<f64>() / (x.len() as f64 / 16.0);
        assert!(correlation.abs() < 0.01, "x and w correlate: {correlation}");
    }

    /// No x86-64 core does more than 64 f32 FLOP a cycle (two AVX-512 FMA units), nor runs
    /// above 6 GHz: a probe reading faster than that timed less work than it counts.
    #[test]
    fn probe_reads_a_rate_the_cores_can_reach() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let bound = cores * 6e9 * 64.0;
        let mut accelerators = vec![Accelerator::Cpu];
        if cfg!(feature = "cubecl-cpu") {
            accelerators.push(Accelerator::CubeclCpu);
        }
        if cfg!(feature = "tch") {
            accelerators.push(Accelerator::Libtorch);
        }
        for on in accelerators {
            // As the runner asks for it (`Device::default()` would be a GPU in a cuda build).
            let device = on.device(&Device::flex(), 0);
            let rate = measure(&device, FloatDType::F32, on, false).expect("a CPU probe is timed");
            assert!(
                rate > 0.0 && rate <= bound,
                "{on:?}: {:.1} GFLOP/s on {cores} cores (at most {:.1})",
                rate / 1e9,
                bound / 1e9
            );
        }
    }
}
