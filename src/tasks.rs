//! Training tasks: a model paired with its data, as the runner consumes them.

use std::marker::PhantomData;

use burn::prelude::*;
use burnscale_bert::{Bert, BertError, BertInput};
use burnscale_bigbird::BigBird;
use burnscale_mingpt::Gpt;
use burnscale_nn::BlockModel;
use burnscale_train::data::TokenWindows;
use burnscale_train::{Batch, BatchPart, Score, TrainError, TrainTask};
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
            batch: at_least_one("windows per batch (--batch-size)", batch)?,
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
        let batches = at_least_one("validation batches (--eval-batches)", batches)?;
        self.val = Some((TokenWindows::new(tokens, block, self.seed)?, batches));
        Ok(self)
    }
}

impl TrainTask for NextToken {
    type Model = Gpt;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Gpt> {
        self.train.batch(self.batch, part, device)
    }

    fn skip(&mut self, micro_batches: usize, _device: &Device, part: BatchPart) {
        self.train.skip(micro_batches, self.batch * part.world);
    }

    fn items(&self, x: &Tensor<2, Int>) -> usize {
        x.shape().num_elements()
    }

    fn counts_tokens(&self) -> bool {
        true
    }

    /// Every window fits the model's position table and every token its vocabulary.
    fn check(&self, model: &Gpt) -> Result<(), TrainError> {
        let vals = self.val.iter().map(|(windows, _)| ("validation", windows));
        for (part, windows) in std::iter::once(("training", &self.train)).chain(vals) {
            if windows.block() > model.block_size() {
                return Err(TrainError::InvalidData(format!(
                    "{part} windows of {} tokens, but the model's position table has {}",
                    windows.block(),
                    model.block_size()
                )));
            }
            let tokens = windows.tokens().iter().copied();
            check_classes(part, "token", tokens, model.vocab_size())?;
        }
        Ok(())
    }

    fn eval_batches(&self) -> usize {
        self.val.as_ref().map_or(0, |(_, batches)| *batches)
    }

    /// The k-th batch of validation windows drawn from the seed: the same batches at every
    /// evaluation.
    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Gpt> {
        let (windows, _) = self
            .val
            .as_mut()
            .expect("eval_batch is asked only with validation data");
        windows.reseed(self.seed);
        windows.skip(k, self.batch);
        windows.batch(self.batch, BatchPart::WHOLE, device)
    }

    fn score(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> Score {
        let [b, t, v] = logits.dims();
        Score::of_cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]))
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
    sampler: EpochSampler,
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
        Ok(Self {
            sampler: EpochSampler::new(train.len(), test.len(), seed)?,
            train,
            test,
            prep,
            batch: at_least_one("images per batch (--batch-size)", batch)?,
            eval_batch: at_least_one("images per evaluation batch (--eval-batch)", eval_batch)?,
        })
    }
}

impl TrainTask for ImageClassification {
    type Model = Vit;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<Vit> {
        let mine = self.sampler.next_batch(self.batch, part);
        self.train.batch(&mine, &self.prep, device)
    }

    fn skip(&mut self, micro_batches: usize, _device: &Device, part: BatchPart) {
        self.sampler.skip(micro_batches, self.batch, part);
    }

    fn items(&self, x: &Tensor<4>) -> usize {
        x.dims()[0]
    }

    /// The images are the model's size (and RGB, as batches are), and its head has a logit
    /// for every class of the data.
    fn check(&self, model: &Vit) -> Result<(), TrainError> {
        model
            .check_images([1, 3, self.prep.size, self.prep.size])
            .map_err(|e| TrainError::InvalidData(e.to_string()))?;
        let head = model.classifier.weight.lazy_shape()[1];
        match self.train.classes.max(self.test.classes) <= head {
            true => Ok(()),
            false => Err(TrainError::InvalidData(format!(
                "the images have {} classes, the model's head {head} logits",
                self.train.classes.max(self.test.classes)
            ))),
        }
    }

