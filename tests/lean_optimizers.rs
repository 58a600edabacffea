//! The lean optimizers. 8-bit AdamW: against the numpy reference of the same quantization
//! (`scripts/gen_adam8bit_fixture.py`), shard by shard against the whole tensor, and under
//! every strategy against the plain Burn loop. Adafactor: against a numpy transcription of HF
//! transformers' step (`scripts/gen_adafactor_fixture.py`), and under every strategy against
//! burn-optim's own Adafactor in the plain loop. (Their training curves against f32 AdamW's
//! are in `mingpt_train.rs`.)

use std::collections::HashMap;

use burn::module::{Module, Param, ParamId};
use burn::optim::{AdafactorConfig, GradientsParams, Optimizer, RecordState, StateSink};
use burn::prelude::*;
use burnscale::collective::run_ranks;
use burnscale::collective::threads::DEFAULT_TIMEOUT;
use burnscale::equivalence::{ADAFACTOR, ADAM8BIT, KEPT_GATHERED};
use burnscale::shard::{layout, params};
use burnscale::train::{ParamOptimizer, TrainArgs};
use burnscale_train::adafactor::Adafactor;
use burnscale_train::adam8bit::{AdamW8bit, AdamW8bitState, dynamic_map};

mod common;
use common::{assert_every_strategy_matches_plain, assert_matches_plain};

/// The fixture's fields, read from its JSON.
struct Fixture(serde_json::Value);

impl Fixture {
    fn floats(&self, key: &str) -> Vec<f32> {
        floats(&self.0[key])
    }

    fn scalar(&self, key: &str) -> f64 {
        self.0[key]
            .as_f64()
            .unwrap_or_else(|| panic!("fixture `{key}`"))
    }

    fn codes(&self, key: &str) -> Vec<u8> {
        let codes = self.0[key]
            .as_array()
            .unwrap_or_else(|| panic!("fixture `{key}`"));
        codes.iter().map(|c| c.as_u64().unwrap() as u8).collect()
    }
}

fn floats(value: &serde_json::Value) -> Vec<f32> {
    let values = value.as_array().expect("an array of numbers");
    values.iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

fn tensor(values: &[f32], shape: [usize; 2]) -> Tensor<2> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex())
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// The state's tensors by name (`moment_1.codes`, ...), as u8 codes or f32 values.
fn flattened(state: &AdamW8bitState<2>) -> StateSink {
    let mut sink = StateSink::default();
    state.state_flatten("p", &mut sink);
    sink
}

fn state_tensor(sink: &StateSink, name: &str) -> TensorData {
    let (_, data) = sink
        .tensors
        .iter()
        .find(|(n, _)| n == &format!("p.{name}"))
        .unwrap_or_else(|| panic!("no `{name}` in the state"));
    data.clone()
}

