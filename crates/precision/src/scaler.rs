//! The dynamic loss scaler of f16 mixed precision (PyTorch's `GradScaler` defaults): the loss
//! is multiplied by the scale before backward so small gradients survive f16; gradients are
//! divided by it before the optimizer. A step whose gradients hold an inf or NaN is skipped
//! and the scale backs off; after `growth_interval` good steps in a row it grows. A run whose
//! gradients overflow step after step trains nothing while its scale falls without bound, so
//! after `max_consecutive_skips` skips in a row it stops with [`PrecisionError::Overflowing`].

use crate::{Precision, PrecisionError};

/// The scaler's settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Consecutive skipped steps after which training stops.
    pub max_consecutive_skips: usize,
}

impl ScalerConfig {
    /// PyTorch's settings from `init_scale`, stopping after as many consecutive skips as
    /// take the scale below 1, where DeepSpeed's dynamic loss scaler stops a run (its
    /// `min_loss_scale`): 17 from 2^16.
    pub fn starting_at(init_scale: f64) -> Self {
        let backoff_factor = 0.5;
        let (mut scale, mut skips) = (init_scale * backoff_factor, 1);
        while scale >= 1.0 {
            scale *= backoff_factor;
            skips += 1;
        }
        Self {
            init_scale,
            growth_factor: 2.0,
            backoff_factor,
            growth_interval: 2000,
            max_consecutive_skips: skips,
        }
    }
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self::starting_at(65536.0)
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    config: ScalerConfig,
    scale: f64,
    good_steps: usize,
    skipped: usize,
    consecutive_skips: usize,
}

impl LossScaler {
    pub fn new(config: ScalerConfig) -> Self {
        Self {
            scale: config.init_scale,
            config,
            good_steps: 0,
            skipped: 0,
            consecutive_skips: 0,
        }
    }

    /// Continues where `saved` (a checkpoint's scaler) stopped: its scale and counters, this
    /// scaler's configuration.
    pub fn resume_from(&mut self, saved: &LossScaler) {
        *self = LossScaler {
            config: self.config,
            ..saved.clone()
        };
    }

    /// What the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Records one optimizer step: `found_inf` (agreed by every rank) means its gradients
    /// overflowed and it must be skipped. Returns whether to apply the step, or an error
    /// once `max_consecutive_skips` steps in a row were skipped.
    pub fn update(&mut self, found_inf: bool) -> Result<bool, PrecisionError> {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.good_steps = 0;
            self.skipped += 1;
            self.consecutive_skips += 1;
            if self.consecutive_skips >= self.config.max_consecutive_skips {
                return Err(PrecisionError::Overflowing {
                    precision: Precision::F16Mixed,
                    steps: self.consecutive_skips,
                    scale: self.scale,
                });
            }
            return Ok(false);
        }
        self.consecutive_skips = 0;
        self.good_steps += 1;
        if self.good_steps == self.config.growth_interval {
            self.scale *= self.config.growth_factor;
            self.good_steps = 0;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_halves_good_steps_grow() {
        let mut s = LossScaler::new(ScalerConfig {
            growth_interval: 3,
            ..ScalerConfig::default()
        });
        let mut update = |found_inf| s.update(found_inf).unwrap();
        assert!(!update(true));
        assert!(update(false) && update(false) && update(false));
        assert!(update(false) && update(false));
        assert!(!update(true));
        assert_eq!(s.skipped(), 2);
        assert_eq!(
            s.scale(),
            32768.0,
            "halved, grown after 3 good steps, halved again (the run of good steps reset)"
        );
        let mut t = LossScaler::new(ScalerConfig {
            growth_interval: 3,
            ..ScalerConfig::default()
        });
        for _ in 0..3 {
            t.update(false).unwrap();
        }
        assert_eq!(
            t.scale(),
            131072.0,
            "grows after growth_interval good steps"
        );
    }

    #[test]
    fn consecutive_overflows_stop_with_an_error_a_good_step_resets_the_count() {
        let mut s = LossScaler::new(ScalerConfig {
            max_consecutive_skips: 3,
            ..ScalerConfig::default()
        });
        assert_eq!(s.update(true).ok(), Some(false));
        assert_eq!(s.update(true).ok(), Some(false));
        assert_eq!(
            s.update(false).ok(),
            Some(true),
            "a good step resets the count"
        );
        assert_eq!(s.update(true).ok(), Some(false));
        assert_eq!(s.update(true).ok(), Some(false));
        let err = s.update(true).unwrap_err().to_string();
        assert!(
            err.contains("16-mixed")
                && err.contains("3 consecutive steps")
                && err.contains("bf16-mixed"),
            "{err}"
        );
        let default = ScalerConfig::default();
        assert_eq!(
            default.max_consecutive_skips, 17,
            "2^16 halved 17 times is below 1"
        );
        assert_eq!(ScalerConfig::starting_at(1024.0).max_consecutive_skips, 11);
        assert_eq!(ScalerConfig::starting_at(1000.0).max_consecutive_skips, 10);
        assert_eq!(ScalerConfig::starting_at(0.5).max_consecutive_skips, 1);
    }
}
