//! Evaluating and saving under ZeRO-3 gather one unit at a time, as training does: evaluating
//! after every step leaves the training peak where it was, and saving peaks less than a unit
//! above training, where gathering the whole model on each rank would add two models. A test
//! binary of its own, as the peak is process-wide (and one test, run in turn).

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{RunSummary, TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn config() -> GptConfig {
    GptConfig::new(4, 4, 256, 65, 16).with_dropout(0.0)
}

/// The summary of 3 ZeRO-3 steps on 2 thread ranks of a 4-block minGPT whose parameters
/// outweigh its activations (width 256, batch 2 x 16) and its model's bytes.
fn zero3_peak(flags: &[&str]) -> (RunSummary, usize) {
    let device = Device::default().autodiff();
    device.seed(1);
    let model = Gpt::new(&config(), &device).unwrap();
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
    let (model, summary) = train(model, &mut task, &args, &device).unwrap();
    assert!(
        model.is_none(),
        "zero3 hands back no gathered model unless asked"
    );
    (summary, model_bytes)
}

#[test]
fn zero3_evaluates_and_saves_one_unit_at_a_time() {
    let (quiet, model_bytes) = zero3_peak(&[]);
    let quiet = quiet.peak_mem_bytes.unwrap();
    let (evaluating, _) = zero3_peak(&["--eval-interval", "1"]);
    let evaluating = evaluating.peak_mem_bytes.unwrap();
    eprintln!(
        "peak: {quiet} B without evaluations, {evaluating} B with one after each step (model {model_bytes} B)"
    );
    assert!(
        evaluating < quiet + model_bytes / 2,
        "evaluating raised the peak from {quiet} to {evaluating} B (the model is {model_bytes} B)"
    );

    // Each rank holds one unit's full values at a time while rank 0 writes (a block, a
    // quarter of the model), and rank 0 a parameter's host copies as it writes it: the save
    // adds about a model's bytes over the two ranks (measured 0.99x), and may peak at most
    // one unit above training. One rank gathering the whole model adds one more model.
    let path = std::env::temp_dir().join(format!(
        "burnscale-zero3-{}.safetensors",
        std::process::id()
    ));
    let (saving, model_bytes) = zero3_peak(&["--save", path.to_str().unwrap()]);
    let loaded = burnscale::mingpt::loader::load(&path, &config(), &Device::default());
    std::fs::remove_file(&path).unwrap();
    loaded.unwrap();
    let save = saving.save.as_ref().expect("a save report");
    let (training, block_bytes) = (saving.peak_mem_bytes.unwrap(), model_bytes / 4);
    let (peak, before) = (
        save.peak_mem_bytes.unwrap(),
        save.live_before_bytes.unwrap(),
    );
    eprintln!("saving peaked at {peak} B ({before} B live before it), training at {training} B");
    assert!(
        peak < training + block_bytes,
        "saving peaked at {peak} B, more than one block ({block_bytes} B) above training's {training} B"
    );
    assert!(
        peak - before < model_bytes + block_bytes,
        "saving added {} B to the {before} B live before it (the model is {model_bytes} B)",
        peak - before
    );
}
