"""PyTorch side of the ViT training-speed comparison: HF transformers' ViTForImageClassification
with a ViT preset's shape, random init, trained the way `vit_finetune` trains (AdamW, clip 1.0,
dropout 0), timed per step after warm-up. Random images and labels: speed only.

Reference benchmark; never run by CI. Prints one JSON line to stdout:

    python scripts/bench_vit_torch.py --device cuda --model vit-l-16 --precision bf16-true
    # burnscale's side of the same row:
    cargo run --release --features cuda --example vit_finetune -- --weights none \
        --model vit-l-16 --image-size 224 --batch-size 16 --precision bf16-true --max-steps 30

Precisions as burnscale names them: 32-true, bf16-mixed (autocast), bf16-true (bf16 weights
and optimizer state). On CUDA the peak memory is torch.cuda.max_memory_reserved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import ViTConfig, ViTForImageClassification

# burnscale's VitConfig presets: (hidden, layers, heads, mlp, patch).
PRESETS = {
    "vit-s-14": (384, 12, 6, 1536, 14),
    "vit-b-16": (768, 12, 12, 3072, 16),
    "vit-l-16": (1024, 24, 16, 4096, 16),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit-l-16", choices=sorted(PRESETS))
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-labels", type=int, default=10)
    ap.add_argument("--precision", default="bf16-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    hidden, layers, heads, mlp, patch = PRESETS[args.model]
    config = ViTConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=mlp,
        patch_size=patch, image_size=args.image_size, num_labels=args.num_labels,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    device = torch.device(args.device)
    model = ViTForImageClassification(config).to(device)
    if args.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    n = args.warmup + args.steps
    images = torch.randn(n, args.batch_size, 3, args.image_size, args.image_size, dtype=dtype, device=device)
    labels = torch.randint(0, args.num_labels, (n, args.batch_size), device=device)

    def step(i):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = model(pixel_values=images[i], labels=labels[i]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()  # waits for the step: keeps the timing honest

    t0 = time.perf_counter()
    step(0)
    first_step_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    times = []
    for i in range(args.warmup, n):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    result = {
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "step_s_median": round(statistics.median(times), 5),
        "step_s_min": round(min(times), 5),
        "first_step_s": round(first_step_s, 3),
        "device": str(device),
    }
    if device.type == "cuda":
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
