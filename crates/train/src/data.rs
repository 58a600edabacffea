//! Language-model batches: random windows of a token stream, seeded.

use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{BatchPart, TrainError};

/// Draws `[batch, block]` inputs and their next-token targets from random offsets.
#[derive(Clone)]
pub struct TokenWindows {
    tokens: Vec<i64>,
    block: usize,
    rng: StdRng,
}

impl TokenWindows {
    pub fn new(tokens: Vec<i64>, block: usize, seed: u64) -> Result<Self, TrainError> {
        if tokens.len() <= block {
            return Err(TrainError::InvalidArgs(format!(
                "a token stream of {} tokens is too short for block size {block}; use more data or a smaller --block-size",
                tokens.len()
            )));
        }
        Ok(Self {
            tokens,
            block,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// The stream the windows are cut from.
    pub fn tokens(&self) -> &[i64] {
        &self.tokens
    }

    /// The tokens of one window's input.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Restarts the window sequence, so the same windows come again.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = StdRng::seed_from_u64(seed);
    }

    /// `part`'s `(inputs, targets)`, both `[batch, block]`, of a global batch of
    /// `batch * part.world` windows.
    pub fn batch(
        &mut self,
        batch: usize,
        part: BatchPart,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let (mut x, mut y) = (Vec::with_capacity(batch * self.block), Vec::new());
        let starts = self.starts(batch * part.world);
        for &start in &starts[part.rank * batch..(part.rank + 1) * batch] {
            x.extend_from_slice(&self.tokens[start..start + self.block]);
            y.extend_from_slice(&self.tokens[start + 1..start + self.block + 1]);
        }
        let shape = [batch, self.block];
        (
            Tensor::from_data(TensorData::new(x, shape), device),
            Tensor::from_data(TensorData::new(y, shape), device),
        )
    }
}

impl TokenWindows {
    /// Moves past `batches` global batches of `global` windows each, as if drawn.
    pub fn skip(&mut self, batches: usize, global: usize) {
        for _ in 0..batches {
            self.starts(global);
        }
    }

    /// The offsets of the next `n` windows.
    fn starts(&mut self, n: usize) -> Vec<usize> {
        (0..n)
            .map(|_| self.rng.random_range(0..self.tokens.len() - self.block))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let device = Device::default();
        let mut w = TokenWindows::new((0..100).collect(), 8, 0).unwrap();
        let (x, y) = w.batch(4, BatchPart::WHOLE, &device);
        let x: Vec<i64> = x.into_data().try_into_vec_as().unwrap();
        let y: Vec<i64> = y.into_data().try_into_vec_as().unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| a + 1 == *b));
        assert!(TokenWindows::new((0..8).collect(), 8, 0).is_err());
    }

    #[test]
    fn skipping_batches_draws_what_drawing_them_would() {
        let device = Device::default();
        let rows = |t: Tensor<2, Int>| -> Vec<i64> { t.into_data().try_into_vec_as().unwrap() };
        let mut drawn = TokenWindows::new((0..100).collect(), 4, 3).unwrap();
        let mut skipped = drawn.clone();
        let part = BatchPart { rank: 1, world: 2 };
        for _ in 0..3 {
            drawn.batch(2, part, &device);
        }
        skipped.skip(3, 4);
        assert_eq!(
            rows(skipped.batch(2, part, &device).0),
            rows(drawn.batch(2, part, &device).0)
        );
    }

    #[test]
    fn ranks_read_their_slice_of_the_global_batch() {
        let device = Device::default();
        let rows = |t: Tensor<2, Int>| -> Vec<i64> { t.into_data().try_into_vec_as().unwrap() };
        let whole = rows(
            TokenWindows::new((0..100).collect(), 4, 3)
                .unwrap()
                .batch(6, BatchPart::WHOLE, &device)
                .0,
        );
        let parts: Vec<i64> = (0..3)
            .flat_map(|rank| {
                let mut w = TokenWindows::new((0..100).collect(), 4, 3).unwrap();
                rows(w.batch(2, BatchPart { rank, world: 3 }, &device).0)
            })
            .collect();
        assert_eq!(parts, whole);
    }
}
