//! Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
//! Cost", 2018), as HF transformers' `Adafactor` computes it (`tests/lean_optimizers.rs`
//! checks it against a numpy transcription of HF's step), for parameters split by rows
//! between ranks. burn-optim's `Adafactor` is the same without a first moment, but for its
//! weight decay under a relative step.
//!
//! A matrix keeps the running means of its squared gradients along rows and along columns
//! (factored second moments) instead of one per element; vectors keep a full one. Several
//! statistics of a step span every row of a parameter: a matrix's column means, the mean of
//! its row factor, the RMS of the update (clipped to 1) and, with a relative step, the RMS
//! of the parameter. A rank that holds some rows cannot take them alone, so a step has three
//! phases: each rank sums what it can over its real rows ([`Adafactor::partial_sums`]), the
//! sums of all parameters are reduced across ranks in one collective; then the update's sum
//! of squares ([`Adafactor::update_sum_sq`]), reduced in a second; then the step itself
//! ([`Adafactor::finish`]). On one rank the reductions are the identity.
//!
//! A vector or a matrix that is f32 in host memory (an offloaded parameter, or any on the
//! CPU) takes each phase as loops over its rows (`HostRows`), a pass or two over the
//! gradient, instead of a dozen tensor operations.

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::{DType as TensorDType, FloatDType, TensorData};
use rayon::prelude::*;

use crate::fused_adamw::{CHUNK, f32_in_host_memory, f32s, f32s_mut};

const EPSILON_1: f64 = 1e-30;
const EPSILON_2: f64 = 1e-3;
const CLIP_THRESHOLD: f64 = 1.0;
const DECAY_RATE: f64 = -0.8;

/// Adafactor's settings: burn-optim's defaults (epsilons 1e-30 and 1e-3, update clipping at
/// an RMS of 1, second-moment decay `1 - t^-0.8`).
#[derive(Clone, Debug)]
pub struct Adafactor {
    /// The first moment's decay (HF's `beta1`): none keeps no first moment.
    pub beta_1: Option<f64>,
    /// Decoupled weight decay, scaled by the step's size as HF's: the learning rate, or under
    /// a relative step that step times the parameter's RMS (burn-optim's scales it by the
    /// learning rate alone).
    pub weight_decay: f64,
    /// HF's `relative_step` and `scale_parameter`: a step of `min(lr, 1 / sqrt(t))` times
    /// the parameter's RMS (at least 1e-3); without, the learning rate itself.
    pub relative_step: bool,
}

/// Adafactor's state of one parameter.
#[derive(Clone)]
pub struct AdafactorState<const D: usize> {
    time: usize,
    /// A matrix's row means, `[.., rows, 1]`; a vector's whole second moment.
    second_moment: Tensor<D>,
    /// A matrix's column means, `[.., 1, cols]`.
    column_second_moment: Option<Tensor<D>>,
    exp_avg: Option<Tensor<D>>,
}

impl Adafactor {
    /// This parameter's part (its `real` rows of `grad` and `tensor`, the shard's padding
    /// left out) of the sums its step needs over all rows: for a matrix, the column sums of
    /// the squared gradient and the sum of the new row moment; with a relative step, the
    /// parameter's sum of squares. `None` when the step needs none.
    pub fn partial_sums<const D: usize>(
        &self,
        tensor: &Tensor<D>,
        grad: Tensor<D>,
        state: Option<&AdafactorState<D>>,
        real: usize,
    ) -> Option<Tensor<1>> {
        let Some(host) = HostRows::of(&grad, Some(tensor), state) else {
            return self.tensor_partial_sums(tensor, &grad, state, real);
        };
        if !host.factored && !self.relative_step {
            return None;
        }
        let device = grad.device();
        let (g, p) = (
            grad.into_data(),
            self.relative_step.then(|| tensor.to_data()),
        );
        // A matrix's row moments enter its sums; a vector's sum is of its values' squares.
        let rows = match host.factored {
            true => host.new_row_moments(f32s(&g), state),
            false => Vec::new(),
        };
        let sums = host.sums(self, p.as_ref().map(f32s), f32s(&g), &rows, real);
        let len = sums.len();
        (len > 0).then(|| host_tensor(sums, [len], &device))
    }