    fn counts_tokens(&self) -> bool {
        false
    }

    /// The whole test set, in batches of `--eval-batch`.
    fn eval_batches(&self) -> usize {
        self.test.len().div_ceil(self.eval_batch)
    }

    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<Vit> {
        let start = k * self.eval_batch;
        let chunk: Vec<usize> = (start..(start + self.eval_batch).min(self.test.len())).collect();
        self.test.batch(&chunk, &self.prep, device)
    }

    fn score(&self, logits: Tensor<2>, labels: Tensor<1, Int>) -> Score {
        classified(logits, labels)
    }
}

/// An encoder with a sequence-classification head over token ids (BERT, DistilBERT, BigBird).
pub trait SequenceClassifier:
    BlockModel<Input = BertInput, Target = Tensor<1, Int>, Logits = Tensor<2>> + Send + Sync
{
    /// `Ok` if the model can read a sequence of these token ids.
    fn check_ids(&self, ids: &[i64]) -> Result<(), BertError>;

    /// The classes its sequence-classification head scores; `None` without one.
    fn num_labels(&self) -> Option<usize>;
}

impl SequenceClassifier for Bert {
    fn check_ids(&self, ids: &[i64]) -> Result<(), BertError> {
        self.embeddings.check_ids(ids)
    }

    fn num_labels(&self) -> Option<usize> {
        let head = self.classifier.as_ref()?;
        Some(head.classifier.weight.lazy_shape()[1])
    }
}

impl SequenceClassifier for BigBird {
    fn check_ids(&self, ids: &[i64]) -> Result<(), BertError> {
        self.embeddings.check_ids(ids)
    }

    fn num_labels(&self) -> Option<usize> {
        let head = self.classifier.as_ref()?;
        Some(head.out_proj.weight.lazy_shape()[1])
    }
}

/// Sequence classification on token-id sequences (already tokenized, `[CLS]` ... `[SEP]`),
/// padded per batch to its longest sequence with `pad_id`; the same epoch order and per-rank
/// slicing as [`ImageClassification`].
pub struct TextClassification<M> {
    train: Vec<(Vec<i64>, i64)>,
    test: Vec<(Vec<i64>, i64)>,
    pad_id: i64,
    batch: usize,
    sampler: EpochSampler,
    model: PhantomData<fn() -> M>,
}

impl<M> Clone for TextClassification<M> {
    fn clone(&self) -> Self {
        Self {
            train: self.train.clone(),
            test: self.test.clone(),
            pad_id: self.pad_id,
            batch: self.batch,
            sampler: self.sampler.clone(),
            model: PhantomData,
        }
    }
}

impl<M> TextClassification<M> {
    /// The HF article's data for memory and speed benchmarks: training and test sequences of
    /// the lengths given, of token ids spread over [100, 30000) (BERT's vocabulary past its
    /// special tokens), labels alternating; fixed, so every run sees the same batches.
    pub fn random_tokens(
        train: &[usize],
        test: &[usize],
        batch: usize,
    ) -> Result<Self, TrainError> {
        let make = |lengths: &[usize]| -> Vec<(Vec<i64>, i64)> {
            lengths
                .iter()
                .enumerate()
                .map(|(i, &len)| {
                    let ids = (0..len).map(|j| ((i * 131 + j * 7919) % 29900 + 100) as i64);
                    (ids.collect(), (i % 2) as i64)
                })
                .collect()
        };
        Self::new(make(train), make(test), 0, batch, 1)
    }

