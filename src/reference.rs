//! The plain training loop the engine is checked against, written with Burn alone: the
//! model's loss on the whole global batch, `backward`, Burn's gradient accumulator and a
//! burn-optim optimizer. It shares no code with the engine's step or the runner (no host
//! vectors, buckets, collectives, loss scaler or per-parameter optimizer glue), so a bug
//! there cannot hide by appearing on both sides of a comparison. It reads the device once a
//! step (the losses and the gradients' sums of squares, for clipping), so that it is also the
//! speed floor `benches/mingpt_throughput.rs` puts beside the engine. What it does share is the
//! starting point: the model (built by the caller), the parameters `--freeze` marks frozen
//! (`burnscale_train::freeze`, Burn's `set_require_grad(false)` on the paths named) and, under
//! `*-true`, its cast to 16 bits (`burnscale_precision::cast`, whose dtypes
//! `tests/precision.rs` checks on its own).

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdafactorConfig, AdamConfig, AdamWConfig, GradientsAccumulator, GradientsParams,
    ModuleOptimizer, SgdConfig,
};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burnscale_nn::BlockModel;
use burnscale_train::adafactor::Adafactor;
use burnscale_train::adam8bit::AdamW8bit;
use burnscale_train::{
    AdamSettings, BatchPart, MIN_8BIT_SIZE, OptimizerKind, Schedule, TrainArgs, TrainTask,
};

/// What the plain loop can run: the optimizer settings of `TrainArgs` that a check uses.
#[derive(Debug, Clone)]
pub struct PlainConfig {
    pub optimizer: PlainOptimizer,
    pub lr: f64,
    /// Linear warm-up steps, then (when given: the final share of `lr`) a cosine to the last
    /// step; else the rate stays `lr`.
    pub warmup: usize,
    pub cosine_to: Option<f64>,
    /// Decoupled weight decay on rank >= 2 parameters only (as the runner's nanoGPT split).
    pub weight_decay: f64,
    /// Global L2 norm over all gradients (0: no clipping).
    pub grad_clip: f64,
    pub accumulate: usize,
    pub steps: usize,
    /// The dtype the weights are stored and trained in.
    pub dtype: FloatDType,
    /// The paths (or prefixes) of the parameters that do not train: Burn's autodiff gives
    /// them no gradient, and burn-optim steps only what has one.
    pub freeze: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PlainOptimizer {
    /// Without momentum (0) an update proportional to the gradient, so any error in its
    /// scale shows; with it, the velocity each parameter keeps (torch.optim's SGD momentum).
    Sgd {
        momentum: f64,
    },
    /// Adam with its weight decay as an L2 term in the gradient (torch.optim's `Adam`).
    Adam(AdamSettings),
    AdamW(AdamSettings),
    /// burn-optim's own Adafactor (an implementation the runner does not share), or
    /// burnscale's on one device when it keeps a first moment (burn-optim's has none) or
    /// decays a relative step (burn-optim's decays it by the learning rate alone).
    Adafactor {
        beta1: Option<f64>,
        relative_step: bool,
    },
    /// 8-bit AdamW on the matrices of at least `min_size` elements, AdamW on the rest.
    AdamW8bit {
        adam: AdamSettings,
        min_size: usize,
    },
}

/// What a run did at every step, and where it ended.
#[derive(Debug, Clone)]
pub struct Trajectory {
    /// The mean loss over the global batch (all micro-batches of the step).
    pub losses: Vec<f64>,
    /// The global L2 norm of the averaged gradients, before clipping.
    pub grad_norms: Vec<f64>,
    /// Each step's seconds, its optimizer step queued (on an eager backend, done): what a
    /// benchmark times.
    pub step_s: Vec<f64>,
}

impl PlainConfig {
    /// The plain counterpart of `args`. Fails naming what the plain loop does not model
    /// (8-bit AdamW's 32-bit embedding state): a check must not compare against a reference
    /// that silently trains differently.
    pub fn from_args(args: &TrainArgs) -> Result<Self, String> {
        let adam = args.adam();
        let optimizer = match args.optimizer {
            OptimizerKind::Sgd => PlainOptimizer::Sgd {
                momentum: args.sgd_momentum(),
            },
            OptimizerKind::Adam => PlainOptimizer::Adam(adam),
            OptimizerKind::Adamw => PlainOptimizer::AdamW(adam),
            OptimizerKind::Adam8bit if !args.embedding_state_32bit => PlainOptimizer::AdamW8bit {
                adam,
                min_size: args.min_8bit_size.unwrap_or(MIN_8BIT_SIZE),
            },
            OptimizerKind::Adafactor => PlainOptimizer::Adafactor {
                beta1: args.beta1,
                relative_step: args.adafactor_relative_step,
            },
            OptimizerKind::Adam8bit => {
                return Err(
                    "the plain reference runs adam8bit without --embedding-state-32bit".into(),
                );
            }
        };
        let cosine_to = (args.schedule() == Schedule::Cosine)
            .then(|| args.min_lr_ratio.unwrap_or(burnscale_train::MIN_LR_RATIO));
        Ok(Self {
            optimizer,
            lr: args.lr(),
            warmup: args.warmup_steps,
            cosine_to,
            weight_decay: args.weight_decay(),
            grad_clip: args.grad_clip,
            accumulate: args.accumulate,
            steps: args.max_steps,
            dtype: args.precision.param_dtype(),
            freeze: args.freeze.clone(),
        })
    }

