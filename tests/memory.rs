//! The counting allocator measures what the process really holds.

mod common;

use burn::prelude::*;
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::tasks::NextToken;
use burnscale::train::memory::{self, CountingAllocator};
use burnscale::train::{TrainArgs, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// `--plan`'s probe draws batches before any step: a training batch above `--batch-size`, and an
/// empty validation batch, are refused there (the empty one ended the process in the probe's
/// forward).
#[test]
fn the_plans_probe_refuses_the_batches_a_run_refuses() {
    common::in_turn(|| {
        let device = Device::default().autodiff();
        let tokens: Vec<i64> = (0..500).map(|i| (i * 7 % 11) as i64).collect();
        let task = |batch| {
            NextToken::new(tokens.clone(), 8, batch, 7)
                .and_then(|t| t.with_validation(tokens.clone(), 8, 2))
                .unwrap()
        };
        let args =
            TrainArgs::from_flags(&["--plan", "--batch-size", "8", "--max-steps", "1"]).unwrap();
        let model = || Gpt::new(&GptConfig::tiny(), &device).unwrap();
        let err = train(model(), &mut task(16), &args, &device).unwrap_err();
        assert!(err.to_string().contains("holds 16 sequences"), "{err}");
        let err = train(
            model(),
            &mut common::EmptyValidation(task(8)),
            &args,
            &device,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("validation batch holds no"),
            "{err}"
        );
    })
}

/// The tensor alone is live at some moment after the reset, so the peak holds at least it. Not
/// "what was live before plus the tensor": bytes live before may be freed meanwhile (libtest
/// frees a finished test's captured output after its turn).
#[test]
fn peak_sees_a_tensor_and_reset_forgets_it() {
    common::in_turn(|| {
        let device = Device::default();
        let tensor_bytes = 16 << 20;
        memory::reset_peak();
        let before = memory::live_bytes();
        assert!(before < tensor_bytes / 2, "live before {before}");
        let t = Tensor::<2>::ones([4096, 1024], &device) * 2.0; // 16 MiB
        let sum = t.clone().sum().into_scalar::<f32>();
        assert_eq!(sum, 2.0 * 4096.0 * 1024.0);
        let peak = memory::peak_bytes();
        assert!(peak >= tensor_bytes, "peak {peak} live-before {before}");
        drop(t);
        memory::reset_peak();
        assert!(memory::peak_bytes() < peak);
        assert!(memory::is_counting());
    })
}
