//! Speed: the device's measured peak GEMM rate, for the MFU estimate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use burn::prelude::*;

/// Measured f32 GEMM rate of `device` in FLOP/s: the best of a few 1024x1024 matmuls after a
/// warm-up, measured once per device and process (ranks that are threads share the figure
/// instead of measuring while competing for the cores). MFU divides the model's
/// 6·P·tokens/s by this.
pub fn peak_gemm_flops(device: &Device) -> f64 {
    static MEASURED: Mutex<Option<HashMap<String, f64>>> = Mutex::new(None);
    let mut measured = MEASURED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *measured
        .get_or_insert_with(HashMap::new)
        .entry(format!("{device:?}"))
        .or_insert_with(|| measure(device))
}

fn measure(device: &Device) -> f64 {
    const N: usize = 1024;
    let a = Tensor::<2>::ones([N, N], device);
    let b = Tensor::<2>::ones([N, N], device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let _ = a.clone().matmul(b.clone()).into_data();
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * (N * N * N) as f64 / best
}