    pub fn new(
        train: Vec<(Vec<i64>, i64)>,
        test: Vec<(Vec<i64>, i64)>,
        pad_id: i64,
        batch: usize,
        seed: u64,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            sampler: EpochSampler::new(train.len(), test.len(), seed)?,
            train,
            test,
            pad_id,
            batch: at_least_one("sequences per batch (--batch-size)", batch)?,
            model: PhantomData,
        })
    }

    fn batch_of(&self, rows: &[&(Vec<i64>, i64)], device: &Device) -> (BertInput, Tensor<1, Int>) {
        let (b, t) = (
            rows.len(),
            rows.iter().map(|r| r.0.len()).max().unwrap_or(0),
        );
        let (mut ids, mut mask) = (vec![self.pad_id; b * t], vec![0i64; b * t]);
        for (i, (seq, _)) in rows.iter().enumerate() {
            ids[i * t..i * t + seq.len()].copy_from_slice(seq);
            mask[i * t..i * t + seq.len()].fill(1);
        }
        let ints = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [b, t]), device);
        let labels: Vec<i64> = rows.iter().map(|r| r.1).collect();
        let input = BertInput {
            input_ids: ints(ids),
            token_type_ids: Tensor::zeros([b, t], device),
            attention_mask: ints(mask),
        };
        (
            input,
            Tensor::from_data(TensorData::new(labels, [b]), device),
        )
    }
}

impl<M: SequenceClassifier> TrainTask for TextClassification<M> {
    type Model = M;

    fn next_batch(&mut self, device: &Device, part: BatchPart) -> Batch<M> {
        let mine = self.sampler.next_batch(self.batch, part);
        let rows: Vec<&(Vec<i64>, i64)> = mine.iter().map(|&i| &self.train[i]).collect();
        self.batch_of(&rows, device)
    }

    fn skip(&mut self, micro_batches: usize, _device: &Device, part: BatchPart) {
        self.sampler.skip(micro_batches, self.batch, part);
    }

    fn items(&self, input: &BertInput) -> usize {
        input.input_ids.dims()[0]
    }

    fn check(&self, model: &M) -> Result<(), TrainError> {
        let num_labels = model.num_labels().ok_or_else(|| {
            TrainError::InvalidData(
                "the model has no sequence-classification head (built without num_labels)".into(),
            )
        })?;
        for (part, rows) in [("training", &self.train), ("test", &self.test)] {
            for (i, (ids, _)) in rows.iter().enumerate() {
                model
                    .check_ids(ids)
                    .map_err(|e| TrainError::InvalidData(format!("{part} sequence {i}: {e}")))?;
            }
            let labels = rows.iter().map(|(_, label)| *label);
            check_classes(part, "label", labels, num_labels)?;
        }
        Ok(())
    }

    fn counts_tokens(&self) -> bool {
        false
    }

    /// The whole test set, in batches of `--batch-size`.
    fn eval_batches(&self) -> usize {
        self.test.len().div_ceil(self.batch)
    }

    fn eval_batch(&mut self, k: usize, device: &Device) -> Batch<M> {
        let rows: Vec<&(Vec<i64>, i64)> = self
            .test
            .iter()
            .skip(k * self.batch)
            .take(self.batch)
            .collect();
        self.batch_of(&rows, device)
    }

    /// Each batch pads to its longest sequence: the one that holds the longest takes
    /// `--batch-size` rows of its length.
    fn largest_batch(&mut self, device: &Device, _part: BatchPart) -> Batch<M> {
        self.batch_of(&longest(&self.train, self.batch), device)
    }

    /// As many rows as the first validation batch, as long as the longest: no validation
    /// batch takes more.
    fn largest_eval_batch(&mut self, device: &Device) -> Batch<M> {
        self.batch_of(
            &longest(&self.test, self.batch.min(self.test.len())),
            device,
        )
    }

    fn score(&self, logits: Tensor<2>, labels: Tensor<1, Int>) -> Score {
        classified(logits, labels)
    }
}

/// `n`, if it is at least 1; else an error naming `what` it counts.
fn at_least_one(what: &str, n: usize) -> Result<usize, TrainError> {
    match n {
        0 => Err(TrainError::InvalidArgs(format!(
            "{what} must be at least 1, got 0"
        ))),
        n => Ok(n),
    }
}