    fn tensor_partial_sums<const D: usize>(
        &self,
        tensor: &Tensor<D>,
        grad: &Tensor<D>,
        state: Option<&AdafactorState<D>>,
        real: usize,
    ) -> Option<Tensor<1>> {
        let mut sums = Vec::new();
        if D == 2 {
            let (cols, squared) = (grad.dims()[1], squared(grad));
            let row = row_moment(&squared, state);
            sums.push(match real {
                0 => Tensor::zeros([cols], (&grad.device(), TensorDType::F32)),
                _ => squared.narrow(0, 0, real).sum_dim(0).reshape([cols]),
            });
            sums.push(sum_of_rows(row, real));
        }
        if self.relative_step {
            sums.push(sum_of_rows(f32_of(tensor).square(), real));
        }
        (!sums.is_empty()).then(|| Tensor::cat(sums, 0))
    }

    /// The update's sum of squares over the `real` rows, before clipping, from every row's
    /// `sums` (the reduced [`Adafactor::partial_sums`]) of a parameter of `full` dims.
    pub fn update_sum_sq<const D: usize>(
        &self,
        grad: Tensor<D>,
        state: Option<&AdafactorState<D>>,
        sums: Option<&Tensor<1>>,
        full: &[usize],
        real: usize,
    ) -> Tensor<1> {
        let host = HostRows::of(&grad, None, state).filter(|h| !h.factored || sums.is_some());
        let Some(host) = host else {
            return self.tensor_update_sum_sq(&grad, state, sums, full, real);
        };
        let (device, g) = (grad.device(), grad.into_data());
        let sums = sums.map(host_values);
        let rows = host.new_row_moments(f32s(&g), state);
        let factors = host.factors(state, sums.as_deref(), full[0], rows);
        let sum = host.update_sum_sq(f32s(&g), &factors, real);
        host_tensor(vec![sum], [1], &device)
    }

    fn tensor_update_sum_sq<const D: usize>(
        &self,
        grad: &Tensor<D>,
        state: Option<&AdafactorState<D>>,
        sums: Option<&Tensor<1>>,
        full: &[usize],
        real: usize,
    ) -> Tensor<1> {
        let (update, _) = self.update(grad, state, sums, full);
        sum_of_rows(update.square(), real)
    }

