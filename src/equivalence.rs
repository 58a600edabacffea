//! Self-check of the sharding engine: a strategy on this rank's process group takes the same
//! optimizer steps as one device with the same global batch. The tests run it on threads;
//! `examples/shard_check.rs` runs it under mpirun.

use std::sync::Mutex;

use burn::prelude::*;
use burnscale_collective::Communicator;
use burnscale_collective::threads::{DEFAULT_TIMEOUT, ThreadComm};
use burnscale_mingpt::{Gpt, GptConfig};
use burnscale_train::{TrainArgs, TrainError, train_on};

use crate::tasks::NextToken;

/// Samples per optimizer step over all ranks; world sizes 1 to 4 divide it.
pub const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 5;
const LR: f32 = 1e-2;

/// Trains a dropout-free tiny minGPT for 5 steps under `strategy` on `comm` (this rank
/// reading `GLOBAL_BATCH / world` samples per micro-step), and under `single` on this thread
/// with the whole global batch; `extra` flags apply to both. Returns the parameters that
/// differ, one line each (empty: the runs agree).
///
/// Every parameter must agree to 1e-5 relative to its largest value, except the attention
/// key bias (elements [d, 2d) of `c_attn.bias`): softmax is shift-invariant per query, so its
/// exact gradient is zero and backward computes float noise (~1e-10) that depends on
/// summation order; AdamW normalises that noise into updates of up to the learning rate.
/// Those elements must stay within `lr · steps` of each other.
pub fn check(
    comm: &dyn Communicator,
    strategy: &str,
    extra: &[&str],
) -> Result<Vec<String>, TrainError> {
    check_with_dropout(comm, strategy, 0.0, extra)
}

/// [`check`] with dropout in the model. Only a world of one draws the single-device masks
/// (every rank has its own stream), so only there is the comparison meaningful.
pub fn check_with_dropout(
    comm: &dyn Communicator,
    strategy: &str,
    dropout: f64,
    extra: &[&str],
) -> Result<Vec<String>, TrainError> {
    let world = comm.world_size();
    if !GLOBAL_BATCH.is_multiple_of(world) {
        return Err(TrainError::InvalidArgs(format!(
            "the check splits a global batch of {GLOBAL_BATCH}, which {world} ranks do not divide"
        )));
    }
    let sharded = train_tiny(comm, strategy, GLOBAL_BATCH / world, dropout, extra)?;
    let solo = ThreadComm::group(1, DEFAULT_TIMEOUT).remove(0);
    let single = train_tiny(&solo, "single", GLOBAL_BATCH, dropout, extra)?;

    let d = GptConfig::tiny().n_embd;
    let mut differences = Vec::new();
    for ((path, got), (_, want)) in sharded.iter().zip(&single) {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in got.iter().zip(want).enumerate() {
            let key_bias = path.ends_with("c_attn.bias") && (d..2 * d).contains(&i);
            let tolerance = if key_bias {
                LR * STEPS as f32
            } else {
                1e-5 * scale
            };
            if (x - y).abs() > tolerance {
                differences.push(format!(
                    "{path}[{i}] is {x}, single-device {y} (scale {scale:e})"
                ));
            }
        }
    }
    Ok(differences)
}

/// Every parameter by path after training.
fn train_tiny(
    comm: &dyn Communicator,
    strategy: &str,
    batch: usize,
    dropout: f64,
    extra: &[&str],
) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
    let device = Device::default().autodiff();
    let model = {
        // Flex seeds one process-wide generator: ranks that are threads take turns.
        static INIT: Mutex<()> = Mutex::new(());
        let _init = INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        device.seed(11);
        let model = Gpt::new(&GptConfig::tiny().with_dropout(dropout), &device)
            .map_err(|e| TrainError::InvalidArgs(e.to_string()))?;
        burnscale_shard::host::materialize(&model);
        model
    };
    let (batch, steps, lr) = (batch.to_string(), STEPS.to_string(), LR.to_string());
    let base = [
        "--strategy",
        strategy,
        "--batch-size",
        &batch,
        "--max-steps",
        &steps,
        "--lr",
        &lr,
        "--seed",
        "11",
    ];
    let args = TrainArgs::from_flags(&[&base[..], extra].concat())
        .map_err(|e| TrainError::InvalidArgs(e.to_string()))?;
    let tokens: Vec<i64> = (0..3000).map(|i| ((i * 7 + i / 97) % 11) as i64).collect();
    let mut task = NextToken::new(tokens, 8, args.batch_size, 11)?;
    let (model, _) = train_on(comm, model, &mut task, &args, &device)?;
    let values = burnscale_shard::host::values(&model);
    Ok(burnscale_shard::layout::slots(&model, 1)
        .into_iter()
        .map(|slot| (slot.path, values[&slot.id].clone()))
        .collect())
}
