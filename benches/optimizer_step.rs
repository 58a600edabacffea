//! One optimizer step on one matrix, on Flex: burn-optim's AdamW, burnscale's fused AdamW (the
//! one the runner uses; the same values in one pass), 8-bit AdamW, burn-optim's Adafactor and
//! burnscale's (its phases as loops over host memory), side by side in one run, each as a
//! ratio to burn-optim's AdamW; then both AdamWs on the same matrix in bf16 (bf16-true's
//! parameters; the same values, each operation rounded to bf16). The matrix is BERT-large's
//! MLP weight (1024 x 4096, 4.2M elements, f32); the steps after the first (the state exists)
//! are timed, the median taken.
//!
//!     cargo bench --bench optimizer_step [-- --rows 1024 --cols 4096 --steps 7]

use std::time::{Duration, Instant};

use anyhow::Result;
use burn::optim::{AdafactorConfig, AdamWConfig, Optimizer};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use burnscale::train::adafactor::Adafactor;
use burnscale::train::adam8bit::AdamW8bit;
use burnscale::train::fused_adamw::FusedAdamW;
use burnscale::train::memory::CountingAllocator;
use clap::Parser;

// The allocator every runner binary uses.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Parser)]
struct Cli {
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    #[arg(long, default_value_t = 4096)]
    cols: usize,
    /// Timed steps (after one untimed step that creates the state).
    #[arg(long, default_value_t = 7)]
    steps: usize,
    /// Cargo passes `--bench` to harness-less benches.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The median wall time of `steps` steps of `optim` on `param` with the same `grad`.
fn median_step<O: Optimizer>(
    optim: &O,
    param: &Tensor<2>,
    grad: &Tensor<2>,
    steps: usize,
) -> Duration {
    let device = param.device();
    let (mut param, mut state) = optim.step(1e-3, param.clone(), grad.clone(), None);
    let mut times: Vec<Duration> = (0..steps)
        .map(|_| {
            // The parameter moves in and the gradient is a copy of its own, as backward hands
            // the runner its gradients (an optimizer may update them in place).
            let moved = std::mem::replace(&mut param, Tensor::empty([0, 0], &device));
            let own = Tensor::from_data(grad.to_data(), (&device, grad.dtype()));
            let start = Instant::now();
            (param, state) = optim.step(1e-3, moved, own, state.take());
            // Flex computes eagerly; reading one element keeps the timing honest on any backend.
            let _ = param.clone().slice([0..1, 0..1]).into_scalar::<f32>();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[steps / 2]
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(cli.steps > 0, "--steps must be at least 1");
    let device = Device::flex();
    let shape = [cli.rows, cli.cols];
    let param = Tensor::<2>::random(shape, Distribution::Normal(0.0, 0.02), &device);
    let grad = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1e-3), &device);
    let (param_bf16, grad_bf16) = (
        param.clone().cast(DType::BF16),
        grad.clone().cast(DType::BF16),
    );
    let burn_adamw = AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .build();
    let adamw = median_step(&burn_adamw, &param, &grad, cli.steps);
    let adam8bit = AdamW8bit {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };
    let adafactor = Adafactor {
        beta_1: None,
        weight_decay: 0.01,
        relative_step: false,
    };
    // The same settings: a fixed learning rate, no first moment.
    let burn_adafactor = AdafactorConfig::new()
        .with_relative_step(false)
        .with_scale_parameter(false)
        .with_weight_decay(0.01)
        .build();
    let fused = FusedAdamW::new(0.9, 0.999, 1e-8, 0.01);
    let rows = [
        ("adamw (burn-optim)", adamw),
        (
            "adamw (fused)",
            median_step(&fused, &param, &grad, cli.steps),
        ),
        ("adam8bit", median_step(&adam8bit, &param, &grad, cli.steps)),
        (
            "adafactor (burn-optim)",
            median_step(&burn_adafactor, &param, &grad, cli.steps),
        ),
        (
            "adafactor",
            median_step(&adafactor, &param, &grad, cli.steps),
        ),
        (
            "adamw bf16 (burn-optim)",
            median_step(&burn_adamw, &param_bf16, &grad_bf16, cli.steps),
        ),
        (
            "adamw bf16 (fused)",
            median_step(&fused, &param_bf16, &grad_bf16, cli.steps),
        ),
    ];
    println!(
        "one step on a {} x {} matrix (f32 unless named), median of {} steps",
        cli.rows, cli.cols, cli.steps
    );
    for (name, time) in rows {
        println!(
            "{name:<24} {:>9.1} ms  {:>5.2}x adamw",
            time.as_secs_f64() * 1e3,
            time.as_secs_f64() / adamw.as_secs_f64()
        );
    }
    Ok(())
}