    /// The step: the parameter and its new state, from every row's `sums` and the update's
    /// whole sum of squares `update_sq`.
    #[allow(clippy::too_many_arguments)]
    pub fn finish<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdafactorState<D>>,
        sums: Option<&Tensor<1>>,
        update_sq: Tensor<1>,
        full: &[usize],
    ) -> (Tensor<D>, AdafactorState<D>) {
        let host = HostRows::of(&grad, Some(&tensor), state.as_ref());
        let Some(host) = host.filter(|h| !h.factored || sums.is_some()) else {
            return self.tensor_finish(lr, tensor, grad, state, sums, update_sq, full);
        };
        let device = tensor.device();
        let (sums, update_sq) = (sums.map(host_values), host_values(&update_sq)[0]);
        let step = Step {
            adafactor: self,
            lr,
            sums: sums.as_deref(),
            update_sq,
            full,
        };
        // Flex hands over the buffer of a tensor nothing else shares: the step is in place.
        let g = grad.into_data();
        let rows = host.new_row_moments(f32s(&g), state.as_ref());
        let factors = host.factors(state.as_ref(), step.sums, full[0], rows);
        host.step(&step, tensor.into_data(), f32s(&g), factors, state, &device)
    }

    #[allow(clippy::too_many_arguments)]
    fn tensor_finish<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdafactorState<D>>,
        sums: Option<&Tensor<1>>,
        update_sq: Tensor<1>,
        full: &[usize],
    ) -> (Tensor<D>, AdafactorState<D>) {
        let dtype = tensor.dtype();
        let numel = full.iter().product::<usize>() as f64;
        let (update, mut new) = self.update(&grad, state.as_ref(), sums, full);
        let clipping = (update_sq / numel)
            .sqrt()
            .div_scalar(CLIP_THRESHOLD)
            .clamp_min(1.0);
        let mut update = update.div(clipping.reshape([1; D]));
        let step_size = match self.relative_step {
            true => lr.min(1.0 / (new.time as f64).sqrt()),
            false => lr,
        };
        let mut scale = None;
        if self.relative_step {
            let sums = sums.expect("a relative step sums the parameter's squares");
            let param_sq = sums.clone().narrow(0, sums.dims()[0] - 1, 1);
            let rms = (param_sq / numel).sqrt().clamp_min(EPSILON_2);
            update = update.mul(rms.clone().reshape([1; D]));
            scale = Some(rms);
        }
        update = update.mul_scalar(step_size);
        if let Some(beta_1) = self.beta_1 {
            let exp_avg = match state.and_then(|s| s.exp_avg) {
                Some(m) => m.mul_scalar(beta_1) + update.mul_scalar(1.0 - beta_1),
                None => update.mul_scalar(1.0 - beta_1),
            };
            update = exp_avg.clone();
            new.exp_avg = Some(exp_avg);
        }
        let mut tensor = f32_of(&tensor);
        // Decayed by the step's own size, as HF's: the relative step times the RMS scale.
        if self.weight_decay != 0.0 {
            let decay = step_size * self.weight_decay;
            tensor = match scale {
                Some(rms) => tensor.mul(rms.mul_scalar(-decay).add_scalar(1.0).reshape([1; D])),
                None => tensor.mul_scalar(1.0 - decay),
            };
        }
        ((tensor - update).cast(dtype), new)
    }

    /// The unclipped update and the new state (its first moment not yet updated).
    fn update<const D: usize>(
        &self,
        grad: &Tensor<D>,
        state: Option<&AdafactorState<D>>,
        sums: Option<&Tensor<1>>,
        full: &[usize],
    ) -> (Tensor<D>, AdafactorState<D>) {
        let grad32 = f32_of(grad);
        // A matrix's column means and its row factor's mean span all of its rows.
        let (column_mean, row_mean) = match (D == 2, sums) {
            (true, Some(sums)) => {
                let (rows, cols) = (full[0] as f64, full[1]);
                let column = sums.clone().narrow(0, 0, cols).div_scalar(rows);
                let row = sums.clone().narrow(0, cols, 1).div_scalar(rows);
                (Some(column.reshape([1, cols])), Some(row))
            }
            _ => (None, None),
        };
        let squared = squared(grad);
        let row = row_moment(&squared, state);
        let column = (D >= 2).then(|| {
            let observed = match column_mean {
                Some(mean) => reshaped(mean),
                None => squared.mean_dim(D - 2),
            };
            let old = state.and_then(|s| s.column_second_moment.as_ref());
            decayed(old, time(state), observed)
        });
        let update = match &column {
            Some(column) => {
                let row_mean = match row_mean {
                    Some(mean) => mean.reshape([1; D]),
                    None => row.clone().mean_dim(D - 2),
                };
                let row_scale = row.clone().div(row_mean).sqrt();
                grad32.div(row_scale).div(column.clone().sqrt())
            }
            None => grad32.div(row.clone().sqrt()),
        };
        let new = AdafactorState {
            time: time(state),
            second_moment: row,
            column_second_moment: column,
            exp_avg: None,
        };
        (update, new)
    }
}

/// The new row second moment of a matrix (or higher), or a vector's whole one, from this
/// step's squared gradient.
fn row_moment<const D: usize>(squared: &Tensor<D>, state: Option<&AdafactorState<D>>) -> Tensor<D> {
    let observed = match D >= 2 {
        true => squared.clone().mean_dim(D - 1),
        false => squared.clone(),
    };
    decayed(state.map(|s| &s.second_moment), time(state), observed)
}

/// The running mean of `old` and this step's (`time`'s) `observed` second moment: weight
/// `time^-0.8` on the new one; `observed` alone where there is no old one yet.
fn decayed<const D: usize>(old: Option<&Tensor<D>>, time: usize, observed: Tensor<D>) -> Tensor<D> {
    match old {
        Some(old) => {
            let new_weight = (time as f64).powf(DECAY_RATE);
            old.clone()
                .mul_scalar(1.0 - new_weight)
                .add(observed.mul_scalar(new_weight))
        }
        None => observed,
    }
}

/// The step this one is: 1 without a state.
fn time<const D: usize>(state: Option<&AdafactorState<D>>) -> usize {
    state.map_or(1, |s| s.time + 1)
}

fn f32_of<const D: usize>(t: &Tensor<D>) -> Tensor<D> {
    t.clone().cast(FloatDType::F32)
}

/// The sum of the first `real` rows of `t` (none: a rank that holds only padding), `[1]`.
fn sum_of_rows<const D: usize>(t: Tensor<D>, real: usize) -> Tensor<1> {
    match real {
        0 => Tensor::zeros([1], (&t.device(), TensorDType::F32)),
        _ => t.narrow(0, 0, real).sum(),
    }
}

fn squared<const D: usize>(grad: &Tensor<D>) -> Tensor<D> {
    f32_of(grad).square().add_scalar(EPSILON_1)
}

