//! BERT parity: random-init tiny BERT and DistilBERT (classification and masked-LM heads) and
//! the real all-MiniLM-L6-v2 against outputs `scripts/gen_bert_fixtures.py` computed with
//! transformers (1e-4 max-abs); tokenization against HF's tokenizer; bad input.

mod common;

use std::collections::HashMap;
use std::path::Path;

use burn::prelude::*;
use burnscale::bert::loader::{self, Head};
use burnscale::bert::tokenizer::BertTokenizer;
use burnscale::bert::{BertConfig, BertError, BertHead, BertInput, Layout};
use burnscale::nn::weights::Weight;
use burnscale::pretrained;
use common::{fixture, max_abs_diff};

const TOLERANCE: f32 = 1e-4;

fn ints(w: &Weight, device: &Device) -> Tensor<2, Int> {
    let values: Vec<i64> = w.values.iter().map(|&v| v as i64).collect();
    Tensor::from_data(TensorData::new(values, w.shape.clone()), device)
}

fn input(io: &HashMap<String, Weight>, device: &Device) -> BertInput {
    let ids = ints(&io["input.input_ids"], device);
    BertInput {
        token_type_ids: match io.get("input.token_type_ids") {
            Some(types) => ints(types, device),
            None => ids.zeros_like(),
        },
        attention_mask: ints(&io["input.attention_mask"], device),
        input_ids: ids,
    }
}

/// The tiny BERT classifier of the fixtures, and its config.
fn tiny_classifier(device: &Device) -> (burnscale::bert::Bert, BertConfig) {
    let (tensors, _) = fixture("bert", "tiny_bert_cls.safetensors");
    let cls = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    let model = loader::load_weights(tensors, Path::new("t"), &cls, Head::Load, device).unwrap();
    (model, cls)
}

#[test]
fn tiny_models_match_transformers() {
    let device = Device::default();
    for (layout, name) in [(Layout::Bert, "bert"), (Layout::DistilBert, "distilbert")] {
        for (head, head_name) in [
            (BertHead::SequenceClassification { num_labels: 2 }, "cls"),
            (BertHead::MaskedLm, "mlm"),
        ] {
            let file = format!("tiny_{name}_{head_name}.safetensors");
            let (tensors, io) = fixture("bert", &file);
            let base = match layout {
                Layout::Bert => BertConfig::tiny(),
                Layout::DistilBert => BertConfig {
                    layout,
                    type_vocab_size: 0,
                    ..BertConfig::tiny()
                },
            };
            let config = base.with_head(head);
            let model =
                loader::load_weights(tensors, Path::new(&file), &config, Head::Load, &device)
                    .unwrap_or_else(|e| panic!("{file}: {e}"));
            let logits = model.logits(model.hidden_states(input(&io, &device)));
            let diff = max_abs_diff(logits, &io["output.logits"]);
            eprintln!("{file}: logits max-abs difference {diff:.2e}");
            assert!(diff < TOLERANCE, "{file}: logits differ by {diff}");
        }
    }
}