/// The fixture's three steps, codes and absmax. Every operation is IEEE f32 on both sides
/// (no fused multiply-add, exact sqrt and division), so the parameters agree to the bit on
/// any x86-64 CPU; the margin (4 ulps, and a code one step away at 1 in 1,000 elements)
/// is for a backend that fuses or reorders an expression, never for a different algorithm.
#[test]
fn matches_the_numpy_reference_of_the_same_quantization() {
    let f = Fixture(
        serde_json::from_str(include_str!("fixtures/adam8bit/steps.json")).expect("fixture"),
    );
    assert_eq!(dynamic_map(true).to_vec(), f.floats("signed_map"));
    assert_eq!(dynamic_map(false).to_vec(), f.floats("unsigned_map"));
    let optim = AdamW8bit {
        beta_1: f.scalar("beta1") as f32,
        beta_2: f.scalar("beta2") as f32,
        epsilon: f.scalar("epsilon") as f32,
        weight_decay: f.scalar("weight_decay") as f32,
    };
    let shape = [0, 1].map(|i| f.0["shape"][i].as_u64().unwrap() as usize);
    let (lr, grads, after) = (f.scalar("lr"), &f.0["grads"], &f.0["params_after"]);
    let (mut param, mut state) = (tensor(&f.floats("param"), shape), None);
    for step in 0..3 {
        let (grad, want) = (floats(&grads[step]), floats(&after[step]));
        let (next, next_state) = optim.step(lr, param, tensor(&grad, shape), state);
        for (i, (got, want)) in values(next.clone()).iter().zip(&want).enumerate() {
            let ulps = (got - want).abs() / (want.abs().max(1e-6) * f32::EPSILON);
            assert!(ulps <= 4.0, "step {step}, element {i}: {got}, numpy {want}");
        }
        (param, state) = (next, next_state);
    }
    let sink = flattened(&state.expect("a state after three steps"));
    for moment in ["moment_1", "moment_2"] {
        let (codes, absmax) = (
            f.codes(&format!("{moment}_codes")),
            f.floats(&format!("{moment}_absmax")),
        );
        let got = state_tensor(&sink, &format!("{moment}.codes"));
        assert_eq!(
            got.dtype(),
            burn::tensor::DType::U8,
            "{moment} codes are bytes"
        );
        let got = got.as_bytes();
        assert_eq!(got.len(), codes.len());
        let off: Vec<usize> = (0..codes.len()).filter(|&i| got[i] != codes[i]).collect();
        assert!(
            off.len() * 1000 <= codes.len() && off.iter().all(|&i| got[i].abs_diff(codes[i]) == 1),
            "{moment}: {} codes differ from numpy's, first at {:?}",
            off.len(),
            off.first()
        );
        let got = state_tensor(&sink, &format!("{moment}.absmax"));
        let got = got.try_to_vec::<f32>().unwrap();
        for (g, w) in got.iter().zip(&absmax) {
            assert!(
                (g - w).abs() <= 4.0 * f32::EPSILON * w.abs(),
                "{moment} absmax {g}, {w}"
            );
        }
        // The padding row of the parameter stays zero, its blocks' absmax 0.
        assert_eq!(&got[got.len() - 2..], &[0.0, 0.0]);
    }
    let last = values(param);
    assert!(last[last.len() - shape[1]..].iter().all(|&v| v == 0.0));
}

/// Blocks run along rows, so a shard of rows (zero-padded as the engine pads its last
/// ranks) steps exactly as those rows of the whole tensor: bit for bit, over several steps.
#[test]
fn a_shard_of_rows_steps_as_those_rows_of_the_whole() {
    let (rows, cols) = (7, 600); // three blocks per row, the last one short
    let optim = AdamW8bit {
        beta_1: 0.9,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    let value =
        |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 - 1001.0) * 1e-4;
    let whole_param: Vec<f32> = (0..rows * cols).map(|i| value(i, 0)).collect();
    let grads: Vec<Vec<f32>> = (1..=4)
        .map(|s| {
            (0..rows * cols)
                .map(|i| value(i, s) * (s as f32).powi(3))
                .collect()
        })
        .collect();
    let run = |from: usize, real: usize, padded: usize| {
        let take = |v: &[f32]| {
            let mut rows_of = v[from * cols..(from + real) * cols].to_vec();
            rows_of.resize(padded * cols, 0.0);
            tensor(&rows_of, [padded, cols])
        };
        let (mut param, mut state) = (take(&whole_param), None);
        for grad in &grads {
            (param, state) = optim.step(1e-2, param, take(grad), state);
        }
        values(param)[..real * cols].to_vec()
    };
    let whole = run(0, rows, rows);
    // Three ranks own ceil(7 / 3) = 3 rows each; the last holds one real row and two padding.
    let sharded: Vec<f32> = [(0, 3), (3, 3), (6, 1)]
        .into_iter()
        .flat_map(|(from, real)| run(from, real, 3))
        .collect();
    assert_eq!(whole, sharded);
}

/// Every strategy takes the plain Burn loop's 8-bit steps. On one rank the gradients are the
/// plain loop's to the last bit. On several, they differ from it by f32 rounding (partial
/// sums reduced across ranks), and a moment that lies on a boundary between two codes may
/// round to the other one: the check's tolerance for 8-bit state allows that (one code step,
/// 1.4% to 100% of one element's moment, within a tensor's update).
#[test]
fn every_strategy_takes_the_plain_8bit_steps() {
    every_strategy(ADAM8BIT);
}

fn every_strategy(flags: &[&str]) {
    assert_every_strategy_matches_plain(flags, 1..=3);
}

