"""PyTorch side of `cargo bench --bench models`: forward and forward+backward time per sample
of each model's base config (HF transformers, random init, CPU), and its parameter count.

Reference benchmark; never run by CI. Prints one JSON line per model to stdout:

    python scripts/bench_models_torch.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BigBirdConfig,
    BigBirdForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

# name -> (model, batch, inputs); shapes match benches/models.rs.
def models(batch: int, seq: int, bigbird_seq: int):
    ids = lambda t: {"input_ids": torch.randint(1000, 20000, (batch, t)), "attention_mask": torch.ones(batch, t, dtype=torch.long)}
    yield "vit-b-16", ViTForImageClassification(ViTConfig(num_labels=1000)), {"pixel_values": torch.randn(batch, 3, 224, 224)}
    yield "bert-base", BertForSequenceClassification(BertConfig(num_labels=2)), ids(seq)
    yield "distilbert-base", DistilBertForSequenceClassification(DistilBertConfig(num_labels=2)), ids(seq)
    yield "bigbird-roberta-base", BigBirdForSequenceClassification(BigBirdConfig(num_labels=2)), ids(bigbird_seq)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bigbird-seq", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name, model, inputs in models(args.batch, args.seq, args.bigbird_seq):
        model.train()
        for m in model.modules():  # no dropout: burnscale's side runs without it too
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0

        def forward():
            with torch.no_grad():
                model(**inputs)

        def forward_backward():
            model.zero_grad(set_to_none=True)
            model(**inputs).logits.sum().backward()

        fwd = timed(forward, args.repeats)
        fwd_bwd = timed(forward_backward, args.repeats)
        print(json.dumps({
            "model": name,
            "params": sum(p.numel() for p in model.parameters()),
            "forward_s_per_sample": fwd / args.batch,
            "forward_backward_s_per_sample": fwd_bwd / args.batch,
            "torch_version": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
