"""PyTorch training-throughput baseline for the minGPT reference model (CPU or CUDA).

Reference benchmark; never run by CI. Usage (from the repo root):

    python scripts/bench_mingpt_torch.py                # gpt-mini defaults, 2 threads
    python scripts/bench_mingpt_torch.py --profile      # + torch.profiler op table (stderr)
    python scripts/bench_mingpt_torch.py --device cuda --precision bf16-mixed

Precisions as burnscale names them: 32-true (f32), bf16-mixed (f32 weights, bf16 autocast),
bf16-true (bf16 weights and optimizer state). On CUDA the peak memory is
torch.cuda.max_memory_reserved (what the caching allocator holds), and the first step (which
includes cuBLAS/kernel warm-up) is reported apart.

A train step mirrors minGPT's Trainer.run: forward, zero_grad(set_to_none=True),
backward, clip_grad_norm_(1.0), AdamW step (minGPT's decay/no-decay groups).
Prints exactly one JSON line to stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mingpt_reference import GPT, GPTConfig  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Model defaults = minGPT 'gpt-mini'; vocab 65 = tiny-shakespeare char vocab.
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=192)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=65)
    ap.add_argument("--dropout", type=float, default=0.1, help="embd/resid/attn dropout")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    ap.add_argument("--profile", action="store_true", help="profile one extra step and print the top ops")
    ap.add_argument("--profile-rows", type=int, default=25)
    return ap.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    cfg = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        vocab_size=args.vocab_size, block_size=args.block_size,
        embd_pdrop=args.dropout, resid_pdrop=args.dropout, attn_pdrop=args.dropout,
    )
    device = torch.device(args.device)
    model = GPT(cfg).to(device)
    if args.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model.train()
    opt = model.configure_optimizers(learning_rate=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    # Pre-generate random (x, y) batches so data generation is outside the timed region.
    # y is x shifted by one position, as minGPT's datasets produce.
    n_batches = args.warmup + args.steps + (1 if args.profile else 0)
    data = torch.randint(0, args.vocab_size, (n_batches, args.batch_size, args.block_size + 1), dtype=torch.long).to(device)
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    def train_step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    first_step_s = None
    for i in range(args.warmup):
        t0 = time.perf_counter()
        train_step(*batches[i])
        sync()
        if first_step_s is None:
            first_step_s = time.perf_counter() - t0

    step_times = []
    loss = None
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = train_step(*batches[i])
        loss_val = loss.item()  # waits for the step (on CUDA too): keeps the timing honest
        step_times.append(time.perf_counter() - t0)

    total = sum(step_times)
    tokens = args.batch_size * args.block_size * args.steps
    result = {
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "params": model.num_params(include_lm_head=True),
        "params_excl_lm_head": model.num_params(include_lm_head=False),  # the number minGPT prints
        "tokens_per_s": round(tokens / total, 1),
        "step_ms": round(1000 * total / args.steps, 2),
        # The host can be noisy (shared VMs): median/min are more robust than the mean.
        "step_ms_median": round(1000 * statistics.median(step_times), 2),
        "step_ms_min": round(1000 * min(step_times), 2),
        "tokens_per_s_median": round(args.batch_size * args.block_size / statistics.median(step_times), 1),
        "threads": torch.get_num_threads(),
        "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
        "block_size": args.block_size, "batch_size": args.batch_size, "vocab_size": args.vocab_size,
        "dropout": args.dropout, "steps": args.steps, "warmup": args.warmup,
        "final_loss": round(loss_val, 4) if loss is not None else None,
        "device": str(device),
        "precision": args.precision,
        "first_step_s": round(first_step_s, 3) if first_step_s is not None else None,
    }
    if device.type == "cuda":
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["gpu"] = torch.cuda.get_device_name()

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(*batches[-1])
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows),
            file=sys.stderr,
        )

    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