/// Adafactor's column means, row-factor mean and update and parameter RMS span every rank's
/// rows: every strategy takes burn-optim's single-device steps (which share no code with
/// ours; without weight decay, which burn-optim's scales otherwise under a relative step),
/// and, with decay, our own single-device steps.
#[test]
fn every_strategy_takes_burn_optims_adafactor_steps() {
    every_strategy(&[ADAFACTOR, &["--weight-decay", "0"]].concat());
    every_strategy(ADAFACTOR);
}

/// Both optimizers' state stepped on the host (`--offload optimizer`). (In 16 bits the plain
/// f32 loop is no reference for 8-bit AdamW, as for AdamW: `mingpt_train.rs` checks that it
/// trains there; Adafactor's relative step is checked there in `precision.rs`.)
#[test]
fn lean_optimizers_offloaded() {
    for optimizer in [ADAFACTOR, ADAM8BIT] {
        let flags = [optimizer, &["--offload", "optimizer"]].concat();
        assert_matches_plain("zero2", 2, &flags);
        assert_matches_plain("zero3", 3, &flags);
    }
}

/// Adafactor against HF transformers' step (written out in numpy float32 by
/// `scripts/gen_adafactor_fixture.py`, an implementation ours does not share): a matrix
/// (factored second moments) and a vector, three steps each, with the first moment and weight
/// decay at a fixed step, without either at a relative step, and with both at a relative
/// step. Summation orders differ (numpy's pairwise, ours by rows), so the bound is a few ulps
/// of the parameters (about 0.5 in size), far below any step (1e-3 and up).
#[test]
fn adafactor_takes_hf_transformers_steps() {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/adafactor/steps.json")).expect("fixture");
    for case in fixture["cases"].as_array().expect("cases") {
        let adafactor = burnscale_train::adafactor::Adafactor {
            beta_1: case["beta1"].as_f64(),
            weight_decay: case["weight_decay"].as_f64().unwrap(),
            relative_step: case["relative_step"].as_bool().unwrap(),
        };
        let lr = case["lr"].as_f64().unwrap();
        let worst = [
            hf_steps::<2>(&adafactor, lr, &case["matrix"]),
            hf_steps::<1>(&adafactor, lr, &case["vector"]),
        ];
        let what = format!("{adafactor:?}");
        for (part, worst) in ["matrix", "vector"].iter().zip(worst) {
            eprintln!("{what} {part}: within {worst:.1e} of HF's");
            assert!(
                worst <= 1e-6,
                "{what} {part}: {worst:e} from HF's parameters"
            );
        }
    }
}

/// The largest difference from HF's parameters over the fixture's three steps of `part`.
fn hf_steps<const D: usize>(adafactor: &Adafactor, lr: f64, part: &serde_json::Value) -> f32 {
    let shape: Vec<usize> = part["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let tensor = |values: &serde_json::Value| {
        let data = TensorData::new(floats(values), shape.clone());
        Tensor::<D>::from_data(data, &Device::flex())
    };
    let (mut param, mut state) = (tensor(&part["param"]), None);
    let mut worst = 0f32;
    for (grad, want) in part["grads"]
        .as_array()
        .unwrap()
        .iter()
        .zip(part["params_after"].as_array().unwrap())
    {
        (param, state) = adafactor.step(lr, param, tensor(grad), state);
        let got = param.clone().into_data().try_to_vec::<f32>().unwrap();
        worst = common::nan_max(worst, common::worst_abs_diff(&got, &floats(want)));
    }
    worst
}

/// Accumulation with clipping under every strategy, and ZeRO-3 with checkpointing, kept
/// gathered and with its shards offloaded, with each lean optimizer.
#[test]
fn lean_optimizers_compose_with_the_techniques() {
    for optimizer in [ADAFACTOR, ADAM8BIT] {
        every_strategy(&[optimizer, &["--accumulate", "2", "--grad-clip", "0.05"]].concat());
        for extra in [
            &["--checkpoint-activations"][..],
            KEPT_GATHERED,
            &["--offload", "params"],
        ] {
            assert_matches_plain("zero3", 2, &[optimizer, extra].concat());
        }
    }
}

/// With HF's first moment, against burnscale's Adafactor on one device in the plain loop.
#[test]
fn every_strategy_takes_the_adafactor_steps_with_a_first_moment() {
    every_strategy(&[ADAFACTOR, &["--beta1", "0.9"]].concat());
}

