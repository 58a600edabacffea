"""Generate the tiny minGPT parity fixture for burnscale's Rust port.

Reference generator; never run by CI. Usage (from the repo root):

    python scripts/gen_mingpt_fixture.py [--out-dir tests/fixtures/mingpt]

Writes:
  tiny2.safetensors  weights (HF GPT-2 key layout, Conv1D weights as [in, out]),
                     input.idx / input.targets (int64), output.logits / output.loss,
                     grad.<weight key> for every weight (same layout as the weight)
  tiny2.json         model config
  README.md          provenance
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mingpt_reference import (  # noqa: E402
    GPT,
    GPTConfig,
    hf_grad_dict,
    hf_state_dict,
    is_conv1d_weight,
    load_safetensors,
    save_safetensors,
)

SEED = 0
BATCH = 3
NAME = "tiny2"


def tiny_config() -> GPTConfig:
    return GPTConfig(
        n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8,
        embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
    )


def build(cfg: GPTConfig):
    """Deterministic model + inputs. The RNG draw order below defines the fixture; don't reorder."""
    torch.manual_seed(SEED)
    model = GPT(cfg)
    # minGPT init leaves biases at 0 and LayerNorm at (1, 0); perturb them so a port that
    # forgets a bias or swaps LN weight/bias is caught by the fixture.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.02)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), dtype=torch.long)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), dtype=torch.long)
    targets[0, 0] = -1  # exercise ignore_index
    return model, idx, targets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join("tests", "fixtures", "mingpt"))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    cfg = tiny_config()
    model, idx, targets = build(cfg)
    model.train()  # dropout is 0, so train/eval give identical results; train() mirrors a training step

    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets)
    loss.backward()

    extra = {
        "input.idx": idx,
        "input.targets": targets,
        "output.logits": logits.detach().float(),
        "output.loss": loss.detach().float().reshape(1),
    }
    extra.update(hf_grad_dict(model, prefix="grad."))

    st_path = os.path.join(args.out_dir, f"{NAME}.safetensors")
    cfg_json = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")}
    save_safetensors(model, st_path, extra=extra, metadata={"config": json.dumps(cfg_json), "torch": torch.__version__})
    os.chmod(st_path, 0o644)  # safetensors creates the file 0600

    with open(os.path.join(args.out_dir, f"{NAME}.json"), "w") as f:
        json.dump(cfg_json, f, indent=2)
        f.write("\n")

    verify(cfg, st_path, model)

    write_readme(args.out_dir, st_path, cfg_json)
    print(f"wrote {st_path} ({os.path.getsize(st_path)} bytes); loss = {loss.item():.6f}")


def verify(cfg: GPTConfig, st_path: str, src_model: GPT) -> None:
    """Round trip: a fresh model loaded from the file must reproduce logits, loss and grads exactly."""
    torch.manual_seed(12345)  # different init, so a silent no-op load would fail the check
    fresh = GPT(cfg)
    tensors = load_safetensors(fresh, st_path, strict=True)

    # Weights: identical to the source model, and stored transposed for Conv1D.
    src = dict(src_model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, src[name]), name
        stored = tensors[name]
        want = tuple(reversed(p.shape)) if is_conv1d_weight(name) else tuple(p.shape)
        assert tuple(stored.shape) == want, (name, stored.shape, want)
    assert set(hf_state_dict(fresh)) | {"input.idx", "input.targets", "output.logits", "output.loss"} | {
        "grad." + n for n, _ in fresh.named_parameters()
    } == set(tensors), "unexpected key set"

    fresh.zero_grad(set_to_none=True)
    logits, loss = fresh(tensors["input.idx"], tensors["input.targets"])
    loss.backward()
    assert torch.equal(logits, tensors["output.logits"]), "logits mismatch after reload"
    assert torch.equal(loss.reshape(1), tensors["output.loss"]), "loss mismatch after reload"
    for k, g in hf_grad_dict(fresh, prefix="grad.").items():
        assert torch.equal(g, tensors[k]), f"{k} mismatch after reload"

    # Independent check of the loss: mean NLL over the non-ignored positions.
    t = tensors["input.targets"].view(-1)
    lp = torch.log_softmax(tensors["output.logits"].double().view(-1, cfg.vocab_size), dim=-1)
    keep = t != -1
    nll = -lp[keep].gather(1, t[keep].unsqueeze(1)).mean()
    assert abs(nll.item() - tensors["output.loss"].item()) < 1e-6, (nll.item(), tensors["output.loss"].item())
    print("verify: reload reproduces logits, loss and all gradients bit-exactly")


def write_readme(out_dir: str, st_path: str, cfg_json: dict) -> None:
    from safetensors import safe_open

    rows = []
    with safe_open(st_path, framework="pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            rows.append(f"| `{k}` | {t.get_dtype()} | {list(t.get_shape())} |")

    readme = f"""# minGPT parity fixture (`{NAME}`)

Generated by the reference script (never run by CI):

```
python scripts/gen_mingpt_fixture.py
```

- torch {torch.__version__}, CPU, float32; `torch.manual_seed({SEED})`.
- Model: `scripts/mingpt_reference.py`, a transcription of karpathy/minGPT `mingpt/model.py`
  (pre-LN blocks, fused `c_attn` split q,k,v, tanh GELU, LayerNorm eps 1e-5, untied `lm_head` without bias).
- Config (`{NAME}.json`): {json.dumps(cfg_json)}; all dropout 0.
- minGPT init (N(0, 0.02), `c_proj.weight` N(0, 0.02/sqrt(2*n_layer)), biases 0, LN (1, 0)), then every
  bias and LayerNorm weight/bias perturbed with N(0, 0.02) noise so they are non-trivial.
- Inputs: `input.idx` [{BATCH}, {cfg_json['block_size']}] and `input.targets` uniform in [0, {cfg_json['vocab_size']});
  `input.targets[0, 0] = -1` (ignored). Targets are used as given (no shift inside the model).
- `output.loss` = `cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)` (mean over the
  non-ignored positions), shape [1].
- `grad.<key>`: gradient of `output.loss` w.r.t. weight `<key>`, stored in the same layout as the weight.

Layout: HF GPT-2 keys. HF GPT-2 uses Conv1D, so `attn.c_attn.weight`, `attn.c_proj.weight`,
`mlp.c_fc.weight`, `mlp.c_proj.weight` (and their gradients) are stored as **[in_features, out_features]**,
the transpose of torch `nn.Linear`. `lm_head.weight` is [vocab, n_embd]; `wte` [vocab, n_embd];
`wpe` [block_size, n_embd]. The fused `c_attn` output columns are ordered q | k | v.

The generator re-loads the file into a freshly (differently) initialised model and checks that logits,
loss and every gradient reproduce bit-exactly.

| key | dtype | shape |
|---|---|---|
""" + "\n".join(rows) + "\n"
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(readme)


if __name__ == "__main__":
    main()
