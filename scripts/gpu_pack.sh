#!/usr/bin/env bash
# Strips the `cuda` binaries given and packs them into .gpu/bins.tar.xz for the device tool,
# which carries 64 MiB in all: one xz stream whose dictionary is larger than a binary, so
# each binary after the first costs only what differs (vit_finetune and mingpt_throughput:
# 45 MB together, 38 MB each alone). scripts/gpu_session.sh unpacks it on the device into
# .gpu/bins/, each binary under its name without cargo's hash.
#
#     scripts/gpu_pack.sh target-cuda/release/examples/vit_finetune \
#         target-cuda/release/deps/mingpt_throughput-0123456789abcdef
set -eu
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
rm -rf .gpu/bins && mkdir -p .gpu/bins
for bin in "$@"; do
    strip -o ".gpu/bins/$(basename "$bin" | sed 's/-[0-9a-f]\{16\}$//')" "$bin"
done
tar cf - -C .gpu bins | xz -T1 --lzma2=preset=9,dict=512MiB >.gpu/bins.tar.xz
rm -rf .gpu/bins
ls -l .gpu/bins.tar.xz