/// A matrix, a vector and a rank-3 tensor whose first dims 3 ranks split unevenly.
#[derive(Module, Debug)]
struct Three {
    matrix: Param<Tensor<2>>,
    vector: Param<Tensor<1>>,
    cube: Param<Tensor<3>>,
}

fn pattern(n: usize, salt: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 - 1001.0) * scale)
        .collect()
}

fn three(salt: usize, scale: f32) -> Three {
    let device = Device::default().autodiff();
    let param = |dims: Vec<usize>| {
        let n = dims.iter().product();
        Tensor::<1>::from_data(TensorData::new(pattern(n, salt, scale), [n]), &device)
    };
    Three {
        matrix: Param::from_tensor(param(vec![7, 5]).reshape([7, 5])),
        vector: Param::from_tensor(param(vec![7])),
        cube: Param::from_tensor(param(vec![5, 3, 4]).reshape([5, 3, 4])),
    }
}

/// Each of `module`'s parameters' shards for `rank` of `world`, with the shard's dims.
fn shards_of(module: &Three, world: usize, rank: usize) -> [(Tensor<1>, Vec<usize>); 3] {
    let slots = layout::slots(module, world);
    let by_id: HashMap<ParamId, &layout::Slot> = slots.iter().map(|s| (s.id, s)).collect();
    let mut shards = params::shards(module, &by_id, rank);
    [module.matrix.id, module.vector.id, module.cube.id]
        .map(|id| (shards.remove(&id).unwrap(), by_id[&id].shard_dims()))
}

/// `full` holding only `rank`'s shards (of `world`), tracked, as a sharded engine steps it.
fn sharded(full: &Three, world: usize, rank: usize) -> Three {
    let ids = [full.matrix.id, full.vector.id, full.cube.id];
    let initial = ids.into_iter().zip(shards_of(full, world, rank)).collect();
    let track = params::Track::AllBut(&Default::default());
    params::set_values(full.clone(), initial, &Device::default().autodiff(), track)
}

/// `rank`'s shards of the gradients `g` (of `world`), under `full`'s parameter ids.
fn shard_grads(g: &Three, full: &Three, world: usize, rank: usize) -> GradientsParams {
    let [(m, md), (v, _), (c, cd)] = shards_of(g, world, rank);
    let mut grads = GradientsParams::new();
    grads.register::<2>(full.matrix.id, m.reshape([md[0], md[1]]));
    grads.register::<1>(full.vector.id, v);
    grads.register::<3>(full.cube.id, c.reshape([cd[0], cd[1], cd[2]]));
    grads
}

/// Every parameter's values, flat, by id.
fn flat(module: &Three) -> HashMap<ParamId, Vec<f32>> {
    params::values(module, None)
        .into_iter()
        .map(|(id, t)| (id, t.into_data().try_to_vec::<f32>().unwrap()))
        .collect()
}

