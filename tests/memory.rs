//! The counting allocator measures what the process really holds.

use std::sync::Mutex;

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{self, CountingAllocator};
use burnscale::train::{TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The peak is process-wide: the tests here take turns.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn peak_sees_a_tensor_and_reset_forgets_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let device = Device::default();
    memory::reset_peak();
    let before = memory::live_bytes();
    let t = Tensor::<2>::ones([1024, 1024], &device) * 2.0; // 4 MiB
    let sum = t.clone().sum().into_scalar::<f32>();
    assert_eq!(sum, 2.0 * 1024.0 * 1024.0);
    let peak = memory::peak_bytes();
    assert!(
        peak >= before + (4 << 20),
        "peak {peak} live-before {before}"
    );
    drop(t);
    memory::reset_peak();
    assert!(memory::peak_bytes() < peak);
    assert!(memory::is_counting());
}

/// Peak bytes above the model states of two training steps of a 6-block minGPT.
fn activation_peak(flags: &[&str]) -> usize {
    let device = Device::default().autodiff();
    device.seed(1);
    let config = GptConfig::new(6, 4, 64, 65, 128).with_dropout(0.0);
    let model = Gpt::new(&config, &device).unwrap();
    let tokens: Vec<i64> = (0..20_000).map(|i| (i * 31 % 65) as i64).collect();
    let base = ["--max-steps", "2", "--batch-size", "16"];
    let args = TrainArgs::from_flags(&[&base[..], flags].concat()).unwrap();
    let mut task = NextToken::new(tokens, 128, 16, 1).unwrap();
    let (_, summary) = train(model, &mut task, &args, &device).unwrap();
    summary.peak_mem_bytes - summary.model_state_bytes_per_rank
}

#[test]
fn checkpointing_keeps_only_block_inputs() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let plain = activation_peak(&[]);
    let checkpointed = activation_peak(&["--checkpoint-activations"]);
    eprintln!(
        "activation peak: plain {plain} B, checkpointed {checkpointed} B ({:.2}x)",
        checkpointed as f64 / plain as f64
    );
    assert!(
        (checkpointed as f64) < 0.6 * plain as f64,
        "checkpointing kept {checkpointed} B of activations, plain {plain} B"
    );
}