/// A `[1, cols]` tensor as a tensor of rank `D` (2: the only rank whose column means span
/// rows of other ranks).
fn reshaped<const D: usize>(t: Tensor<2>) -> Tensor<D> {
    let dims = t.dims();
    let mut shape = [1; D];
    shape[D - 1] = dims[1];
    t.reshape(shape)
}

/// A vector's or a matrix's Adafactor phases as loops over host memory (f32 on Flex), rows in
/// parallel, each phase a pass or two over the gradient where the tensor path makes a dozen. Its
/// element operations are the tensor path's f32 ones in its order, with its scalars rounded
/// to f32 as its operations round them; its sums are taken in f64 (the tensor path's in f32,
/// in Flex's order), so the two agree to the f32 rounding of the sums, not bit for bit. A
/// vector is a matrix of one column without the column factor.
struct HostRows {
    rows: usize,
    cols: usize,
    factored: bool,
}

impl HostRows {
    /// The rows of a step whose gradient, parameter (when given) and state are all f32 in
    /// host memory, in the shapes this optimizer gives them; `None` sends the step to the
    /// tensor path.
    fn of<const D: usize>(
        grad: &Tensor<D>,
        tensor: Option<&Tensor<D>>,
        state: Option<&AdafactorState<D>>,
    ) -> Option<Self> {
        if D > 2 || !f32_in_host_memory(grad) {
            return None;
        }
        let dims = grad.dims();
        let (rows, cols) = (dims[0], if D == 2 { dims[1] } else { 1 });
        let is = |t: &Tensor<D>, shape: &[usize]| f32_in_host_memory(t) && t.dims() == shape;
        let row_shape = if D == 2 { vec![rows, 1] } else { vec![rows] };
        let fits = tensor.is_none_or(|t| is(t, &dims))
            && state.is_none_or(|s| {
                is(&s.second_moment, &row_shape)
                    && match &s.column_second_moment {
                        Some(column) => D == 2 && is(column, &[1, cols]),
                        None => D == 1,
                    }
                    && s.exp_avg.as_ref().is_none_or(|m| is(m, &dims))
            });
        (fits && cols > 0).then_some(Self {
            rows,
            cols,
            factored: D == 2,
        })
    }

    /// Rows a task takes at least, so that its overhead is amortised.
    fn rows_per_task(&self) -> usize {
        (CHUNK / self.cols).max(1)
    }

    /// Every row's new second moment (a vector's element's) from gradients `g`.
    fn new_row_moments<const D: usize>(
        &self,
        g: &[f32],
        state: Option<&AdafactorState<D>>,
    ) -> Vec<f32> {
        let (old, decay) = (state.map(|s| host_values(&s.second_moment)), decay(state));
        let cols = self.cols;
        g.par_chunks(cols)
            .enumerate()
            .with_min_len(self.rows_per_task())
            .map(|(i, g)| {
                let observed = (sum_of(g, squared_of) / cols as f64) as f32;
                decayed_at(old.as_deref().map(|r| r[i]), decay, observed)
            })
            .collect()
    }

    /// [`Adafactor::partial_sums`] of gradients `g` (and parameter values `p`, for a relative
    /// step): the column sums of the squared gradient and the sum of the new row moments (a
    /// matrix), then the parameter's sum of squares (a relative step), over the `real` rows.
    fn sums(
        &self,
        adafactor: &Adafactor,
        p: Option<&[f32]>,
        g: &[f32],
        new_rows: &[f32],
        real: usize,
    ) -> Vec<f32> {
        let cols = self.cols;
        let columns = if self.factored { cols } else { 0 };
        let zeros = || (vec![0f64; columns], 0f64, 0f64);
        let (column_sums, row_sum, param_sq) = (0..real)
            .into_par_iter()
            .with_min_len(self.rows_per_task())
            .fold(zeros, |(mut column_sums, mut row_sum, mut param_sq), i| {
                let g = &g[i * cols..(i + 1) * cols];
                if self.factored {
                    for (sum, &g) in column_sums.iter_mut().zip(g) {
                        *sum += squared_of(g) as f64;
                    }
                    row_sum += new_rows[i] as f64;
                }
                if let Some(p) = p {
                    param_sq += sum_of(&p[i * cols..(i + 1) * cols], |p| p * p);
                }
                (column_sums, row_sum, param_sq)
            })
            .reduce(zeros, |(mut a, a_rows, a_param), (b, b_rows, b_param)| {
                a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                (a, a_rows + b_rows, a_param + b_param)
            });
        let mut sums: Vec<f32> = column_sums.into_iter().map(|s| s as f32).collect();
        if self.factored {
            sums.push(row_sum as f32);
        }
        if adafactor.relative_step {
            sums.push(param_sq as f32);
        }
        sums
    }