/// Adafactor at a fixed learning rate, each of 2 and 3 thread ranks stepping its padded
/// shard of every parameter (the reductions across ranks inside the step), takes
/// burn-optim's Adafactor steps on the whole tensors, given the same gradients: to f32
/// rounding of the reordered sums.
#[test]
fn sharded_adafactor_steps_as_burn_optims_on_the_whole_tensors() {
    const STEPS: usize = 3;
    let (lr, wd) = (1e-2, 0.1);
    let flags = [
        "--optimizer",
        "adafactor",
        "--lr",
        "1e-2",
        "--weight-decay",
        "0.1",
    ];
    let grads: Vec<Three> = (1..=STEPS).map(|s| three(s, 1e-3 * s as f32)).collect();
    // burn-optim's, whole: decay on the matrices, as the runner splits them.
    let reference = {
        let (decay, no_decay) = (
            AdafactorConfig::new()
                .with_relative_step(false)
                .with_scale_parameter(false),
            AdafactorConfig::new()
                .with_relative_step(false)
                .with_scale_parameter(false),
        );
        let (decay, no_decay) = (decay.with_weight_decay(wd).build(), no_decay.build());
        let p = three(0, 1e-3);
        let (mut m, mut v, mut c) = (
            p.matrix.val().inner(),
            p.vector.val().inner(),
            p.cube.val().inner(),
        );
        let (mut sm, mut sv, mut sc) = (None, None, None);
        for g in &grads {
            (m, sm) = decay.step(lr, m, g.matrix.val().inner(), sm);
            (v, sv) = no_decay.step(lr, v, g.vector.val().inner(), sv);
            (c, sc) = decay.step(lr, c, g.cube.val().inner(), sc);
        }
        let values = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        [values(m), values(v.unsqueeze()), values(c.reshape([1, 60]))]
    };
    for world in [2, 3] {
        let ranks = run_ranks(world, DEFAULT_TIMEOUT, |comm| {
            let rank = comm.rank();
            let full = three(0, 1e-3);
            let ids = [full.matrix.id, full.vector.id, full.cube.id];
            let args = TrainArgs::from_flags(&flags).unwrap();
            let mut optim = ParamOptimizer::new(&args, rank, &full).unwrap();
            let mut module = sharded(&full, world, rank);
            for g in &grads {
                let grads = shard_grads(g, &full, world, rank);
                let (next, result) = optim.step(lr, module, grads, Some(comm));
                result.unwrap();
                module = next;
            }
            // This rank's real rows of the matrix, the vector and the cube, with where the
            // first one starts.
            let values = flat(&module);
            let slots = layout::slots(&full, world);
            ids.map(|id| {
                let slot = slots.iter().find(|s| s.id == id).unwrap();
                let (start, real) = slot.owned_rows(rank);
                let row = slot.numel() / slot.dims[0];
                (start * row, values[&id][..real * row].to_vec())
            })
        })
        .unwrap();
        for (which, want) in reference.iter().enumerate() {
            let mut got = vec![f32::NAN; want.len()];
            for rank in &ranks {
                let (from, rows) = &rank.as_ref().unwrap()[which];
                got[*from..*from + rows.len()].copy_from_slice(rows);
            }
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                    "{world} ranks, parameter {which}, element {i}: {g}, burn-optim {w}"
                );
            }
        }
    }
}

/// Every state file (not the hidden lock files) of the `--offload-dir` runs under `root`
/// whose directories start with `prefix`, cut to 1 byte.
fn cut_short(root: &str, prefix: &str) {
    let entries = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .collect::<Vec<_>>()
    };
    let named =
        |e: &std::fs::DirEntry, start: &str| e.file_name().to_string_lossy().starts_with(start);
    let runs = entries(root.as_ref())
        .into_iter()
        .filter(|e| named(e, prefix));
    for file in runs.flat_map(|run| entries(&run.path())) {
        if !named(&file, ".") {
            let cut = std::fs::File::options().write(true).open(file.path());
            cut.and_then(|f| f.set_len(1)).unwrap();
        }
    }
}

/// A rank whose offloaded Adafactor state cannot be read (its files cut short on disk) still
/// joins the step's two reductions across the ranks, and returns the error after them: the
/// other rank steps, rather than waiting in a reduction its peer never entered.
#[test]
fn a_rank_that_cannot_read_its_offloaded_state_leaves_no_one_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_string_lossy().to_string();
    let flags = [
        "--optimizer",
        "adafactor",
        "--offload",
        "optimizer",
        "--offload-dir",
        &root,
    ];
    let world = 2;
    let outcomes = run_ranks(world, std::time::Duration::from_secs(30), |comm| {
        let rank = comm.rank();
        let full = three(0, 1e-3);
        let args = TrainArgs::from_flags(&flags).unwrap();
        let mut optim = ParamOptimizer::new(&args, rank, &full).unwrap();
        let mut module = sharded(&full, world, rank);
        let mut outcomes = Vec::new();
        for step in 1..=2 {
            if step == 2 && rank == 1 {
                cut_short(&root, "rank1-");
            }
            let grads = shard_grads(&three(step, 1e-3), &full, world, rank);
            let (next, result) = optim.step(1e-2, module, grads, Some(comm));
            outcomes.push(result.map_err(|e| e.to_string()));
            module = next;
        }
        outcomes
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect::<Vec<_>>();
    assert!(outcomes[0].iter().all(Result::is_ok), "{outcomes:?}");
    assert!(outcomes[1][0].is_ok(), "{outcomes:?}");
    let err = outcomes[1][1].as_ref().unwrap_err();
    assert!(err.contains("truncated"), "{err}");
}
