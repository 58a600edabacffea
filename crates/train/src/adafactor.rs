//! Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
//! Cost", 2018), as burn-optim's `Adafactor` computes it (HF's `Adafactor` without a first
//! moment), with HF's optional first moment, for parameters split by rows between ranks.
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

use burn::optim::{LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::{DType as TensorDType, FloatDType};

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
    /// Decoupled weight decay, scaled by the learning rate.
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
        if self.relative_step {
            let sums = sums.expect("a relative step sums the parameter's squares");
            let param_sq = sums.clone().narrow(0, sums.dims()[0] - 1, 1);
            let scale = (param_sq / numel).sqrt().clamp_min(EPSILON_2);
            update = update.mul(scale.reshape([1; D]));
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
        if self.weight_decay != 0.0 {
            tensor = tensor.mul_scalar(1.0 - lr * self.weight_decay);
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
        let sums = self.partial_sums(&tensor, &grad, state.as_ref(), full[0]);
        let update_sq = self.update_sum_sq(&grad, state.as_ref(), sums.as_ref(), &full, full[0]);
        let (tensor, state) = self.finish(lr, tensor, grad, state, sums.as_ref(), update_sq, &full);
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

impl<const D: usize> RecordState for AdafactorState<D> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "time", Scalar::UInt(self.time as u64));
        out.push_tensor(prefix, "second_moment", self.second_moment.to_data());
        if let Some(column) = &self.column_second_moment {
            out.push_tensor(prefix, "column_second_moment", column.to_data());
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
            column_second_moment: tensor("column_second_moment"),
            exp_avg: tensor("exp_avg"),
        })
    }
}
