"""Generate the Adafactor fixture: HF transformers' `Adafactor.step` (transformers 4.x,
`src/transformers/optimization.py`), written out line by line in numpy float32, for
crates/train/src/adafactor.rs to be checked against an implementation it does not share.

Reference generator; never run by CI. Usage (from the repo root):

    pip install numpy
    python scripts/gen_adafactor_fixture.py [--out tests/fixtures/adafactor/steps.json]

HF's step for one parameter (defaults: eps (1e-30, 1e-3), clip_threshold 1.0, decay_rate
-0.8, warmup_init False):
- step += 1; RMS = rms(p) (before the update)
- lr = (min(1e-2, 1/sqrt(step)) if relative_step else lr) * (max(1e-3, RMS) if
  scale_parameter else 1)
- beta2t = 1 - step^-0.8; update = grad^2 + 1e-30
- factored (a matrix): row = beta2t row + (1 - beta2t) mean(update, -1), col likewise over
  -2; update = rsqrt(row / mean(row)) rsqrt(col) grad; else v = beta2t v + (1 - beta2t)
  update, update = rsqrt(v) grad
- update /= max(1, rms(update) / 1.0); update *= lr
- with beta1: m = beta1 m + (1 - beta1) update; update = m
- with weight decay: p += p * (-weight_decay * lr); p -= update

burnscale runs `relative_step` and `scale_parameter` together (`--adafactor-relative-step`),
and with them its step is min(--lr, 1/sqrt(t)): the cases below give --lr 1e-2, HF's fixed
cap. Each case: a 6 x 5 matrix (factored) and a 7-vector, three steps with given gradients,
the parameter after each.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

F32 = np.float32
EPS1, EPS2, CLIP, DECAY = 1e-30, 1e-3, 1.0, -0.8


def rms(x: np.ndarray) -> F32:
    return F32(np.sqrt(np.mean(x * x, dtype=F32)))


def hf_step(p, grad, state, lr, beta1, weight_decay, relative_step):
    """One HF Adafactor step of `p` (float32, modified copy returned)."""
    p = p.copy()
    factored = p.ndim >= 2
    state["step"] += 1
    step = state["step"]
    state["RMS"] = rms(p)
    step_size = min(1e-2, 1.0 / math.sqrt(step)) if relative_step else lr
    scale = max(EPS2, float(state["RMS"])) if relative_step else 1.0
    lr_t = F32(step_size * scale)

    beta2t = F32(1.0 - math.pow(step, DECAY))
    update = grad * grad + F32(EPS1)
    if factored:
        row = state.get("row", np.zeros(p.shape[0], F32))
        col = state.get("col", np.zeros(p.shape[1], F32))
        row = row * beta2t + np.mean(update, axis=-1, dtype=F32) * F32(1.0 - beta2t)
        col = col * beta2t + np.mean(update, axis=-2, dtype=F32) * F32(1.0 - beta2t)
        state["row"], state["col"] = row, col
        r_factor = (1.0 / np.sqrt(row / np.mean(row, dtype=F32))).astype(F32)[:, None]
        c_factor = (1.0 / np.sqrt(col)).astype(F32)[None, :]
        update = (r_factor * c_factor).astype(F32) * grad
    else:
        v = state.get("v", np.zeros_like(p))
        v = v * beta2t + update * F32(1.0 - beta2t)
        state["v"] = v
        update = (1.0 / np.sqrt(v)).astype(F32) * grad
    update = update / max(F32(1.0), rms(update) / F32(CLIP))
    update = update * lr_t
    if beta1 is not None:
        m = state.get("m", np.zeros_like(p))
        m = m * F32(beta1) + update * F32(1.0 - beta1)
        state["m"] = m
        update = m
    if weight_decay != 0.0:
        p = p + p * F32(-weight_decay * lr_t)
    return (p - update).astype(F32)


def case(rng, lr, beta1, weight_decay, relative_step):
    out = {
        "lr": lr,
        "beta1": beta1,
        "weight_decay": weight_decay,
        "relative_step": relative_step,
    }
    for name, shape in [("matrix", (6, 5)), ("vector", (7,))]:
        p = rng.normal(0.0, 0.5, shape).astype(F32)
        grads = [rng.normal(0.0, 1.0, shape).astype(F32) for _ in range(3)]
        state = {"step": 0}
        after = []
        q = p
        for g in grads:
            q = hf_step(q, g, state, lr, beta1, weight_decay, relative_step)
            after.append(q.ravel().tolist())
        out[name] = {
            "shape": list(shape),
            "param": p.ravel().tolist(),
            "grads": [g.ravel().tolist() for g in grads],
            "params_after": after,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/adafactor/steps.json")
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    cases = [
        case(rng, 1e-2, 0.9, 0.1, False),
        case(rng, 1e-2, None, 0.0, True),
        case(rng, 1e-2, 0.9, 0.1, True),
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"source": "scripts/gen_adafactor_fixture.py", "cases": cases}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