    /// [`Adafactor::update_sum_sq`]: the unclipped update's sum of squares over the `real`
    /// rows of gradients `g`.
    fn update_sum_sq(&self, g: &[f32], factors: &Factors, real: usize) -> f32 {
        let cols = self.cols;
        let sum: f64 = (0..real)
            .into_par_iter()
            .with_min_len(self.rows_per_task())
            .map_init(
                || vec![0f32; cols],
                |update, i| {
                    factors.update(i, &g[i * cols..(i + 1) * cols], update);
                    sum_of(update, |u| u * u)
                },
            )
            .sum();
        sum as f32
    }

    /// [`Adafactor::finish`]: the step of parameter values `p` with gradients `g`, in place,
    /// on every row (a shard's padding among them, as the tensor path steps it).
    fn step<const D: usize>(
        &self,
        step: &Step,
        mut p: TensorData,
        g: &[f32],
        factors: Factors,
        state: Option<AdafactorState<D>>,
        device: &Device,
    ) -> (Tensor<D>, AdafactorState<D>) {
        let (rows, cols, adafactor, lr) = (self.rows, self.cols, step.adafactor, step.lr);
        let step_time = time(state.as_ref());
        // The tensor path's scalars: f32 operations on `[1]` tensors, f64 scalars in f32.
        let numel = step.full.iter().product::<usize>() as f32;
        let clipping = ((step.update_sq / numel).sqrt() / CLIP_THRESHOLD as f32).max(1.0);
        let scale = adafactor.relative_step.then(|| {
            let sums = step
                .sums
                .expect("a relative step sums the parameter's squares");
            (sums[sums.len() - 1] / numel).sqrt().max(EPSILON_2 as f32)
        });
        let step_size = match adafactor.relative_step {
            true => lr.min(1.0 / (step_time as f64).sqrt()),
            false => lr,
        } as f32;
        // Decayed by the step's own size, as HF's: the relative step times the RMS scale.
        let keep = (adafactor.weight_decay != 0.0).then(|| {
            let decay = step_size * (adafactor.weight_decay as f32);
            1.0 - scale.unwrap_or(1.0) * decay
        });
        // The first moment's weights, and whether it has old values (zeros, unread, if not).
        let old_exp_avg = state.and_then(|s| s.exp_avg);
        let beta_1 = adafactor
            .beta_1
            .map(|b| (b as f32, (1.0 - b) as f32, old_exp_avg.is_some()));
        let dims = p.shape().to_vec();
        let mut exp_avg = match (beta_1, old_exp_avg) {
            (None, _) => TensorData::new(Vec::<f32>::new(), [0]),
            (Some(_), Some(m)) => m.into_data(),
            (Some(_), None) => TensorData::zeros::<f32, _>(dims),
        };
        let mut exp_avg_rows: Vec<&mut [f32]> = match beta_1 {
            Some(_) => f32s_mut(&mut exp_avg).chunks_mut(cols).collect(),
            None => (0..rows).map(|_| &mut [][..]).collect(),
        };
        f32s_mut(&mut p)
            .par_chunks_mut(cols)
            .zip(g.par_chunks(cols))
            .zip(exp_avg_rows.par_iter_mut())
            .enumerate()
            .with_min_len(self.rows_per_task())
            .for_each_init(
                || vec![0f32; cols],
                |u, (i, ((p, g), m))| {
                    factors.update(i, g, u);
                    // The tensor path's operations, each a loop of its own over the row.
                    u.iter_mut().for_each(|u| *u /= clipping);
                    if let Some(scale) = scale {
                        u.iter_mut().for_each(|u| *u *= scale);
                    }
                    u.iter_mut().for_each(|u| *u *= step_size);
                    if let Some((b1, f1, old)) = beta_1 {
                        for (m, u) in m.iter_mut().zip(u.iter_mut()) {
                            *m = match old {
                                true => *m * b1 + *u * f1,
                                false => *u * f1,
                            };
                            *u = *m;
                        }
                    }
                    if let Some(keep) = keep {
                        p.iter_mut().for_each(|p| *p *= keep);
                    }
                    p.iter_mut().zip(u.iter()).for_each(|(p, u)| *p -= u);
                },
            );
        drop(exp_avg_rows);
        let row_shape = if D == 2 { vec![rows, 1] } else { vec![rows] };
        let state = AdafactorState {
            time: step_time,
            second_moment: host_tensor(factors.rows, row_shape, device),
            column_second_moment: factors.columns.map(|c| host_tensor(c, [1, cols], device)),
            exp_avg: beta_1.map(|_| Tensor::from_data(exp_avg, (device, TensorDType::F32))),
        };
        (Tensor::from_data(p, (device, TensorDType::F32)), state)
    }

