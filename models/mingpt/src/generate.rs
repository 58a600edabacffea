use burn::prelude::*;
use rand::Rng;

use crate::{Gpt, GptError};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token.
    Greedy,
    /// Sample from the `k` most likely tokens after dividing the logits by `temperature`.
    TopK { k: usize, temperature: f64 },
}

impl Gpt {
    /// Extends `prompt` by `max_new_tokens` tokens, cropping the context to `block_size` as
    /// minGPT does. Call it on an eval-mode model (`model.valid()`), so dropout is off. Fails
    /// on an empty prompt or a token outside the vocabulary, on top-k sampling of no tokens or
    /// at a temperature that is not a positive number, and when the device fails to run a
    /// step.
    pub fn generate(
        &self,
        prompt: &[usize],
        max_new_tokens: usize,
        sampling: Sampling,
        rng: &mut impl Rng,
        device: &Device,
    ) -> Result<Vec<usize>, GptError> {
        if prompt.is_empty() {
            return Err(GptError::Prompt(
                "it is empty: give at least one token".into(),
            ));
        }
        let vocab = self.vocab_size();
        if let Some(token) = prompt.iter().find(|&&t| t >= vocab) {
            return Err(GptError::Prompt(format!(
                "token {token} is outside the vocabulary of {vocab}"
            )));
        }
        if let Sampling::TopK { k, temperature } = sampling
            && (k == 0 || !(temperature > 0.0 && temperature.is_finite()))
        {
            return Err(GptError::Sampling(format!(
                "top-k sampling needs k >= 1 and a positive, finite temperature (got k {k}, temperature {temperature}); greedy decoding is Sampling::Greedy"
            )));
        }
        let mut tokens = prompt.to_vec();
        for _ in 0..max_new_tokens {
            let start = tokens.len().saturating_sub(self.block_size());
            let context: Vec<i64> = tokens[start..].iter().map(|&t| t as i64).collect();
            let t = context.len();
            let idx = Tensor::<2, Int>::from_data(TensorData::new(context, [1, t]), device);
            let logits = self.forward(idx).slice([0..1, t - 1..t]).flatten::<1>(0, 2);
            // In the model's dtype (bf16 or f16 for the `*-true` precisions), read as f32.
            let logits: Vec<f32> = logits
                .try_into_data()?
                .convert::<f32>()
                .try_into_vec()
                .expect("converted to f32");
            tokens.push(choose(&logits, sampling, rng));
        }
        Ok(tokens)
    }
}

fn choose(logits: &[f32], sampling: Sampling, rng: &mut impl Rng) -> usize {
    let argmax = |xs: &[f32]| {
        xs.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i)
    };
    match sampling {
        Sampling::Greedy => argmax(logits),
        Sampling::TopK { k, temperature } => {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            order.truncate(k);
            let scale = 1.0 / temperature as f32;
            let top = logits[order[0]] * scale;
            let weights: Vec<f32> = order
                .iter()
                .map(|&i| (logits[i] * scale - top).exp())
                .collect();
            let mut u = rng.random::<f32>() * weights.iter().sum::<f32>();
            for (&i, w) in order.iter().zip(&weights) {
                if u < *w {
                    return i;
                }
                u -= w;
            }
            order[order.len() - 1]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_and_top1_pick_the_argmax() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let logits = [0.1, 2.0, -1.0, 1.9];
        assert_eq!(choose(&logits, Sampling::Greedy, &mut rng), 1);
        let top1 = Sampling::TopK {
            k: 1,
            temperature: 1.0,
        };
        assert_eq!(choose(&logits, top1, &mut rng), 1);
    }

    #[test]
    fn a_prompt_the_model_cannot_read_is_an_error() {
        let device = Device::default();
        let config = crate::GptConfig::tiny();
        let model = Gpt::new(&config, &device).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let mut generate = |prompt: &[usize]| {
            model
                .generate(prompt, 2, Sampling::Greedy, &mut rng, &device)
                .map_err(|e| e.to_string())
        };
        let empty = generate(&[]).unwrap_err();
        assert!(empty.contains("empty"), "{empty}");
        let outside = generate(&[config.vocab_size]).unwrap_err();
        assert!(outside.contains("outside the vocabulary"), "{outside}");
        assert_eq!(generate(&[0, 1]).unwrap().len(), 4);
        // Settings that cannot sample are refused, not taken as greedy decoding.
        for (k, temperature) in [(0, 1.0), (2, 0.0), (2, -1.0), (2, f64::NAN)] {
            let top_k = Sampling::TopK { k, temperature };
            let refused = model
                .generate(&[0], 2, top_k, &mut rng, &device)
                .unwrap_err();
            assert!(refused.to_string().contains("needs k >= 1"), "{refused}");
        }
    }

    #[test]
    fn top_k_never_leaves_the_top_k() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let logits = [0.0, 3.0, -2.0, 2.9, 1.0];
        let top2 = Sampling::TopK {
            k: 2,
            temperature: 5.0,
        };
        let picks: Vec<usize> = (0..200).map(|_| choose(&logits, top2, &mut rng)).collect();
        assert!(picks.iter().all(|&i| i == 1 || i == 3));
        assert!(
            picks.contains(&1) && picks.contains(&3),
            "both top tokens sampled"
        );
    }
}
