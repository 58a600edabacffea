use burn::prelude::*;
use burn::tensor::activation::sigmoid;

/// GPT-2's GELU, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, computed as the identical
/// `x·σ(2·√(2/π)·(x + 0.044715·x³))`: on Flex, `tanh` goes through libm per element and the
/// cube through `powf`, which made Burn's `gelu_approximate` 2.7x slower (forward+backward).
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    const TWO_SQRT_2_OVER_PI: f64 = 1.595_769_121_605_730_7;
    let inner = (x.clone() * x.clone() * 0.044715 + 1.0) * x.clone() * TWO_SQRT_2_OVER_PI;
    x * sigmoid(inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::activation::gelu_approximate;

    #[test]
    fn matches_burns_tanh_gelu() {
        let device = Device::default();
        let x =
            Tensor::<1>::from_floats([-6.0, -2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 2.0, 7.0], &device);
        let ours: Vec<f32> = gelu_tanh(x.clone()).into_data().try_into_vec().unwrap();
        let burn: Vec<f32> = gelu_approximate(x).into_data().try_into_vec().unwrap();
        for (a, b) in ours.iter().zip(&burn) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
}
