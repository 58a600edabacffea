//! Training tasks: a model paired with its data, as the runner consumes them.

use burn::prelude::*;
use burnscale_mingpt::{Gpt, cross_entropy};
use burnscale_train::data::TokenWindows;
use burnscale_train::{Batch, BatchPart, TrainError, TrainTask};
use burnscale_vit::Vit;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::images::{ImageSet, Preprocess};

/// Next-token prediction for minGPT on random windows of a token stream, with an optional
/// validation stream that is read from the same windows at every evaluation.
#[derive(Clone)]
pub struct NextToken {
    train: TokenWindows,
    val: Option<(TokenWindows, usize)>,
    batch: usize,
    seed: u64,
}

impl NextToken {
    pub fn new(
        tokens: Vec<i64>,
        block: usize,
        batch: usize,
        seed: u64,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            train: TokenWindows::new(tokens, block, seed)?,
            val: None,
            batch,
            seed,
        })
    }

    /// Evaluates on `batches` batches of `tokens`.
    pub fn with_validation(
        mut self,
        tokens: Vec<i64>,
        block: usize,
        batches: usize,
    ) -> Result<Self, TrainError> {
        self.val = Some((TokenWindows::new(tokens, block, self.seed)?, batches.max(1)));
        Ok(self)
    }
}

impl TrainTask for NextToken {
    type Model = Gpt;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Gpt> {
        self.train.batch(self.batch, part, device)
    }

    fn items(&self, x: &Tensor<2, Int>) -> usize {
        x.shape().num_elements()
    }

    fn counts_tokens(&self) -> bool {
        true
    }

    /// Mean validation loss, or NaN without a validation stream.
    fn evaluate(&mut self, model: &Gpt) -> (f64, Option<f64>) {
        let Some((windows, batches)) = &mut self.val else {
            return (f64::NAN, None);
        };
        windows.reseed(self.seed);
        let device = model.wte.weight.val().device();
        let total: f64 = (0..*batches)
            .map(|_| {
                let (x, y) = windows.batch(self.batch, BatchPart::WHOLE, &device);
                cross_entropy(model.forward(x), y).into_scalar::<f32>() as f64
            })
            .sum();
        (total / *batches as f64, None)
    }
}

/// Image classification for ViT: epochs of shuffled training images (every rank shuffles
/// alike and reads its slice of each global batch), evaluated on the whole test set.
#[derive(Clone)]
pub struct ImageClassification {
    train: ImageSet,
    test: ImageSet,
    prep: Preprocess,
    batch: usize,
    eval_batch: usize,
    rng: StdRng,
    order: Vec<usize>,
    cursor: usize,
}

impl ImageClassification {
    pub fn new(
        train: ImageSet,
        test: ImageSet,
        prep: Preprocess,
        batch: usize,
        eval_batch: usize,
        seed: u64,
    ) -> Result<Self, TrainError> {
        if train.is_empty() || test.is_empty() {
            return Err(TrainError::InvalidArgs(format!(
                "{} training and {} test images: both splits need images",
                train.len(),
                test.len()
            )));
        }
        Ok(Self {
            train,
            test,
            prep,
            batch,
            eval_batch: eval_batch.max(1),
            rng: StdRng::seed_from_u64(seed),
            order: Vec::new(),
            cursor: 0,
        })
    }

    /// The next `n` training indices, reshuffling at each epoch's end.
    fn next_indices(&mut self, n: usize) -> Vec<usize> {
        (0..n)
            .map(|_| {
                if self.cursor == self.order.len() {
                    self.order = (0..self.train.len()).collect();
                    self.order.shuffle(&mut self.rng);
                    self.cursor = 0;
                }
                self.cursor += 1;
                self.order[self.cursor - 1]
            })
            .collect()
    }
}

impl TrainTask for ImageClassification {
    type Model = Vit;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Vit> {
        let global = self.next_indices(self.batch * part.world);
        let mine = &global[part.rank * self.batch..(part.rank + 1) * self.batch];
        self.train.batch(mine, &self.prep, device)
    }

    fn items(&self, x: &Tensor<4>) -> usize {
        x.dims()[0]
    }

    fn counts_tokens(&self) -> bool {
        false
    }

    /// Mean test loss and accuracy over the whole test set.
    fn evaluate(&mut self, model: &Vit) -> (f64, Option<f64>) {
        let device = model.classifier.weight.val().device();
        let indices: Vec<usize> = (0..self.test.len()).collect();
        let (mut loss, mut correct) = (0.0, 0i64);
        for chunk in indices.chunks(self.eval_batch) {
            let (x, y) = self.test.batch(chunk, &self.prep, &device);
            let logits = model.forward(x);
            let sum_loss =
                burnscale_nn::cross_entropy(logits.clone(), y.clone()) * chunk.len() as f32;
            loss += sum_loss.into_scalar::<f32>() as f64;
            correct += logits
                .argmax(1)
                .reshape([chunk.len()])
                .equal(y)
                .int()
                .sum()
                .into_scalar::<i64>();
        }
        let n = self.test.len() as f64;
        (loss / n, Some(correct as f64 / n))
    }
}