/// `n` rows, each the longest of `rows` (none when `rows` is empty): padded, no batch of `n`
/// drawn from them is longer.
fn longest(rows: &[(Vec<i64>, i64)], n: usize) -> Vec<&(Vec<i64>, i64)> {
    let longest = rows.iter().max_by_key(|(ids, _)| ids.len());
    longest.map(|row| vec![row; n]).unwrap_or_default()
}

/// `Ok` if every value (a token id, a class label) of `part` is one of `classes`; else an
/// error naming the first that is not.
fn check_classes(
    part: &str,
    what: &str,
    values: impl IntoIterator<Item = i64>,
    classes: usize,
) -> Result<(), TrainError> {
    match values
        .into_iter()
        .enumerate()
        .find(|(_, v)| !(0..classes as i64).contains(v))
    {
        Some((i, v)) => Err(TrainError::InvalidData(format!(
            "{part} {what} {i} is {v}, but the model has {classes} (0 to {})",
            classes as i64 - 1
        ))),
        None => Ok(()),
    }
}

/// A batch of class logits' summed cross-entropy and right answers.
fn classified(logits: Tensor<2>, labels: Tensor<1, Int>) -> Score {
    let [n, _] = logits.dims();
    let loss = burnscale_nn::cross_entropy(logits.clone(), labels.clone()) * n as f32;
    let correct = logits.argmax(1).reshape([n]).equal(labels).int().sum();
    Score {
        loss: loss.into_scalar::<f32>() as f64,
        items: n,
        correct: Some(correct.into_scalar::<i64>() as usize),
    }
}

/// A seeded epoch order over `len` items, reshuffled at each epoch's end: every rank
/// draws the same global batches and keeps its slice (a distributed sampler).
#[derive(Clone)]
struct EpochSampler {
    len: usize,
    rng: StdRng,
    order: Vec<usize>,
    cursor: usize,
}

impl EpochSampler {
    /// Over a training split of `len` items; `test_len` is only checked (both need items).
    fn new(len: usize, test_len: usize, seed: u64) -> Result<Self, TrainError> {
        if len == 0 || test_len == 0 {
            return Err(TrainError::InvalidArgs(format!(
                "{len} training and {test_len} test examples: both splits need some"
            )));
        }
        Ok(Self {
            len,
            rng: StdRng::seed_from_u64(seed),
            order: Vec::new(),
            cursor: 0,
        })
    }

    /// `part`'s `batch` indices of the next global batch of `batch * part.world`.
    /// Moves past `batches` micro-batches, as if drawn.
    fn skip(&mut self, batches: usize, batch: usize, part: BatchPart) {
        for _ in 0..batches {
            self.next_batch(batch, part);
        }
    }

