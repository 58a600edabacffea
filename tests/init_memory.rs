//! `--init-on-device`: a bf16 model created directly in bf16 peaks at about half the memory
//! of creating it in f32 and casting (the article: 1.24 GB vs 0.65 GB). A test binary of
//! its own, as the counting allocator's peak is process-wide (and its tests take turns).

mod common;

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burnscale::mingpt::{Gpt, GptConfig};
use burnscale::precision::{cast, init_in, param_dtypes};
use burnscale::shard::params::materialize;
use burnscale::train::memory::{self, CountingAllocator};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn init_in_bf16_peaks_at_half_of_f32_then_cast() {
    common::in_turn(|| {
        let device = Device::default();
        // ~6.8M parameters; the largest tensor (wte, 512 x 256) is 2% of them.
        let config = GptConfig::new(8, 4, 256, 512, 128);
        let build = || Gpt::new(&config, &device).unwrap();
        let (a, f32_then_cast) = memory::peak_added_by(|| {
            let model = build();
            materialize(&model);
            cast(model, FloatDType::BF16)
        });
        drop(a);
        let (b, direct) = memory::peak_added_by(|| {
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
    })
}

#[test]
fn zero3_shards_a_lazy_model_without_any_rank_holding_it_whole() {
    common::in_turn(|| {
        use burnscale::collective::run_ranks;
        use burnscale::collective::threads::DEFAULT_TIMEOUT;
        use burnscale::shard::{Sharded, Strategy, host, params};

        let device = Device::default().autodiff();
        let config = GptConfig::new(8, 4, 256, 512, 128);
        let model_bytes = 4 * config.num_params();
        let lazy = |seed| {
            device.seed(seed);
            Gpt::new(&config, &device).unwrap()
        };
        let in_order = |model: &Gpt| {
            let values = host::values(model);
            params::param_ids(model)
                .iter()
                .map(|id| values[id].clone())
                .collect::<Vec<_>>()
        };
        // Rank 0 draws the parameters in the order a single device does.
        let single = lazy(7);
        materialize(&single);
        let want = in_order(&single);
        drop(single);

        // One model per rank, as the runner hands them out: clones share each lazy parameter's
        // value, so none may outlive the sharding.
        let model = lazy(7);
        let models =
            std::sync::Mutex::new(vec![model.clone(), model.clone(), model.clone(), model]);
        let before = memory::live_bytes();
        memory::reset_peak();
        let gathered = run_ranks(4, DEFAULT_TIMEOUT, |comm| {
            let model = models.lock().unwrap().pop().unwrap();
            let engine = Sharded::new(Strategy::Zero3, model, comm, &device).unwrap();
            comm.barrier().unwrap();
            let setup_peak = memory::peak_bytes().saturating_sub(before);
            comm.barrier().unwrap();
            (setup_peak, in_order(&engine.full_model().unwrap()))
        })
        .unwrap();
        let (setup_peak, got) = gathered.into_iter().next().unwrap().unwrap();
        assert!(
            got == want,
            "zero3's initial parameters differ from a single device's"
        );
        // The four ranks' shards add up to one model; holding it whole anywhere adds another.
        let ratio = setup_peak as f64 / model_bytes as f64;
        eprintln!(
            "zero3 setup on 4 thread ranks from a lazy model: peak {setup_peak} B, {ratio:.2}x the f32 model ({model_bytes} B)"
        );
        assert!(ratio < 1.4, "zero3 setup peaked at {ratio:.2}x the model");
    })
}
