//! `--init-on-device`: a bf16 model created directly in bf16 peaks at about half the memory
//! of creating it in f32 and casting (the article: 1.24 GB vs 0.65 GB). A test binary of
//! its own, as the counting allocator's peak is process-wide.

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::precision::{cast, init_in, param_dtypes};
use burnscale::shard::host::materialize;
use burnscale::train::memory::{self, CountingAllocator};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Peak bytes above what was live before, while `create` builds a model.
fn init_peak(create: impl FnOnce() -> Gpt) -> (usize, Gpt) {
    let before = memory::live_bytes();
    memory::reset_peak();
    let model = create();
    (memory::peak_bytes() - before, model)
}

#[test]
fn init_in_bf16_peaks_at_half_of_f32_then_cast() {
    let device = Device::default();
    // ~6.8M parameters; the largest tensor (wte, 512 x 256) is 2% of them.
    let config = GptConfig::new(8, 4, 256, 512, 128);
    let build = || Gpt::new(&config, &device).unwrap();
    let (f32_then_cast, a) = init_peak(|| {
        let model = build();
        materialize(&model);
        cast(model, FloatDType::BF16)
    });
    drop(a);
    let (direct, b) = init_peak(|| {
        let model = init_in(build(), FloatDType::BF16);
        materialize(&model);
        model
    });
    assert_eq!(param_dtypes(&b), vec![DType::BF16]);
    let ratio = direct as f64 / f32_then_cast as f64;
    eprintln!(
        "init peak: f32 then cast {} B, directly in bf16 {} B ({ratio:.2}x); bf16 weights {} B",
        f32_then_cast,
        direct,
        2 * config.num_params()
    );
    assert!(
        ratio < 0.6,
        "init in bf16 peaked at {ratio:.2}x of f32-then-cast"
    );
}