    /// What the update divides each gradient by: the new column moments (a matrix's, from
    /// every row's `sums` of a parameter of `full_rows` rows), and the row factor's mean.
    fn factors<const D: usize>(
        &self,
        state: Option<&AdafactorState<D>>,
        sums: Option<&[f32]>,
        full_rows: usize,
        rows: Vec<f32>,
    ) -> Factors {
        let (columns, row_mean) = match (self.factored, sums) {
            (true, Some(sums)) => {
                let (n, decay) = (full_rows as f32, decay(state));
                let old = state
                    .and_then(|s| s.column_second_moment.as_ref())
                    .map(host_values);
                let columns = (0..self.cols)
                    .map(|j| decayed_at(old.as_deref().map(|c| c[j]), decay, sums[j] / n))
                    .collect::<Vec<f32>>();
                (Some(columns), Some(sums[self.cols] / n))
            }
            _ => (None, None),
        };
        let column_roots = columns
            .as_ref()
            .map(|c| c.iter().map(|c| c.sqrt()).collect());
        Factors {
            rows,
            columns,
            column_roots,
            row_mean,
        }
    }
}

/// A step's scalars: what [`Adafactor::finish`] is given besides the tensors.
struct Step<'a> {
    adafactor: &'a Adafactor,
    lr: LearningRate,
    /// Every row's sums ([`Adafactor::partial_sums`], reduced).
    sums: Option<&'a [f32]>,
    /// The update's sum of squares over every row.
    update_sq: f32,
    full: &'a [usize],
}

/// What an update divides the gradients by.
struct Factors {
    /// The new row moments (a vector's whole second moment).
    rows: Vec<f32>,
    /// A matrix's new column moments.
    columns: Option<Vec<f32>>,
    column_roots: Option<Vec<f32>>,
    row_mean: Option<f32>,
}

impl Factors {
    /// Row `i`'s unclipped update of its gradients `g`, into `update`.
    fn update(&self, i: usize, g: &[f32], update: &mut [f32]) {
        let row = self.rows[i];
        match (&self.column_roots, self.row_mean) {
            // The tensor path's `g / sqrt(row / mean row) / sqrt(column)`.
            (Some(roots), Some(mean)) => {
                let scale = (row / mean).sqrt();
                for ((u, &g), root) in update.iter_mut().zip(g).zip(roots) {
                    *u = g / scale / root;
                }
            }
            // A vector's `g / sqrt(moment)`.
            _ => {
                let root = row.sqrt();
                for (u, &g) in update.iter_mut().zip(g) {
                    *u = g / root;
                }
            }
        }
    }
}

/// The sum of `f` over `xs` in f64, in eight lanes, so that it vectorises.
fn sum_of(xs: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&x| f(x) as f64).sum();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x) as f64;
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// `(1 - t^-0.8, t^-0.8)`, a running second moment's weights on its old value and this
/// step's, in f32; `None` on the first step (no old value).
fn decay<const D: usize>(state: Option<&AdafactorState<D>>) -> Option<(f32, f32)> {
    state.map(|_| {
        let new_weight = (time(state) as f64).powf(DECAY_RATE);
        ((1.0 - new_weight) as f32, new_weight as f32)
    })
}

/// [`decayed`] of one value, with the weights in f32.
fn decayed_at(old: Option<f32>, decay: Option<(f32, f32)>, observed: f32) -> f32 {
    match (old, decay) {
        (Some(old), Some((keep, new))) => old * keep + observed * new,
        _ => observed,
    }
}

/// One squared gradient as the tensor path rounds it (`square`, then `+ 1e-30`).
fn squared_of(g: f32) -> f32 {
    g * g + EPSILON_1 as f32
}

/// `t`'s values (f32 in host memory).
fn host_values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data()
        .try_into_vec::<f32>()
        .expect("f32 host tensors read as f32")
}

