//! Speed: the device's measured peak GEMM rate, for the MFU estimate.

use std::time::Instant;

use burn::prelude::*;

/// Measured f32 GEMM rate of `device` in FLOP/s: the best of a few 1024x1024 matmuls after a
/// warm-up. MFU divides the model's 6·P·tokens/s by this.
pub fn peak_gemm_flops(device: &Device) -> f64 {
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
