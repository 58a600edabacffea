//! Checks every model config makes; each config adds its own on top.

/// `Err` naming the first size that is zero.
pub fn check_positive(sizes: &[(&str, usize)]) -> Result<(), String> {
    match sizes.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{name} must be at least 1")),
        None => Ok(()),
    }
}

/// `Err` unless the width splits evenly into heads.
pub fn check_heads(width: (&str, usize), heads: (&str, usize)) -> Result<(), String> {
    if width.1.is_multiple_of(heads.1) {
        Ok(())
    } else {
        Err(format!(
            "{} ({}) must be divisible by {} ({}); pick a width that is a multiple of the head count",
            width.0, width.1, heads.0, heads.1
        ))
    }
}

/// `Ok` if the layer norms' epsilon is positive and finite (else every loss is NaN).
pub fn check_layer_norm_eps(eps: f64) -> Result<(), String> {
    match eps > 0.0 && eps.is_finite() {
        true => Ok(()),
        false => Err(format!(
            "layer_norm_eps must be positive and finite, got {eps}"
        )),
    }
}

/// `Err` naming the first dropout probability outside `[0, 1)`.
pub fn check_probabilities(probabilities: &[(&str, f64)]) -> Result<(), String> {
    match probabilities.iter().find(|(_, p)| !(0.0..1.0).contains(p)) {
        Some((name, p)) => Err(format!("{name} {p} is not in [0, 1)")),
        None => Ok(()),
    }
}
