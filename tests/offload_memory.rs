//! `--offload-dir` keeps the optimizer state on disk, not in memory: the run's process peak
//! (the counting allocator's) is below the same run's with the state in memory by about the
//! whole state, one parameter's state read in at a time. A test binary of its own, as the
//! peak is process-wide.

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::CountingAllocator;
use burnscale::train::{TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// A 4-block minGPT of width 256 whose AdamW state (8 B a parameter) outweighs its
/// activations (batch 1 x 16): the process peak of 3 steps, and the parameter count.
fn peak(flags: &[&str]) -> (usize, usize) {
    let device = Device::default().autodiff();
    device.seed(1);
    let model = Gpt::new(
        &GptConfig::new(4, 4, 256, 65, 16).with_dropout(0.0),
        &device,
    )
    .unwrap();
    let params = model.num_params();
    let base = [
        "--max-steps",
        "3",
        "--batch-size",
        "1",
        "--optimizer",
        "adamw",
    ];
    let args = TrainArgs::from_flags(&[&base[..], flags].concat()).unwrap();
    let tokens: Vec<i64> = (0..4_000).map(|i| (i * 31 % 65) as i64).collect();
    let mut task = NextToken::new(tokens, 16, 1, 1).unwrap();
    let summary = train(model, &mut task, &args, &device).unwrap().1;
    (summary.peak_mem_bytes.unwrap(), params)
}

#[test]
fn state_on_disk_is_not_held_in_memory() {
    let (in_memory, params) = peak(&[]);
    let dir = tempfile::tempdir().unwrap();
    let (on_disk, _) = peak(&["--offload-dir", dir.path().to_str().unwrap()]);
    let state = 8 * params;
    // The largest parameter's state (an MLP matrix, 256 x 1024), read in and written back
    // while the step holds it.
    let read_in = 8 * 256 * 1024;
    eprintln!(
        "peak: {in_memory} B with the state in memory, {on_disk} B on disk (state {state} B)"
    );
    // Saturating: a test binary built with --release wraps a negative difference around.
    let lowered = in_memory.saturating_sub(on_disk);
    assert!(
        lowered >= state - 2 * read_in,
        "the state on disk lowered the peak by {lowered} B of its {state} B"
    );
}
