//! Training tasks: a model paired with its data, as the runner consumes them.

use burn::prelude::*;
use burnscale_mingpt::{Gpt, cross_entropy};
use burnscale_train::data::TokenWindows;
use burnscale_train::{Batch, BatchPart, TrainError, TrainTask};

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
