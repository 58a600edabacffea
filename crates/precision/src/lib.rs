//! Precision policies, as Lightning Fabric names them, applied to a model from outside.
//!
//! | policy | weights the optimizer steps | compute (matmuls, convolutions) | softmax, layer norm, loss | optimizer state |
//! |---|---|---|---|---|
//! | `32-true` | f32 | f32 | f32 | f32 |
//! | `16-mixed` | f32 master | f16 copy | f32 ([autocast]) | f32 |
//! | `bf16-mixed` | f32 master | bf16 copy | f32 ([autocast]) | f32 |
//! | `16-true` | f16 | f16 | f16 (loss f32) | f16 |
//! | `bf16-true` | bf16 | bf16 | bf16 (loss f32) | bf16 |
//!
//! `16-mixed` scales the loss ([`LossScaler`]) so small f16 gradients do not flush to zero.
//! The sharding engine applies the policy: it keeps the weights in [`Precision::param_dtype`];
//! under the mixed policies it runs each forward on a [`cast`] copy in
//! [`Precision::compute_dtype`] under an autocast scope and steps the optimizer on the f32
//! masters, and under the true ones it computes with the 16-bit weights and steps them.
//!
//! [autocast]: burnscale_nn::autocast

mod cast;
mod scaler;

pub use cast::{cast, cast_initialized, init_in, init_in_later, param_dtypes};
pub use scaler::{LossScaler, ScalerConfig};

use burn::prelude::*;
use burn::tensor::FloatDType;
use clap::ValueEnum;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Precision {
    #[value(name = "32-true")]
    #[serde(rename = "32-true")]
    F32True,
    #[value(name = "16-mixed")]
    #[serde(rename = "16-mixed")]
    F16Mixed,
    #[value(name = "bf16-mixed")]
    #[serde(rename = "bf16-mixed")]
    Bf16Mixed,
    #[value(name = "16-true")]
    #[serde(rename = "16-true")]
    F16True,
    #[value(name = "bf16-true")]
    #[serde(rename = "bf16-true")]
    Bf16True,
}

impl Precision {
    /// The dtype of the weights (and so of the optimizer state) between steps.
    pub fn param_dtype(self) -> FloatDType {
        match self {
            Precision::F16True => FloatDType::F16,
            Precision::Bf16True => FloatDType::BF16,
            _ => FloatDType::F32,
        }
    }

    /// The dtype forward and backward run in.
    pub fn compute_dtype(self) -> FloatDType {
        match self {
            Precision::F16Mixed | Precision::F16True => FloatDType::F16,
            Precision::Bf16Mixed | Precision::Bf16True => FloatDType::BF16,
            Precision::F32True => FloatDType::F32,
        }
    }

    /// Whether the weights themselves (and so the optimizer state) are 16-bit: the true
    /// 16-bit policies; the others keep f32 weights.
    pub fn has_16bit_weights(self) -> bool {
        self.param_dtype() != FloatDType::F32
    }

    /// Whether forward runs on a 16-bit copy of f32 master weights, with autocast.
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::F16Mixed | Precision::Bf16Mixed)
    }

    /// Whether the loss is scaled dynamically (f16's narrow range needs it; bf16's does not).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16Mixed
    }

    /// Fails if `device` cannot hold or compute in the dtypes this policy needs.
    pub fn check_device(self, device: &Device) -> Result<(), PrecisionError> {
        let dtype = self.compute_dtype();
        if device.supports_dtype(dtype) {
            Ok(())
        } else {
            Err(PrecisionError::UnsupportedDtype {
                precision: self,
                dtype: format!("{dtype:?}"),
                device: format!("{device:?}"),
            })
        }
    }
}

/// The name on the command line.
impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_possible_value() {
            Some(value) => f.write_str(value.get_name()),
            None => write!(f, "{self:?}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PrecisionError {
    #[error("--precision {precision} needs {dtype} tensors, which {device} does not support")]
    UnsupportedDtype {
        precision: Precision,
        dtype: String,
        device: String,
    },
    #[error(
        "--precision {precision}: the gradients overflowed on {steps} consecutive steps ({skipped} skipped in all), none of them taken, and the loss scale has halved down to {scale:e}, where the loss or its gradients still reach inf/NaN. Lower --lr, check the data, or train in bf16-mixed (no loss scale needed); --max-consecutive-skips N allows more skips"
    )]
    Overflowing {
        precision: Precision,
        steps: usize,
        skipped: usize,
        scale: f64,
    },
}