    fn next_batch(&mut self, batch: usize, part: BatchPart) -> Vec<usize> {
        let global: Vec<usize> = (0..batch * part.world)
            .map(|_| {
                if self.cursor == self.order.len() {
                    self.order = (0..self.len).collect();
                    self.order.shuffle(&mut self.rng);
                    self.cursor = 0;
                }
                self.cursor += 1;
                self.order[self.cursor - 1]
            })
            .collect();
        global[part.rank * batch..(part.rank + 1) * batch].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use burnscale_bert::{BertConfig, BertHead};
    use burnscale_mingpt::GptConfig;

    use super::*;

    fn refused<M, T: TrainTask<Model = M>>(task: &T, model: &M) -> String {
        task.check(model).unwrap_err().to_string()
    }

    #[test]
    fn data_the_model_cannot_read_is_refused_before_training() {
        let device = Device::default();
        let gpt = Gpt::new(&GptConfig::tiny(), &device).unwrap(); // vocab 11, block 8
        let stream = |top: i64| (0..100).map(|i| i % top).collect::<Vec<i64>>();
        NextToken::new(stream(11), 8, 2, 0)
            .unwrap()
            .check(&gpt)
            .unwrap();
        let err = refused(&NextToken::new(stream(12), 8, 2, 0).unwrap(), &gpt);
        assert!(err.contains("training token 11 is 11"), "{err}");
        let long = NextToken::new(stream(11), 9, 2, 0).unwrap();
        assert!(refused(&long, &gpt).contains("position table has 8"));
        let val = NextToken::new(stream(11), 8, 2, 0)
            .unwrap()
            .with_validation(vec![-1; 20], 8, 1)
            .unwrap();
        assert!(refused(&val, &gpt).contains("validation token 0 is -1"));

        let two = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
        let bert = Bert::new(&two, &device).unwrap();
        let rows = |label| vec![(vec![5, 6, 7], 0), (vec![5, 6], label)];
        let task = |label| TextClassification::<Bert>::new(rows(label), rows(0), 0, 1, 0).unwrap();
        task(1).check(&bert).unwrap();
        assert!(refused(&task(2), &bert).contains("training label 1 is 2"));
        let bare = Bert::new(&BertConfig::tiny().with_head(BertHead::Base), &device).unwrap();
        assert!(refused(&task(1), &bare).contains("no sequence-classification head"));
    }

    /// A next-token validation batch whose targets are partly ignored scores the others only:
    /// their summed loss and their count, so that ranks and batches with more ignored targets
    /// do not weigh more.
    #[test]
    fn a_validation_score_counts_only_the_scored_targets() {
        let device = Device::default();
        let task = NextToken::new((0..20).collect(), 4, 1, 0).unwrap();
        let rows = [
            [2.0, 0.0, 0.0],
            [5.0, 5.0, 5.0],
            [0.0, 1.0, 0.0],
            [9.0, 0.0, 0.0],
        ];
        let logits = Tensor::<3>::from_floats([rows], &device); // [1, 4, 3]
        let score = |targets: [i64; 4]| {
            let targets = Tensor::<2, Int>::from_ints([targets], &device);
            task.score(logits.clone(), targets)
        };
        let scored = score([0, -1, 2, -1]);
        let e = std::f64::consts::E;
        let want = -(e * e / (e * e + 2.0)).ln() - (1.0 / (e + 2.0)).ln();
        assert_eq!(scored.items, 2);
        assert!(
            (scored.loss - want).abs() < 1e-5 * want,
            "{} != {want}",
            scored.loss
        );
        let none = score([-1; 4]);
        assert_eq!((none.items, none.loss), (0, 0.0));
    }

    #[test]
    fn the_largest_text_batches_pad_to_the_longest_sequences() {
        let device = Device::default();
        let rows = |lengths: &[usize]| -> Vec<(Vec<i64>, i64)> {
            lengths.iter().map(|&n| (vec![5; n], 0)).collect()
        };
        let mut task =
            TextClassification::<Bert>::new(rows(&[3, 7, 5, 2]), rows(&[4, 1, 9]), 0, 2, 0)
                .unwrap();
        let part = BatchPart { rank: 1, world: 2 };
        let (input, labels) = task.largest_batch(&device, part);
        assert_eq!(input.input_ids.dims(), [2, 7]);
        assert_eq!(labels.dims(), [2]);
        // The validation batches are [4, 1] and [9]: no batch of two is longer than 9.
        assert_eq!(task.eval_batch(0, &device).0.input_ids.dims(), [2, 4]);
        assert_eq!(task.largest_eval_batch(&device).0.input_ids.dims(), [2, 9]);
        // A batch larger than the training set repeats its rows, as the sampler draws them.
        let mut small = TextClassification::<Bert>::new(rows(&[3]), rows(&[4]), 0, 3, 0).unwrap();
        let drawn = small
            .next_batch(&device, BatchPart::WHOLE)
            .0
            .input_ids
            .dims();
        assert_eq!(drawn, [3, 3]);
        assert_eq!(
            small
                .largest_batch(&device, BatchPart::WHOLE)
                .0
                .input_ids
                .dims(),
            drawn
        );
        assert_eq!(small.largest_eval_batch(&device).0.input_ids.dims(), [1, 4]);
    }
}
