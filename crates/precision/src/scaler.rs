//! The dynamic loss scaler of f16 mixed precision (PyTorch's `GradScaler` defaults): the loss
//! is multiplied by the scale before backward so small gradients survive f16; gradients are
//! divided by it before the optimizer. A step whose gradients hold an inf or NaN is skipped
//! and the scale backs off; after `growth_interval` good steps in a row it grows.

/// The scaler's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    config: ScalerConfig,
    scale: f64,
    good_steps: usize,
    skipped: usize,
}

impl LossScaler {
    pub fn new(config: ScalerConfig) -> Self {
        Self {
            scale: config.init_scale,
            config,
            good_steps: 0,
            skipped: 0,
        }
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
    /// overflowed and it must be skipped. Returns whether to apply the step.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.good_steps = 0;
            self.skipped += 1;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps == self.config.growth_interval {
            self.scale *= self.config.growth_factor;
            self.good_steps = 0;
        }
        true
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
        assert_eq!(s.scale(), 65536.0);
        assert!(!s.update(true));
        assert_eq!((s.scale(), s.skipped()), (32768.0, 1));
        assert!(s.update(false) && s.update(false));
        assert_eq!(s.scale(), 32768.0);
        assert!(s.update(false));
        assert_eq!(s.scale(), 65536.0, "grows after growth_interval good steps");
        assert!(s.update(false) && s.update(false));
        assert!(!s.update(true));
        assert_eq!(
            s.scale(),
            32768.0,
            "an overflow resets the run of good steps"
        );
    }
}