fn host_tensor<const D: usize>(
    values: Vec<f32>,
    shape: impl Into<burn::tensor::Shape>,
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), (device, TensorDType::F32))
}

/// On one device: every row is this one's, and each reduction is the identity.
impl Optimizer for Adafactor {
    type State<const D: usize> = AdafactorState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let full = tensor.dims();
        // On the host, the phases read the one gradient in place.
        if let Some(host) = HostRows::of(&grad, Some(&tensor), state.as_ref()) {
            let device = tensor.device();
            let (p, g) = (tensor.into_data(), grad.into_data());
            let relative = self.relative_step.then_some(f32s(&p));
            let rows = host.new_row_moments(f32s(&g), state.as_ref());
            let sums = host.sums(self, relative, f32s(&g), &rows, full[0]);
            let factors = host.factors(state.as_ref(), Some(&sums), full[0], rows);
            let update_sq = host.update_sum_sq(f32s(&g), &factors, full[0]);
            let step = Step {
                adafactor: self,
                lr,
                sums: Some(&sums),
                update_sq,
                full: &full,
            };
            let (tensor, state) = host.step(&step, p, f32s(&g), factors, state, &device);
            return (tensor, Some(state));
        }
        let sums = self.tensor_partial_sums(&tensor, &grad, state.as_ref(), full[0]);
        let update_sq =
            self.tensor_update_sum_sq(&grad, state.as_ref(), sums.as_ref(), &full, full[0]);
        let (tensor, state) =
            self.tensor_finish(lr, tensor, grad, state, sums.as_ref(), update_sq, &full);
        (tensor, Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdafactorState {
            time: state.time,
            second_moment: state.second_moment.to_device(device),
            column_second_moment: state.column_second_moment.map(|t| t.to_device(device)),
            exp_avg: state.exp_avg.map(|t| t.to_device(device)),
        }
    }
}

/// The state name of a matrix's column moment: its statistics over all of the parameter's
/// rows, which every rank holds whole whatever its rows (a checkpoint writes it once).
pub(crate) const COLUMN_MOMENT: &str = "column_second_moment";

