//! minGPT against the PyTorch reference: logits, loss and every gradient of a 2-layer model
//! (fixture from scripts/gen_mingpt_fixture.py, committed under tests/fixtures/mingpt/).

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Gradients;
use burnscale::mingpt::{GptConfig, loader};
use safetensors::SafeTensors;

const FIXTURE: &str = "tests/fixtures/mingpt/tiny2.safetensors";
const TOL: f32 = 1e-5;

struct Fixture {
    f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    i64s: HashMap<String, (Vec<usize>, Vec<i64>)>,
}

fn read_fixture() -> Fixture {
    let bytes = std::fs::read(FIXTURE).expect("fixture present");
    let file = SafeTensors::deserialize(&bytes).expect("fixture is safetensors");
    let (mut f32s, mut i64s) = (HashMap::new(), HashMap::new());
    for (name, view) in file.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        match view.dtype() {
            safetensors::Dtype::F32 => {
                let v = data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
                f32s.insert(name, (shape, v.collect()));
            }
            safetensors::Dtype::I64 => {
                let v = data
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()));
                i64s.insert(name, (shape, v.collect()));
            }
            other => panic!("unexpected dtype {other:?} in fixture"),
        }
    }
    Fixture { f32s, i64s }
}

/// Writes the fixture's weights (the keys without an `input.`/`output.`/`grad.` prefix) as a
/// GPT-2-layout checkpoint, the way a user's file looks.
fn write_weights(fixture: &Fixture, path: &Path) {
    let is_weight = |k: &str| {
        !["input.", "output.", "grad."]
            .iter()
            .any(|p| k.starts_with(p))
    };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = fixture
        .f32s
        .iter()
        .filter(|(k, _)| is_weight(k))
        .map(|(k, (shape, v))| {
            (
                k.clone(),
                shape.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views = bytes.iter().map(|(k, shape, b)| {
        (
            k.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    // NaN compares as the largest difference, never as none.
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

struct GradsByKey<'a> {
    path: Vec<String>,
    grads: &'a Gradients,
    out: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl ModuleVisitor for GradsByKey<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let key = loader::burn_to_hf(&self.path.join("."));
        let mut grad = param
            .val()
            .grad(self.grads)
            .expect("every parameter has a gradient");
        if key == "lm_head.weight" {
            grad = grad.transpose(); // Burn's Linear is [in, out]; nn.Linear is [out, in]
        }
        let shape = grad.dims().to_vec();
        self.out
            .insert(key, (shape, grad.into_data().try_into_vec().unwrap()));
    }
}

#[test]
fn logits_loss_and_gradients_match_pytorch() {
    let fixture = read_fixture();
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("model.safetensors");
    write_weights(&fixture, &weights);

    let device = Device::default().autodiff();
    let config = GptConfig::tiny().with_dropout(0.0);
    let model = loader::load(&weights, &config, &device).expect("fixture weights load");

    let int = |key: &str| {
        let (shape, v) = fixture.i64s[key].clone();
        Tensor::<2, Int>::from_data(TensorData::new(v, shape), &device)
    };
    let (logits, loss) = model.forward_loss(int("input.idx"), int("input.targets"));

    let (shape, want) = &fixture.f32s["output.logits"];
    assert_eq!(&logits.dims().to_vec(), shape);
    let got: Vec<f32> = logits.into_data().try_into_vec().unwrap();
    let d = max_abs_diff(&got, want);
    assert!(d < TOL, "logits differ by {d}");

    let want_loss = fixture.f32s["output.loss"].1[0];
    let got_loss = loss.clone().into_scalar::<f32>();
    assert!(
        (got_loss - want_loss).abs() < TOL,
        "loss {got_loss} vs {want_loss}"
    );

    let grads = loss.backward();
    let mut visitor = GradsByKey {
        path: Vec::new(),
        grads: &grads,
        out: HashMap::new(),
    };
    model.visit(&mut visitor);
    let expected: Vec<&String> = fixture
        .f32s
        .keys()
        .filter(|k| k.starts_with("grad."))
        .collect();
    assert_eq!(visitor.out.len(), expected.len(), "one gradient per weight");
    for key in expected {
        let (want_shape, want) = &fixture.f32s[key];
        let (shape, got) = &visitor.out[key.strip_prefix("grad.").unwrap()];
        assert_eq!(shape, want_shape, "{key}");
        let d = max_abs_diff(got, want);
        assert!(d < TOL, "{key} differs by {d}");
    }
}