/// bert-base-uncased's file is `BertForPreTraining`'s: LayerNorm parameters named `gamma` and
/// `beta` (the TensorFlow port's names), a pooler and a next-sentence head beside the masked-LM
/// one. It loads as transformers loads it: as a masked LM (the pooler dropped), and, with a
/// fresh head, as a BERT or BigBird classifier; a masked-LM file (no pooler) finetunes with a
/// fresh pooler.
#[test]
fn a_pretraining_checkpoint_loads_as_transformers_loads_it() {
    let device = Device::default();
    let (tensors, io) = fixture("bert", "tiny_bert_mlm.safetensors");
    let d = BertConfig::tiny().hidden_size;
    let mut pretraining: Vec<Weight> = tensors
        .into_iter()
        .map(|w| Weight {
            key: w
                .key
                .replace("LayerNorm.weight", "LayerNorm.gamma")
                .replace("LayerNorm.bias", "LayerNorm.beta"),
            ..w
        })
        .collect();
    assert!(
        pretraining
            .iter()
            .any(|w| w.key.ends_with("LayerNorm.gamma"))
    );
    let nsp = |key: &str, shape: Vec<usize>| {
        Weight::new(
            key.to_string(),
            shape.clone(),
            vec![0.5; shape.iter().product()],
        )
    };
    pretraining.push(nsp("cls.seq_relationship.weight", vec![2, d]));
    pretraining.push(nsp("cls.seq_relationship.bias", vec![2]));
    // `BertForPreTraining`'s encoder has a pooler, which a masked LM has not.
    pretraining.push(nsp("bert.pooler.dense.weight", vec![d, d]));
    pretraining.push(nsp("bert.pooler.dense.bias", vec![d]));
    let path = Path::new("pretraining.safetensors");
    let load = |config: &BertConfig, head| {
        loader::load_weights(pretraining.clone(), path, config, head, &device)
            .unwrap_or_else(|e| panic!("{e}"))
    };

    let mlm = load(
        &BertConfig::tiny().with_head(BertHead::MaskedLm),
        Head::Load,
    );
    let hidden = mlm.hidden_states(input(&io, &device));
    let diff = max_abs_diff(mlm.logits(hidden.clone()), &io["output.logits"]);
    assert!(diff < TOLERANCE, "logits differ by {diff}");
    // A decoder of its own (`tie_word_embeddings: false`) would be dropped: refused.
    let mut untied = pretraining.clone();
    untied.retain(|w| w.key != "cls.predictions.decoder.weight");
    let table = untied
        .iter()
        .find(|w| w.key.ends_with("embeddings.word_embeddings.weight"))
        .unwrap();
    let decoder = Weight::new(
        "cls.predictions.decoder.weight".into(),
        table.shape.clone(),
        table.values.iter().map(|v| v + 1.0).collect(),
    );
    untied.push(decoder);
    let mlm_config = BertConfig::tiny().with_head(BertHead::MaskedLm);
    let err =
        loader::load_weights(untied.clone(), path, &mlm_config, Head::Load, &device).unwrap_err();
    assert!(
        err.to_string().contains("is not the word embeddings"),
        "{err}"
    );
    // A model that reads no decoder loads the file, as transformers does.
    let cls = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    loader::load_weights(untied, path, &cls, Head::Fresh, &device)
        .unwrap_or_else(|e| panic!("a classifier from an untied masked LM: {e}"));

    let cls = BertConfig::tiny().with_head(BertHead::SequenceClassification { num_labels: 2 });
    let classifier = load(&cls, Head::Fresh);
    let same = classifier.hidden_states(input(&io, &device));
    assert!(same.equal(hidden).all().into_scalar::<bool>());
    let err = loader::load_weights(pretraining.clone(), path, &cls, Head::Load, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cls.predictions.bias"), "{err}");

    let bigbird = burnscale::bigbird::BigBirdConfig {
        encoder: BertConfig::tiny(),
        ..burnscale::bigbird::BigBirdConfig::tiny().with_num_labels(2)
    };
    burnscale::bigbird::loader::load_weights(pretraining, path, &bigbird, Head::Fresh, &device)
        .unwrap_or_else(|e| panic!("BigBird: {e}"));
    // A BERT classifier's one-layer head is left out of a BigBird with a fresh head, as a
    // masked-LM head is (it read as weights for another architecture).
    let (classifier, _) = fixture("bert", "tiny_bert_cls.safetensors");
    burnscale::bigbird::loader::load_weights(classifier, path, &bigbird, Head::Fresh, &device)
        .unwrap_or_else(|e| panic!("BigBird from a BERT classifier: {e}"));
}

/// A sequence all padding (every key masked) attends uniformly, as transformers' mask of the
/// dtype's minimum makes it, in bf16 too: a mask of -inf there (f32::MIN rounds to it) made
/// its hidden states NaN.
#[test]
fn a_sequence_of_padding_stays_finite_in_bf16() {
    let device = Device::default();
    let (model, _) = tiny_classifier(&device);
    let model = burnscale::precision::cast(model, burn::tensor::FloatDType::BF16);
    let input = BertInput {
        input_ids: Tensor::from_data([[2i64, 5, 3], [0, 0, 0]], &device),
        token_type_ids: Tensor::zeros([2, 3], &device),
        attention_mask: Tensor::from_data([[1i64, 1, 1], [0, 0, 0]], &device),
    };
    let hidden = model
        .hidden_states(input)
        .cast(burn::tensor::FloatDType::F32);
    assert!(hidden.is_finite().all().into_scalar::<bool>());
}

#[test]
fn minilm_matches_transformers_and_its_tokenizer() {
    let device = Device::default();
    let files = pretrained::minilm_files()
        .unwrap_or_else(|e| panic!("the MiniLM weights are needed for this test: {e}"));
    let config = BertConfig::from_hf_json(&files.config).unwrap();
    assert_eq!(config.num_params(), BertConfig::minilm_l6().num_params());
    let model = loader::load(&files.weights, &config, Head::Load, &device).unwrap();
    let (_, io) = fixture("bert", "minilm.safetensors");

    let sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "burnscale trains models too big for one device!",
        "Hello, world",
    ];
    for path in [&files.tokenizer_json, &files.vocab] {
        let tokenizer = BertTokenizer::from_file(path, true).unwrap();
        tokenizer.check_vocab(&config, path).unwrap();
        let ours = tokenizer.encode(&sentences, 128, &device).unwrap();
        let ids: Vec<i64> = ours.input_ids.into_data().try_into_vec_as().unwrap();
        let want: Vec<i64> = io["input.input_ids"]
            .values
            .iter()
            .map(|&v| v as i64)
            .collect();
        assert_eq!(ids, want, "token ids from {}", path.display());
    }

    let batch = input(&io, &device);
    let mask = batch.attention_mask.clone().float().unsqueeze_dim::<3>(2); // [b, t, 1]
    let hidden = model.hidden_states(batch);
    let pooled = (hidden.clone() * mask.clone())
        .sum_dim(1)
        .squeeze_dim::<2>(1)
        / mask.sum_dim(1).squeeze_dim::<2>(1);
    let h = max_abs_diff(hidden, &io["output.last_hidden_state"]);
    let p = max_abs_diff(pooled, &io["output.mean_pooled"]);
    eprintln!("MiniLM: max-abs difference last hidden state {h:.2e}, mean-pooled {p:.2e}");
    assert!(h < TOLERANCE && p < TOLERANCE, "hidden {h}, pooled {p}");
}