impl<const D: usize> RecordState for AdafactorState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", Scalar::UInt(self.time as u64));
        out.push_tensor(prefix, "second_moment", self.second_moment.to_data());
        if let Some(column) = &self.column_second_moment {
            out.push_tensor(prefix, COLUMN_MOMENT, column.to_data());
        }
        if let Some(exp_avg) = &self.exp_avg {
            out.push_tensor(prefix, "exp_avg", exp_avg.to_data());
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let time = match src.take_scalar(prefix, "time")? {
            Scalar::UInt(t) => t as usize,
            _ => return None,
        };
        let mut tensor = |leaf: &str| {
            let data = src.take_tensor(prefix, leaf)?;
            (data.shape().len() == D).then(|| Tensor::from_data(data, (device, TensorDType::F32)))
        };
        Some(Self {
            time,
            second_moment: tensor("second_moment")?,
            column_second_moment: tensor(COLUMN_MOMENT),
            exp_avg: tensor("exp_avg"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
        t.to_data().try_into_vec::<f32>().unwrap()
    }

    /// `got` within `rel` of `want`, elementwise, relative to each value or, for values
    /// smaller than the tensor's RMS (a sum whose terms cancel), to that.
    fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let rms = (want.iter().map(|w| w * w).sum::<f32>() / want.len() as f32).sqrt();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= rel * w.abs().max(rms),
                "{what}, element {i}: host {g}, tensor path {w}"
            );
        }
    }

    /// Values spread over `[-scale, scale)`, a fixed pattern of `salt`; the first row zero
    /// when `zero_row` (a gradient that a squared epsilon keeps from dividing by zero).
    fn pattern<const D: usize>(
        shape: [usize; D],
        salt: usize,
        scale: f32,
        zero_row: bool,
    ) -> Tensor<D> {
        let n: usize = shape.iter().product();
        let row = n / shape[0];
        let values: Vec<f32> = (0..n)
            .map(|i| match zero_row && i < row {
                true => 0.0,
                false => {
                    let h = (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 65_521;
                    (h as f32 / 65_521.0 * 2.0 - 1.0) * scale
                }
            })
            .collect();
        Tensor::from_data(TensorData::new(values, shape), &Device::flex())
    }

    /// Three steps of one parameter through the host rows and through the tensor path, each
    /// with its own sums, the shard's last rows padding.
    fn steps_alike<const D: usize>(adafactor: &Adafactor, shape: [usize; D], full: [usize; D]) {
        let real = full[0];
        // A sum of n f32 terms, taken in another order, is within n roundings (2^-24 each) of
        // the sum of their magnitudes; the largest sums here span the whole parameter.
        let rel = full.iter().product::<usize>() as f32 * f32::EPSILON / 2.0;
        let mut host = pattern(shape, 0, 1.0, false);
        let (mut tensors, mut whole) = (host.clone(), host.clone());
        let (mut host_state, mut tensor_state, mut whole_state) = (None, None, None);
        for step in 1..=3 {
            let what = |part: &str| format!("{shape:?} {adafactor:?}, step {step}: {part}");
            let grad = pattern(shape, step, 1e-2, true);
            let lr = 1e-2 * step as f64;
            assert!(HostRows::of(&grad, Some(&host), host_state.as_ref()).is_some());
            let host_sums = adafactor.partial_sums(&host, grad.clone(), host_state.as_ref(), real);
            let tensor_sums =
                adafactor.tensor_partial_sums(&tensors, &grad, tensor_state.as_ref(), real);
            assert_eq!(host_sums.is_some(), tensor_sums.is_some());
            if let (Some(h), Some(t)) = (&host_sums, &tensor_sums) {
                assert_close(&what("sums"), &values(h), &values(t), rel);
            }
            let host_sq = adafactor.update_sum_sq(
                grad.clone(),
                host_state.as_ref(),
                host_sums.as_ref(),
                &full,
                real,
            );
            let tensor_sq = adafactor.tensor_update_sum_sq(
                &grad,
                tensor_state.as_ref(),
                tensor_sums.as_ref(),
                &full,
                real,
            );
            assert_close(
                &what("update's sum of squares"),
                &values(&host_sq),
                &values(&tensor_sq),
                rel,
            );
            // Unpadded, the one-device step (the phases reading one gradient in place).
            if shape == full {
                (whole, whole_state) = adafactor.step(lr, whole, grad.clone(), whole_state);
            }
            let (h, hs) = adafactor.finish(
                lr,
                host,
                grad.clone(),
                host_state,
                host_sums.as_ref(),
                host_sq,
                &full,
            );
            let (t, ts) = adafactor.tensor_finish(
                lr,
                tensors,
                grad,
                tensor_state,
                tensor_sums.as_ref(),
                tensor_sq,
                &full,
            );
            assert_close(&what("parameter"), &values(&h), &values(&t), rel);
            if shape == full {
                assert_close(&what("one-device step"), &values(&whole), &values(&t), rel);
            }
            assert_eq!(hs.time, ts.time);
            assert_close(
                &what("row moments"),
                &values(&hs.second_moment),
                &values(&ts.second_moment),
                rel,
            );
            let columns = |s: &AdafactorState<D>| s.column_second_moment.as_ref().map(values);
            match (columns(&hs), columns(&ts)) {
                (Some(h), Some(t)) => assert_close(&what("column moments"), &h, &t, rel),
                (h, t) => assert_eq!(h.is_some(), t.is_some(), "{}", what("column moments")),
            }
            let exp_avg = |s: &AdafactorState<D>| s.exp_avg.as_ref().map(values);
            match (exp_avg(&hs), exp_avg(&ts)) {
                (Some(h), Some(t)) => assert_close(&what("first moment"), &h, &t, rel),
                (h, t) => assert_eq!(h.is_some(), t.is_some(), "{}", what("first moment")),
            }
            (host, tensors, host_state, tensor_state) = (h, t, Some(hs), Some(ts));
        }
    }

    /// A matrix and a vector, each with its last rows padding and whole, and a matrix of one
    /// column, with and without a first moment, a relative step and decay: the host rows take
    /// the tensor path's steps, to the f32 rounding of sums taken in another order.
    #[test]
    fn the_host_rows_step_as_the_tensor_path() {
        for beta_1 in [None, Some(0.9)] {
            for relative_step in [false, true] {
                for weight_decay in [0.0, 0.1] {
                    let adafactor = Adafactor {
                        beta_1,
                        weight_decay,
                        relative_step,
                    };
                    steps_alike(&adafactor, [37, 300], [33, 300]);
                    steps_alike(&adafactor, [33, 300], [33, 300]);
                    steps_alike(&adafactor, [300], [291]);
                    steps_alike(&adafactor, [291], [291]);
                    steps_alike(&adafactor, [37, 1], [37, 1]);
                }
            }
        }
    }
}
