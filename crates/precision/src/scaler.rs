//! The dynamic loss scaler of f16 mixed precision (PyTorch's `GradScaler` defaults): the loss
//! is multiplied by the scale before backward so small gradients survive f16; gradients are
//! divided by it before the optimizer. A step whose gradients hold an inf or NaN is skipped
//! and the scale backs off; after `growth_interval` good steps in a row it grows. A run whose
//! gradients overflow step after step trains nothing while its scale falls without bound, so
//! once a skip would take the scale below 1 (or after `max_consecutive_skips` skips in a row,
//! when given: the scale stays at 1 meanwhile, DeepSpeed's `min_loss_scale`) it stops with
//! [`PrecisionError::Overflowing`].

use crate::{Precision, PrecisionError};

/// The scaler's settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// Consecutive skipped steps after which training stops; `None`: once a skip takes the
    /// scale below 1, where DeepSpeed's dynamic loss scaler stops a run (its
    /// `min_loss_scale`): 17 skips from 2^16, more from a scale that has grown.
    pub max_consecutive_skips: Option<usize>,
}

impl ScalerConfig {
    /// PyTorch's settings from `init_scale`.
    pub fn starting_at(init_scale: f64) -> Self {
        Self {
            init_scale,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            max_consecutive_skips: None,
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
    /// scaler's configuration but for the scale the first run started at, which stays on
    /// record through every resume.
    pub fn resume_from(&mut self, saved: &LossScaler) {
        *self = LossScaler {
            config: ScalerConfig {
                init_scale: saved.config.init_scale,
                ..self.config
            },
            ..saved.clone()
        };
    }

    /// The scale the run started at (`--initial-loss-scale`), kept through its resumes.
    pub fn initial_scale(&self) -> f64 {
        self.config.init_scale
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
    /// once a skip would take the scale below 1 (`max_consecutive_skips` steps in a row
    /// skipped, if given; the scale backs off to 1 and no lower).
    pub fn update(&mut self, found_inf: bool) -> Result<bool, PrecisionError> {
        if found_inf {
            let backed_off = self.scale * self.config.backoff_factor;
            // Never below 1 (DeepSpeed's `min_loss_scale`): below it the scale shrinks the
            // f16 gradients, which underflow to zeros that step as good ones.
            self.scale = backed_off.max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            self.consecutive_skips += 1;
            let limit_reached = match self.config.max_consecutive_skips {
                Some(limit) => self.consecutive_skips >= limit,
                None => backed_off < 1.0,
            };
            if limit_reached {
                return Err(PrecisionError::Overflowing {
                    precision: Precision::F16Mixed,
                    steps: self.consecutive_skips,
                    skipped: self.skipped,
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
            max_consecutive_skips: Some(3),
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
    }

    /// Without a limit given, the run stops once a skip would take the scale below 1: 17
    /// skips from 2^16, 20 from a scale grown to 2^19 (not the count that takes the starting
    /// scale there).
    #[test]
    fn overflows_stop_the_run_once_the_scale_is_below_one() {
        let skips_to_stop = |init_scale: f64, grown: usize| {
            let mut s = LossScaler::new(ScalerConfig {
                growth_interval: 1,
                ..ScalerConfig::starting_at(init_scale)
            });
            for _ in 0..grown {
                s.update(false).unwrap();
            }
            (1..)
                .find(|_| s.update(true).is_err())
                .map(|skips| (skips, s.scale()))
                .unwrap()
        };
        assert_eq!(skips_to_stop(65536.0, 0), (17, 1.0));
        assert_eq!(skips_to_stop(65536.0, 3), (20, 1.0));
        assert_eq!(skips_to_stop(1000.0, 0), (10, 1.0));
        assert_eq!(skips_to_stop(1.0, 0), (1, 1.0));
    }

    /// With a limit given, overflows in a row back the scale off to 1 and no lower, as
    /// DeepSpeed's `min_loss_scale`: below 1 the f16 gradients underflow to zeros, steps that
    /// look good, and the scale would take thousands of them to climb back.
    #[test]
    fn a_limit_on_skips_keeps_the_scale_at_least_one() {
        let mut s = LossScaler::new(ScalerConfig {
            max_consecutive_skips: Some(40),
            ..ScalerConfig::default()
        });
        for _ in 0..20 {
            assert_eq!(s.update(true).ok(), Some(false));
        }
        assert_eq!(s.scale(), 1.0);
    }
}
