"""Generate the 8-bit AdamW fixture: a reference implementation, in numpy, of the same
block-wise dynamic-tree quantization and update as crates/train/src/adam8bit.rs.

Reference generator; never run by CI. Usage (from the repo root):

    pip install numpy [bitsandbytes]
    python scripts/gen_adam8bit_fixture.py [--out tests/fixtures/adam8bit/steps.json]

With bitsandbytes installed (it pulls PyTorch; its maps need only the CPU) the script checks
its maps against bitsandbytes' own and says so.

The algorithm is bitsandbytes' AdamW8bit (its `create_dynamic_map` and the blockwise 8-bit
Adam kernel, `kOptimizerStatic8bit2StateBlockwise`), written out here without bitsandbytes
(whose 8-bit optimizers need a GPU), with two choices of burnscale's own that the Rust side
shares: blocks of 256 run along rows (a row of n elements is cut into ceil(n / 256) blocks of
min(n, 256), the last one zero-padded), and a value is encoded as its exact nearest map value
(ties to the lower) where bitsandbytes' kernel searches approximately. Every operation is
in float32, in the Rust code's order; scalars are computed in float64 and rounded once. The
maps are bitsandbytes' to the bit: float32 throughout, as `torch.linspace` and PyTorch's
products compute them.

The fixture: a 4 x 300 parameter (two blocks per row; the last row all zero, as a shard's
padding row), three steps with given gradients, the parameter after each step and both
moments' codes and absmax after the last.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

F32 = np.float32
BLOCK = 256
SCALES = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]


def torch_linspace(start: float, end: float, items: int) -> np.ndarray:
    """torch.linspace(start, end, items, dtype=torch.float32) as PyTorch's x86-64 CPU kernel
    computes it: a float32 step, the first half counted up from `start` and the rest down
    from `end`, each value one fused multiply-add (rounded once: in float64 these products
    and sums are exact, so rounding the float64 result to float32 is the fused rounding)."""
    start, end = F32(start), F32(end)
    step = (end - start) / F32(items - 1)
    half = items // 2
    values = [
        np.float64(start) + np.float64(step) * k
        if k < half
        else np.float64(end) - np.float64(step) * (items - k - 1)
        for k in range(items)
    ]
    return np.array(values, dtype=np.float64).astype(F32)


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed)`, in its float32 arithmetic."""
    data = []
    for i, scale in enumerate(SCALES):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch_linspace(0.1, 1.0, items)
        means = (boundaries[:-1] + boundaries[1:]) / F32(2.0)
        for mean in means:
            data.append(F32(scale) * mean)
            if signed:
                data.append(F32(-scale) * mean)
    data += [F32(0.0), F32(1.0)]
    data.sort()
    assert len(data) == 256
    return np.array(data, dtype=F32)


def check_against_bitsandbytes(signed_map: np.ndarray, unsigned_map: np.ndarray) -> None:
    """Where bitsandbytes is installed (its maps need only PyTorch's CPU), its own maps."""
    try:
        from bitsandbytes.functional import create_dynamic_map
    except ImportError:
        print("bitsandbytes not installed: the maps are not checked against its own")
        return
    for signed, ours in ((True, signed_map), (False, unsigned_map)):
        theirs = create_dynamic_map(signed=signed).numpy()
        assert (theirs == ours).all(), f"signed={signed}: differs from bitsandbytes' map"
    print("the maps equal bitsandbytes' create_dynamic_map(signed=True/False)")


def blocks(x: np.ndarray):
    rows, row_len = x.shape
    length = min(row_len, BLOCK)
    count = -(-row_len // length)
    pad = np.zeros((rows, count * length - row_len), dtype=F32)
    return np.concatenate([x, pad], axis=1).reshape(rows, count, length)


def unblocks(x: np.ndarray, row_len: int) -> np.ndarray:
    rows, count, length = x.shape
    return x.reshape(rows, count * length)[:, :row_len]


def quantize(x: np.ndarray, code: np.ndarray, signed: bool):
    b = blocks(x)
    absmax = np.abs(b).max(axis=2, keepdims=True)
    divisor = np.where(absmax == 0, F32(1.0), absmax)
    normed = unblocks(b / divisor, x.shape[1])
    midpoints = (code[:-1] + code[1:]) / F32(2.0)
    idx = np.searchsorted(midpoints, normed, side="left")
    if signed:
        idx = idx - ((normed < 0) & (code[idx] >= 0))
    return idx.astype(np.uint8), absmax.reshape(x.shape[0], -1)


def dequantize(codes: np.ndarray, absmax: np.ndarray, code: np.ndarray) -> np.ndarray:
    values = code[codes.astype(np.int64)]
    return unblocks(blocks(values) * absmax[:, :, None], codes.shape[1])


def step(p, g, state, lr, b1, b2, eps, wd, signed_map, unsigned_map):
    b1, b2 = float(F32(b1)), float(F32(b2))
    if state is None:
        t = 1
        m = g * F32(1.0 - b1)
        v = (g * g) * F32(1.0 - b2)
    else:
        t = state["time"] + 1
        m = dequantize(*state["m"], signed_map) * F32(b1) + g * F32(1.0 - b1)
        v = dequantize(*state["v"], unsigned_map) * F32(b2) + (g * g) * F32(1.0 - b2)
    correction_1 = 1.0 - b1**t
    correction_2 = math.sqrt(1.0 - b2**t)
    step_size = lr * correction_2 / correction_1
    update = m / (np.sqrt(v) + F32(correction_2 * float(F32(eps))))
    p = p - update * F32(step_size)
    decay = lr * float(F32(wd))
    if decay > 0:
        p = p * F32(1.0 - decay)
    state = {
        "time": t,
        "m": quantize(m, signed_map, True),
        "v": quantize(v, unsigned_map, False),
    }
    return p, state


def floats(a: np.ndarray) -> list:
    return [float(x) for x in a.astype(F32).ravel()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/adam8bit/steps.json")
    args = parser.parse_args()
    rng = np.random.default_rng(8)
    rows, row_len = 4, 300
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    p = rng.standard_normal((rows, row_len)).astype(F32) * F32(0.02)
    p[rows - 1] = 0.0
    signed_map, unsigned_map = dynamic_map(True), dynamic_map(False)
    check_against_bitsandbytes(signed_map, unsigned_map)
    fixture = {
        "shape": [rows, row_len],
        "lr": lr,
        "beta1": b1,
        "beta2": b2,
        "epsilon": eps,
        "weight_decay": wd,
        "signed_map": floats(signed_map),
        "unsigned_map": floats(unsigned_map),
        "param": floats(p),
        "grads": [],
        "params_after": [],
    }
    state = None
    for k in range(3):
        # Gradients over six orders of magnitude, so every exponent of the map is used.
        scale = np.float32(10.0) ** rng.integers(-6, 0, size=(rows, row_len)).astype(F32)
        g = (rng.standard_normal((rows, row_len)).astype(F32) * scale).astype(F32)
        g[rows - 1] = 0.0
        p, state = step(p, g, state, lr, b1, b2, eps, wd, signed_map, unsigned_map)
        fixture["grads"].append(floats(g))
        fixture["params_after"].append(floats(p))
    for name, (codes, absmax) in (("moment_1", state["m"]), ("moment_2", state["v"])):
        fixture[f"{name}_codes"] = [int(c) for c in codes.ravel()]
        fixture[f"{name}_absmax"] = floats(absmax)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
