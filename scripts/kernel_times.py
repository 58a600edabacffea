#!/usr/bin/env python3
"""Device time per training step, by kernel family, read from one cubecl profiling log.

cubecl's profiling logger (`[profiling.logger] level = "medium"` in `cubecl.toml`) times every
kernel on the device and writes one line per kernel (`| 42.1µs | Name_1a2b3c4d`).
`scripts/gpu_table.sh profile` takes such a log on a lent GPU. This script cuts the log into
steps at each kernel whose name contains MARKER: a kernel a step runs once, at its start.
`vit_finetune` resizes each batch on the device, so its marker is `InterpolateTileKernel`.
Given the run's STEPS, it keeps steps 2 to STEPS - 1: not what precedes the second marker
(initialisation, compilation, autotuning, the first step) nor the last step (it runs into
the final evaluation, whose batches may hold the marker too), and prints the median kept
step's kernels and device time by family, then each kept step's total:

    python3 scripts/kernel_times.py OUT/profile.log.gz --marker InterpolateTileKernel --steps 8

Kernel families are `scripts/kernel_counts.py`'s. Profiling times kernels one by one, so a
step's summed device time exceeds its unprofiled wall time by the timing's own cost (~10%
on an H100 for ViT-L/16).
"""

import argparse
import collections
import gzip
import statistics
import sys

from kernel_counts import family, seconds


def kernels(path):
    """(family, seconds) of every timed kernel in the log at `path`, in order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.startswith("|"):
                continue
            duration = seconds(line.strip().strip("|").split("|")[0])
            if duration is not None:
                yield family(line), duration


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="a cubecl profiling log (.gz or plain)")
    parser.add_argument("--marker", required=True,
                        help="part of the name of a kernel each step runs once, at its start")
    parser.add_argument("--steps", type=int, required=True, help="the run's --max-steps")
    parser.add_argument("--top", type=int, default=15, help="families to print")
    cli = parser.parse_args()

    steps, step = [], None
    for name, duration in kernels(cli.log):
        if cli.marker in name:
            if step is not None:
                steps.append(step)
            step = []
        if step is not None:
            step.append((name, duration))
    if len(steps) < cli.steps - 1 or cli.steps < 3:
        sys.exit(f"{len(steps)} whole steps start with a kernel named like {cli.marker!r} in "
                 f"{cli.log}: steps 2 to {cli.steps - 1} of {cli.steps} are not all there")
    steps = steps[1:cli.steps - 1]
    totals = [sum(d for _, d in s) for s in steps]
    median = steps[totals.index(statistics.median_low(totals))]
    count, time = collections.Counter(), collections.Counter()
    for name, duration in median:
        count[name] += 1
        time[name] += duration
    total = sum(time.values())
    print(f"median of {len(steps)} steps: {len(median)} kernels, {total * 1e3:.1f} ms of device time")
    print(f"{'kernel family':56s} {'kernels':>8s} {'ms':>8s} {'share':>6s}")
    for name, t in time.most_common(cli.top):
        print(f"{name[:56]:56s} {count[name]:8d} {t * 1e3:8.2f} {t / total:6.1%}")
    rest = total - sum(t for _, t in time.most_common(cli.top))
    if rest > 0:
        print(f"{'(the other families)':56s} {'':8s} {rest * 1e3:8.2f} {rest / total:6.1%}")
    print("each step's device time, ms: " + ", ".join(f"{t * 1e3:.1f}" for t in totals))


if __name__ == "__main__":
    main()
