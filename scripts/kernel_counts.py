#!/usr/bin/env python3
"""Kernels launched per training step, by kernel family, read from cubecl's profiling log.

Runs a training binary of a `cubecl-cpu` (or `cuda`) build twice, SHORT and LONG steps,
with a `cubecl.toml` that logs every kernel cubecl runs, and divides the difference by
LONG - SHORT: what the first steps add (compilation, autotuning, the probe, the final
evaluation) cancels out. Kernel names lose their hash suffix (`ElemwiseFuse_257cec7a` ->
`ElemwiseFuse`); matmuls are one family whatever their tiling.

    cargo build --release --features cubecl-cpu --example mingpt_char
    python3 scripts/kernel_counts.py target/release/examples/mingpt_char -- \\
        --accelerator cubecl-cpu --n-layer 2 --n-head 2 --n-embd 64 --block-size 32 \\
        --batch-size 4 --sample-len 0 [--strategy zero3]

`--json FILE` writes the counts, and `--versus FILE` prints them beside another run's.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

# Each run keeps cubecl's caches (compiled kernels, autotune and throughput results) in its own
# fresh directory: with one cache for both, the second run would skip the tuning the first did
# and the difference would go negative.
TOML = """[profiling.logger]
level = "medium"
file = "{log}"
append = false

[environment]
path = "local"
"""


UNITS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def seconds(field):
    """A Rust `Duration`'s Debug text (`3.74ms`, `533.376µs`) in seconds, or None."""
    m = re.fullmatch(r"([0-9.]+)(ns|µs|ms|s)", field.strip())
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def timed(line):
    """Whether `line` is one kernel's line (`| 42.1µs | Name`, or `| not measured | Name`),
    not a row of the summary table cubecl also writes there."""
    if not line.startswith("|"):
        return False
    first = line.strip().strip("|").split("|")[0].strip()
    return first == "not measured" or seconds(first) is not None


def family(line):
    """The kernel family of one profiling line (`| 42.1µs | Name_1a2b3c4d`)."""
    fields = [f.strip() for f in line.strip().strip("|").split("|")]
    name = re.sub(r"_[0-9a-f]{8}$", "", " | ".join(fields[1:]))
    return "MatmulEntry" if name.startswith("MatmulEntry") else name


# cubecl's throughput probes (cubecl-std `throughput/runners`), which time the device for
# autotuning's bounds: each repeats a kernel until its timing settles, so their count is
# the clock's, not the step's.
PROBES = re.compile(r"(LaunchOverhead|PrimeBuffer|\w+(Direct|Cmma|Read|Write)Throughput)")


def launches(binary, args, steps_flag, steps):
    with tempfile.TemporaryDirectory() as run_dir:
        log = os.path.join(run_dir, "profile.log")
        with open(os.path.join(run_dir, "cubecl.toml"), "w") as toml:
            toml.write(TOML.format(log=log))
        cmd = [os.path.abspath(binary), *args, steps_flag, str(steps)]
        done = subprocess.run(cmd, cwd=run_dir, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        if not os.path.exists(log):
            sys.exit(f"no profiling log from {binary}: was it built with cubecl-cpu or cuda "
                     "and run with that --accelerator?")
        with open(log, encoding="utf-8", errors="replace") as lines:
            kernels = (family(line) for line in lines if timed(line))
            return collections.Counter(k for k in kernels if not PROBES.fullmatch(k))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--steps-flag", default="--max-steps")
    parser.add_argument("--short", type=int, default=3)
    parser.add_argument("--long", type=int, default=5)
    parser.add_argument("--json", help="write the per-step counts here")
    parser.add_argument("--versus", help="a --json file to print beside these counts")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    cli = parser.parse_args(argv[:split])
    cli.args = argv[split + 1:]
    if cli.long <= cli.short:
        sys.exit("--long must be more steps than --short")

    short = launches(cli.binary, cli.args, cli.steps_flag, cli.short)
    long = launches(cli.binary, cli.args, cli.steps_flag, cli.long)
    per_step = {
        name: (long[name] - short[name]) / (cli.long - cli.short)
        for name in set(short) | set(long)
    }
    per_step = {name: n for name, n in per_step.items() if n != 0}
    other = {}
    if cli.versus:
        with open(cli.versus) as f:
            other = json.load(f)["per_step"]
    names = sorted(set(per_step) | set(other), key=lambda n: -max(per_step.get(n, 0), other.get(n, 0)))
    print(f"{'kernel family':56s} {'per step':>9s}" + (f" {'versus':>9s}" if other else ""))
    for name in names:
        row = f"{name[:56]:56s} {per_step.get(name, 0):9.1f}"
        print(row + (f" {other.get(name, 0):9.1f}" if other else ""))
    total = sum(per_step.values())
    print(f"{'total':56s} {total:9.1f}" + (f" {sum(other.values()):9.1f}" if other else ""))
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump({"binary": cli.binary, "args": cli.args, "per_step": per_step,
                       "total": total}, f, indent=1)


if __name__ == "__main__":
    main()
