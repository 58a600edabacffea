//! An evaluation under ZeRO-3 gathers one unit at a time, as training does: evaluating after
//! every step leaves the training peak where it was, where gathering the whole model on each
//! rank would raise it by two models. A test binary of its own, as the peak is process-wide.

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Process peak of 3 ZeRO-3 steps on 2 thread ranks of a 4-block minGPT whose parameters
/// outweigh its activations (width 256, batch 2 x 16), and its model's bytes.
fn zero3_peak(flags: &[&str]) -> (usize, usize) {
    let device = Device::default().autodiff();
    device.seed(1);
    let config = GptConfig::new(4, 4, 256, 65, 16).with_dropout(0.0);
    let model = Gpt::new(&config, &device).unwrap();
    let model_bytes = model.num_params() * 4;
    let tokens: Vec<i64> = (0..4_000).map(|i| (i * 31 % 65) as i64).collect();
    let base = [
        "--max-steps",
        "3",
        "--batch-size",
        "1",
        "--strategy",
        "zero3",
        "--devices",
        "2",
    ];
    let args = TrainArgs::from_flags(&[&base[..], flags].concat()).unwrap();
    let mut task = NextToken::new(tokens.clone(), 16, 1, 1)
        .and_then(|t| t.with_validation(tokens, 16, 1))
        .unwrap();
    let (_, summary) = train(model, &mut task, &args, &device).unwrap();
    (summary.peak_mem_bytes, model_bytes)
}

#[test]
fn zero3_evaluates_one_unit_at_a_time() {
    let (quiet, model_bytes) = zero3_peak(&[]);
    let (evaluating, _) = zero3_peak(&["--eval-interval", "1"]);
    eprintln!(
        "peak: {quiet} B without evaluations, {evaluating} B with one after each step (model {model_bytes} B)"
    );
    assert!(
        evaluating < quiet + model_bytes / 2,
        "evaluating raised the peak from {quiet} to {evaluating} B (the model is {model_bytes} B)"
    );
}