/// A fresh head for another number of labels keeps what of a classification file's head
/// fits, as transformers does (`ignore_mismatched_sizes`): DistilBERT's `pre_classifier` and
/// BigBird's `classifier.dense` (d x d) load, the label-sized layer is initialised again.
#[test]
fn a_fresh_head_keeps_the_layers_the_labels_do_not_size() {
    let device = Device::default();
    let (tensors, _) = fixture("bert", "tiny_distilbert_cls.safetensors");
    let distil = |num_labels| {
        BertConfig {
            layout: Layout::DistilBert,
            type_vocab_size: 0,
            ..BertConfig::tiny()
        }
        .with_head(BertHead::SequenceClassification { num_labels })
    };
    let path = Path::new("distilbert.safetensors");
    let load = |labels, head| {
        let model = loader::load_weights(tensors.clone(), path, &distil(labels), head, &device)
            .unwrap_or_else(|e| panic!("{e}"));
        model.classifier.expect("a classifier")
    };
    let (saved, fresh) = (load(2, Head::Load), load(3, Head::Fresh));
    let weight = |layer: &burn::nn::Linear| layer.weight.val();
    let (a, b) = (
        weight(saved.pre_classifier.as_ref().unwrap()),
        weight(fresh.pre_classifier.as_ref().unwrap()),
    );
    assert!(
        a.equal(b).all().into_scalar::<bool>(),
        "pre_classifier reloaded"
    );
    assert_eq!(
        weight(&fresh.classifier).dims(),
        [BertConfig::tiny().hidden_size, 3]
    );

    // BigBird's head, written by its own saver, read back with three labels.
    let bigbird = |labels| burnscale::bigbird::BigBirdConfig::tiny().with_num_labels(labels);
    let model = burnscale::bigbird::BigBird::new(&bigbird(2), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bigbird.safetensors");
    burnscale::bigbird::loader::save(&model, &file).unwrap();
    let again = burnscale::bigbird::loader::load(&file, &bigbird(3), Head::Fresh, &device).unwrap();
    let dense = |m: &burnscale::bigbird::BigBird| weight(&m.classifier.as_ref().unwrap().dense);
    assert!(
        dense(&model)
            .equal(dense(&again))
            .all()
            .into_scalar::<bool>()
    );
}

#[test]
fn bad_input_gives_errors_that_name_the_problem() {
    let device = Device::default();
    let (model, cls) = tiny_classifier(&device);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    loader::save(&model, &good).unwrap();
    let load = |config: &BertConfig, head| {
        loader::load(&good, config, head, &device)
            .unwrap_err()
            .to_string()
    };

    // Saved and loaded back: the same model.
    let again = loader::load(&good, &cls, Head::Load, &device).unwrap();
    let probe = BertInput {
        input_ids: Tensor::from_data([[1i64, 5, 7, 2]], &device),
        token_type_ids: Tensor::zeros([1, 4], &device),
        attention_mask: Tensor::ones([1, 4], &device),
    };
    let a = model.logits(model.hidden_states(probe.clone()));
    let b = again.logits(again.hidden_states(probe.clone()));
    assert!(a.equal(b).all().into_scalar::<bool>());

    let three = cls.with_head(BertHead::SequenceClassification { num_labels: 3 });
    assert!(load(&three, Head::Load).contains("fresh head"));
    loader::load(&good, &three, Head::Fresh, &device).unwrap();
    let distil = BertConfig {
        layout: Layout::DistilBert,
        type_vocab_size: 0,
        ..cls
    };
    let err = load(&distil, Head::Load);
    // Named a few (in order) and counted: every tensor of BERT's layout is unknown to it.
    assert!(
        err.contains("has 39 weight(s) this model does not use: bert.embeddings.")
            && err.contains("and 31 more")
            && err.contains("another architecture"),
        "{err}"
    );
    let bigger_vocab = BertConfig {
        vocab_size: 120,
        ..cls
    };
    assert!(load(&bigger_vocab, Head::Load).contains("vocabulary"));

    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let err = loader::load(&truncated, &cls, Head::Load, &device).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");

    let long = BertInput {
        input_ids: Tensor::ones([1, 41], &device),
        token_type_ids: Tensor::zeros([1, 41], &device),
        attention_mask: Tensor::ones([1, 41], &device),
    };
    let err = model.check_input(&long).unwrap_err();
    assert!(
        matches!(err, BertError::SequenceTooLong { len: 41, max: 40 }),
        "{err}"
    );
    let out_of_vocab = BertInput {
        input_ids: Tensor::from_data([[1i64, 99, 7, 2]], &device),
        ..probe.clone()
    };
    assert!(matches!(
        model.check_input(&out_of_vocab),
        Err(BertError::TokenOutOfRange { id: 99, .. })
    ));
    let other_type = BertInput {
        token_type_ids: Tensor::from_data([[0i64, 0, 2, 0]], &device),
        ..probe.clone()
    };
    assert!(matches!(
        model.check_input(&other_type),
        Err(BertError::TokenTypeOutOfRange { id: 2, types: 2 })
    ));
    let short_mask = BertInput {
        attention_mask: Tensor::ones([1, 3], &device),
        ..probe.clone()
    };
    let err = model.check_input(&short_mask).unwrap_err().to_string();
    assert!(err.contains("attention_mask is [1, 3]"), "{err}");
    let empty = BertInput {
        input_ids: Tensor::zeros([1, 0], &device),
        token_type_ids: Tensor::zeros([1, 0], &device),
        attention_mask: Tensor::zeros([1, 0], &device),
    };
    assert!(matches!(
        model.check_input(&empty),
        Err(BertError::EmptySequence)
    ));
    assert!(matches!(
        model.embeddings.check_ids(&[]),
        Err(BertError::EmptySequence)
    ));

    let vocab = dir.path().join("vocab.txt");
    std::fs::write(&vocab, "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n").unwrap();
    let tokenizer = BertTokenizer::from_file(&vocab, true).unwrap();
    // A model table padded by fewer than 64 rows takes it; fewer rows, or many more, not.
    let rows = |vocab_size| BertConfig { vocab_size, ..cls };
    tokenizer.check_vocab(&rows(5), &vocab).unwrap();
    tokenizer.check_vocab(&rows(68), &vocab).unwrap();
    for other in [4, 69] {
        let err = tokenizer.check_vocab(&rows(other), &vocab).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("has 5 tokens but the model's vocabulary {other}")),
            "{err}"
        );
    }
    let ids = tokenizer
        .encode(&["Hello hello", "x"], 16, &device)
        .unwrap();
    let ids: Vec<i64> = ids.input_ids.into_data().try_into_vec_as().unwrap();
    assert_eq!(ids, vec![2, 4, 4, 3, 2, 1, 3, 0]);
    let broken = dir.path().join("tokenizer.json");
    std::fs::write(&broken, "{\"version\": ").unwrap();
    assert!(BertTokenizer::from_file(&broken, true).is_err());

    let vit = dir.path().join("vit.safetensors");
    let vit_model = burnscale::vit::Vit::new(&burnscale::vit::VitConfig::tiny(), &device).unwrap();
    burnscale::vit::loader::save(&vit_model, &vit).unwrap();
    let err = loader::load(&vit, &cls, Head::Load, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vit.embeddings.cls_token"), "{err}");
}
