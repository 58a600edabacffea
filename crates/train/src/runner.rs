//! The training loop (Fabric-like): gradient accumulation, global-norm clipping, the
//! optimizer and its schedule, per-step metrics, and the closing report.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::optim::{LrSchedule, ParamOptimizer, clip_global_norm, tensor_bytes};
use crate::report::{ModelStateBytes, RunSummary, Throughput};
use crate::{TrainArgs, TrainError, memory, speed};

/// What a training example plugs into the runner.
pub trait TrainTask {
    type Model: Module;
    type Batch;

    /// The next training micro-batch for this rank.
    fn next_batch(&mut self, device: &Device) -> Self::Batch;
    /// Mean loss of one micro-batch, recorded for backward.
    fn loss(&self, model: &Self::Model, batch: Self::Batch) -> Tensor<1>;
    /// Items (tokens or samples) in a micro-batch, for throughput.
    fn items(&self, batch: &Self::Batch) -> usize;
    /// Whether `items` counts tokens (else samples).
    fn counts_tokens(&self) -> bool;
    /// Validation on an eval-mode copy of the model: (loss, accuracy if any).
    fn evaluate(&mut self, model: &Self::Model) -> (f64, Option<f64>);
}

/// Per-step numbers, as written to `--metrics-csv`.
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    pub step: usize,
    pub lr: f64,
    pub loss: f64,
    pub grad_norm: f64,
    pub items_per_s: f64,
    pub elapsed_s: f64,
}

/// Trains `model` on `task` as `args` say; returns the trained model and the run summary.
pub fn train<T: TrainTask>(
    mut model: T::Model,
    task: &mut T,
    args: &TrainArgs,
    device: &Device,
) -> Result<(T::Model, RunSummary), TrainError> {
    args.validate()?;
    let num_params = model.num_params();
    let mut optim = ParamOptimizer::new(args)?;
    let mut schedule = LrSchedule::new(args)?;
    let mut csv = args
        .metrics_csv
        .as_ref()
        .map(|path| MetricsCsv::create(path))
        .transpose()?;
    let peak_flops = speed::peak_gemm_flops(device);
    let progress = progress_bar(args.max_steps as u64);

    burnscale_nn::dropout::seed(args.seed);
    memory::reset_peak();
    let start = Instant::now();
    let mut items = 0usize;
    // Time in training steps, without evaluations: what throughput divides by.
    let mut train_s = 0.0;
    let mut last = StepMetrics {
        step: 0,
        lr: 0.0,
        loss: f64::NAN,
        grad_norm: 0.0,
        items_per_s: 0.0,
        elapsed_s: 0.0,
    };
    for step in 1..=args.max_steps {
        let step_start = Instant::now();
        let mut accumulator = GradientsAccumulator::<T::Model>::new();
        let mut step_loss = 0.0;
        let mut step_items = 0;
        for _ in 0..args.accumulate {
            let batch = task.next_batch(device);
            step_items += task.items(&batch);
            let loss = task.loss(&model, batch) / args.accumulate as f64;
            step_loss += loss.clone().into_scalar::<f32>() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            accumulator.accumulate(&model, grads);
        }
        if !step_loss.is_finite() {
            return Err(TrainError::NonFiniteLoss {
                step,
                loss: step_loss,
            });
        }
        let mut grads = accumulator.grads();
        let grad_norm = clip_global_norm(&model, &mut grads, args.grad_clip);
        let lr = schedule.next_lr();
        model = optim.step(lr, model, grads);
        items += step_items;

        let step_s = step_start.elapsed().as_secs_f64();
        train_s += step_s;
        last = StepMetrics {
            step,
            lr,
            loss: step_loss,
            grad_norm,
            items_per_s: step_items as f64 / step_s,
            elapsed_s: start.elapsed().as_secs_f64(),
        };
        if let Some(csv) = csv.as_mut() {
            csv.write(&last)?;
        }
        progress.set_position(step as u64);
        progress.set_message(format!(
            "loss {:.4}  {:.0} {}/s",
            last.loss,
            last.items_per_s,
            if task.counts_tokens() {
                "tok"
            } else {
                "samples"
            }
        ));
        if args.eval_interval > 0
            && step.is_multiple_of(args.eval_interval)
            && step < args.max_steps
        {
            let (val_loss, acc) = task.evaluate(&model.valid());
            progress.suspend(|| {
                eprintln!(
                    "step {step}: train loss {:.4}, val loss {val_loss:.4}{}",
                    last.loss,
                    acc.map(|a| format!(", accuracy {:.2}%", 100.0 * a))
                        .unwrap_or_default()
                )
            });
        }
    }
    progress.finish_and_clear();
    let elapsed_s = start.elapsed().as_secs_f64();
    let peak_mem = memory::peak_bytes();

    let (val_loss, accuracy) = task.evaluate(&model.valid());

    let model_state = ModelStateBytes {
        params: param_bytes(&model),
        grads: optim.last_grad_bytes(),
        optimizer: optim.state_bytes(),
    };
    let items_per_s = items as f64 / train_s;
    let throughput = if task.counts_tokens() {
        Throughput::Tokens(items_per_s)
    } else {
        Throughput::Samples(items_per_s)
    };
    let summary = RunSummary::new(
        args,
        last.step,
        last.loss,
        val_loss,
        accuracy,
        elapsed_s,
        peak_mem,
        num_params,
        model_state,
        throughput,
        peak_flops,
    );
    if let Some(path) = &args.summary_json {
        summary.write_json(path)?;
    }
    Ok((model, summary))
}

/// Bytes held by the parameters of `model`.
pub fn param_bytes<M: Module>(model: &M) -> usize {
    struct Count(usize);
    impl burn::module::ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0 += tensor_bytes(&param.val());
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

fn progress_bar(len: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta}] {msg}")
    {
        bar.set_style(style);
    }
    bar
}

struct MetricsCsv {
    out: BufWriter<File>,
    path: std::path::PathBuf,
}

impl MetricsCsv {
    fn create(path: &std::path::Path) -> Result<Self, TrainError> {
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        writeln!(out, "step,lr,loss,grad_norm,items_per_s,elapsed_s").map_err(io)?;
        Ok(Self {
            out,
            path: path.to_path_buf(),
        })
    }

    fn write(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        writeln!(
            self.out,
            "{},{:e},{},{},{:.1},{:.3}",
            m.step, m.lr, m.loss, m.grad_norm, m.items_per_s, m.elapsed_s
        )
        .and_then(|_| self.out.flush())
        .map_err(|source| TrainError::Io {
            path: self.path.clone(),
            source,
        })
    }
}
