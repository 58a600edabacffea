//! Speed: the device's measured peak GEMM rate in the dtype a run computes in, for the MFU
//! estimate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::FloatDType;

/// Measured GEMM rate of `device` in `dtype` (a bf16 run is held to bf16 matmuls, where a
/// GPU's tensor cores are) in FLOP/s: the best of a few 1024x1024 matmuls after a warm-up,
/// measured once per device, dtype and process (ranks that are threads share the figure
/// instead of measuring while competing for the cores). MFU divides the model's
/// 6·P·tokens/s by this.
pub fn peak_gemm_flops(device: &Device, dtype: FloatDType) -> f64 {
    static MEASURED: Mutex<Option<HashMap<String, f64>>> = Mutex::new(None);
    let mut measured = MEASURED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *measured
        .get_or_insert_with(HashMap::new)
        .entry(format!("{device:?} {dtype:?}"))
        .or_insert_with(|| measure(device, dtype))
}

fn measure(device: &Device, dtype: FloatDType) -> f64 {
    const N: usize = 1024;
    let a = Tensor::<2>::ones([N, N], device).cast(dtype);
    let b = Tensor::<2>::ones([N, N], device).cast(dtype);
    let _ = a.clone().matmul(b.clone()).into_data();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let _ = a.clone().matmul(b.clone()).into_data();
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (N * N * N) as f64 / best
}
