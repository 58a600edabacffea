//! Gradient accumulation into whole sums (one device, DDP, ZeRO-1) holds one copy of the
//! gradients, not two: after the first micro-step backward goes block by block, adding each
//! block's gradients into the sums as it leaves it, as PyTorch adds into `.grad`, where a
//! plain backward would hand back a whole second copy beside the sums. A test binary of its
//! own, as the peak is process-wide (and one test).

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The process peak of 2 AdamW steps of `accumulate` micro-batches on one device, and the
/// bytes of one copy of the gradients, for a minGPT whose model states outweigh its
/// activations (8 blocks of width 256, batch 1 x 16 tokens), as a large model's do.
fn peak(accumulate: &str) -> (usize, usize) {
    let device = Device::default().autodiff();
    device.seed(1);
    let model = Gpt::new(
        &GptConfig::new(8, 4, 256, 65, 16).with_dropout(0.0),
        &device,
    )
    .unwrap();
    let grad_bytes = model.num_params() * 4;
    let tokens: Vec<i64> = (0..4_000).map(|i| (i * 31 % 65) as i64).collect();
    let flags = [
        "--max-steps",
        "2",
        "--batch-size",
        "1",
        "--accumulate",
        accumulate,
    ];
    let args = TrainArgs::from_flags(&flags).unwrap();
    let mut task = NextToken::new(tokens.clone(), 16, 1, 1)
        .and_then(|t| t.with_validation(tokens, 16, 1))
        .unwrap();
    let (_, summary) = train(model, &mut task, &args, &device).unwrap();
    (summary.peak_mem_bytes.unwrap(), grad_bytes)
}

#[test]
fn accumulating_holds_one_gradient_copy_not_two() {
    let (one, grad_bytes) = peak("1");
    let (four, _) = peak("4");
    eprintln!(
        "peak: {one} B without accumulation, {four} B with 4 micro-batches (gradients {grad_bytes} B)"
    );
    // The sums take the place of the step's gradients; on top come the activations and one
    // block's gradients (an eighth of the model) as they are added in.
    assert!(
        four < one + grad_bytes / 2,
        "accumulating raised the peak from {one} to {four} B (a copy of the gradients is {grad_bytes} B)"
    );
}