    /// Trains `model` on the whole global batches of `task` (each rank's slices together)
    /// on `device` (an autodiff device); returns the trajectory and the trained model. Panics
    /// if `freeze` names no parameter of `model`.
    pub fn train<T: TrainTask>(
        &self,
        model: T::Model,
        task: &mut T,
        device: &Device,
    ) -> (Trajectory, T::Model) {
        let model = burnscale_train::freeze::freeze(model, &self.freeze)
            .unwrap_or_else(|e| panic!("the plain loop's --freeze: {e}"));
        let mut model = if self.dtype == FloatDType::F32 {
            model
        } else {
            burnscale_precision::cast(model, self.dtype)
        };
        let mut optim = self.optimizer(&model);
        let mut trajectory = Trajectory {
            losses: Vec::with_capacity(self.steps),
            grad_norms: Vec::with_capacity(self.steps),
            step_s: Vec::with_capacity(self.steps),
        };
        for step in 1..=self.steps {
            let start = std::time::Instant::now();
            let mut accumulator = GradientsAccumulator::new();
            let mut losses = Vec::with_capacity(self.accumulate);
            let batches: Vec<_> = (0..self.accumulate)
                .map(|_| task.next_batch(device, BatchPart::WHOLE))
                .collect();
            // The step's loss is the mean over its items: a model whose loss ignores some
            // targets weighs each micro-batch by the items it scores.
            let items: Option<Vec<Tensor<1>>> =
                batches.iter().map(|(_, t)| model.loss_items(t)).collect();
            let counted = items.map(|items| {
                let total = Tensor::cat(items.clone(), 0).sum().clamp_min(1.0);
                (items, total)
            });
            for (i, (input, target)) in batches.into_iter().enumerate() {
                let loss = model.loss(input, target);
                let loss = match &counted {
                    Some((items, total)) => loss * items[i].clone() / total.clone(),
                    None => loss / self.accumulate as f64,
                };
                losses.push(loss.clone().detach().cast(FloatDType::F32));
                accumulator
                    .accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            let mut grads = accumulator.grads();
            // One read from the device per step: the micro-batches' losses, then each
            // gradient's sum of squares, added up on the host in f64.
            let read = Tensor::cat([losses, squared_sums(&model, &grads)].concat(), 0)
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("converted to f32");
            let (losses, squares) = read.split_at(self.accumulate);
            let loss_sum = losses.iter().map(|&l| f64::from(l)).sum::<f64>();
            let norm = squares.iter().map(|&s| f64::from(s)).sum::<f64>().sqrt();
            if self.grad_clip > 0.0 && norm > self.grad_clip {
                grads = scaled(&model, grads, self.grad_clip / (norm + 1e-6));
            }
            trajectory.losses.push(loss_sum);
            trajectory.grad_norms.push(norm);
            model = optim.step(self.lr_at(step), model, grads);
            trajectory.step_s.push(start.elapsed().as_secs_f64());
        }
        (trajectory, model)
    }

    /// The rate of (1-based) step `step`: transformers' `get_cosine_with_min_lr_schedule_with_warmup`
    /// lambda, written from its definition (a linear warm-up from `lr / warmup`; then
    /// `min + (1 - min) * (1 + cos(pi * progress)) / 2` of `lr`, progress from 0 after the
    /// warm-up to 1 at the last step).
    fn lr_at(&self, step: usize) -> f64 {
        if step <= self.warmup {
            return self.lr * step as f64 / self.warmup as f64;
        }
        let Some(min) = self.cosine_to else {
            return self.lr;
        };
        let progress = (step - self.warmup) as f64 / (self.steps - self.warmup).max(1) as f64;
        let factor = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.lr * (min + (1.0 - min) * factor)
    }

    /// One optimizer for the parameters without decay, one with decay for matrices and
    /// embeddings (Burn's parameter groups); under 8-bit AdamW, a third for the matrices it
    /// quantizes.
    fn optimizer<M: Module>(&self, model: &M) -> ModuleOptimizer {
        let decay =
            (self.weight_decay > 0.0).then(|| WeightDecayConfig::new(self.weight_decay as f32));
        let wd = self.weight_decay as f32;
        match self.optimizer {
            PlainOptimizer::Sgd { momentum } => {
                let sgd = || {
                    SgdConfig::new().with_momentum(
                        // torch.optim.SGD's dampening (burn-optim's default is 0.1).
                        (momentum > 0.0).then(|| {
                            MomentumConfig::new()
                                .with_momentum(momentum)
                                .with_dampening(0.0)
                        }),
                    )
                };
                sgd().init().with_group(
                    ParamGroup::from_ids(matrix_ids(model)),
                    sgd().with_weight_decay(decay).build(),
                    None,
                )
            }
            PlainOptimizer::Adam(adam) => {
                let config = || {
                    AdamConfig::new()
                        .with_beta_1(adam.beta1 as f32)
                        .with_beta_2(adam.beta2 as f32)
                        .with_epsilon(adam.epsilon as f32)
                };
                config().init().with_group(
                    ParamGroup::from_ids(matrix_ids(model)),
                    config().with_weight_decay(decay).build(),
                    None,
                )
            }
            PlainOptimizer::AdamW(adam) => adamw(adam, 0.0).init().with_group(
                ParamGroup::from_ids(matrix_ids(model)),
                adamw(adam, wd).build(),
                None,
            ),
            // burn-optim's decays by the learning rate alone, where HF's (and ours) decays a
            // relative step by its own size.
            PlainOptimizer::Adafactor {
                beta1: None,
                relative_step,
            } if !relative_step || self.weight_decay == 0.0 => {
                let adafactor = |wd: f32| {
                    AdafactorConfig::new()
                        .with_relative_step(relative_step)
                        .with_scale_parameter(relative_step)
                        .with_weight_decay(wd)
                };
                adafactor(0.0).init().with_group(
                    ParamGroup::from_ids(matrix_ids(model)),
                    adafactor(wd).build(),
                    None,
                )
            }
            PlainOptimizer::Adafactor {
                beta1,
                relative_step,
            } => {
                let adafactor = |weight_decay: f64| Adafactor {
                    beta_1: beta1,
                    weight_decay,
                    relative_step,
                };
                ModuleOptimizer::from(adafactor(0.0)).with_group(
                    ParamGroup::from_ids(matrix_ids(model)),
                    adafactor(self.weight_decay),
                    None,
                )
            }
            PlainOptimizer::AdamW8bit { adam, min_size } => adamw(adam, 0.0)
                .init()
                .with_group(
                    ParamGroup::from_ids(param_ids(model, |dims| {
                        dims.len() >= 2 && !AdamW8bit::quantizes(dims, min_size)
                    })),
                    adamw(adam, wd).build(),
                    None,
                )
                .with_group(
                    ParamGroup::from_ids(param_ids(model, |dims| {
                        AdamW8bit::quantizes(dims, min_size)
                    })),
                    AdamW8bit {
                        beta_1: adam.beta1 as f32,
                        beta_2: adam.beta2 as f32,
                        epsilon: adam.epsilon as f32,
                        weight_decay: wd,
                    },
                    None,
                ),
        }
    }
}

fn adamw(adam: AdamSettings, weight_decay: f32) -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(adam.beta1 as f32)
        .with_beta_2(adam.beta2 as f32)
        .with_epsilon(adam.epsilon as f32)
        .with_weight_decay(weight_decay)
}

/// The ids of `model`'s parameters of rank >= 2 (matrices and embeddings).
fn matrix_ids<M: Module>(model: &M) -> Vec<ParamId> {
    param_ids(model, |dims| dims.len() >= 2)
}

/// The ids of `model`'s parameters whose dims `keep` accepts.
fn param_ids<M: Module>(model: &M, keep: impl Fn(&[usize]) -> bool) -> Vec<ParamId> {
    struct Ids<F>(F, Vec<ParamId>);
    impl<F: Fn(&[usize]) -> bool> ModuleVisitor for Ids<F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if (self.0)(&param.lazy_shape().dims::<D>()) {
                self.1.push(param.id);
            }
        }
    }
    let mut visit = Ids(keep, Vec::new());
    model.visit(&mut visit);
    visit.1
}

/// Each of `grads`' sum of squares, in f32 on their device (one `[1]` tensor each).
fn squared_sums<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Tensor<1>> {
    struct SumSquares<'a>(&'a GradientsParams, Vec<Tensor<1>>);
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.get::<D>(param.id) {
                self.1.push(grad.cast(FloatDType::F32).square().sum());
            }
        }
    }
    let mut visit = SumSquares(grads, Vec::new());
    model.visit(&mut visit);
    visit.1
}

/// `grads` times `factor`.
fn scaled<M: Module>(model: &M, mut grads: GradientsParams, factor: f64) -> GradientsParams {
    struct Scale<'a>(&'a mut GradientsParams, f64);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, grad * self.1);
            }
        }
    }
    model.visit(&mut Scale(&mut grads, factor));
    grads
}
