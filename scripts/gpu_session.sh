#!/usr/bin/env bash
# Several parts (gpu_table.sh tables, or any command) in one device call, each ended by a
# deadline so that the call returns inside its time and keeps what the finished parts wrote:
#
#     BUDGET=560 bash scripts/gpu_session.sh \
#         'vit VIT_ROWS=single bash scripts/gpu_table.sh vit .gpu/bins/vit_finetune $OUT/vit' \
#         'mingpt@100 bash scripts/gpu_table.sh mingpt .gpu/bins/mingpt_throughput $OUT/mingpt' \
#         'vit3@15 VIT_ROWS=zero3 bash scripts/gpu_table.sh vit .gpu/bins/vit_finetune $OUT/vit3'
#
# Each argument is NAME[@RESERVE] and a command (environment assignments first, `$OUT` as the
# device tool sets it): the part runs until BUDGET - RESERVE seconds after the call began
# (BUDGET default 560, RESERVE default 0), its output in $OUT/NAME.out. At its deadline the
# part's whole session is killed: gpu_table.sh's `timeout`s put their commands in process
# groups of their own, which a group kill misses. .gpu/bins.tar.xz (scripts/gpu_pack.sh) is
# unpacked first into .gpu/bins/, and .gpu/cubecl_cache.tgz or .tar.xz (an earlier call's)
# into ./target. At the end: each part's phases and summaries, and the kernel cache (./target,
# where cubecl keeps it) as $OUT/cubecl_cache.tgz for a later call.
set -u
export OUT
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
if [ -e .gpu/bins.tar.xz ]; then
    python3 -c "import lzma, tarfile; tarfile.open(fileobj=lzma.open('.gpu/bins.tar.xz')).extractall('.gpu')"
    chmod +x .gpu/bins/*
    echo "unpacked $(ls .gpu/bins | tr '\n' ' ')after $(elapsed) s"
fi
# A kernel cache an earlier call returned (its cubecl_cache.tgz), carried as .gpu/, or the
# same recompressed by xz (`gzip -dc cubecl_cache.tgz | xz -9 >.gpu/cubecl_cache.tar.xz`:
# 5 MB against gzip's 13, room that a third binary in bins.tar.xz needs).
for cache in .gpu/cubecl_cache.tgz .gpu/cubecl_cache.tar.xz; do
    [ -e "$cache" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall()" \
        "$cache" && echo "kernel cache $cache unpacked"
done
names=()
for part in "$@"; do
    head=${part%% *}
    name=${head%@*}
    reserve=0
    [ "$head" != "$name" ] && reserve=${head#*@}
    cap=$((${BUDGET:-560} - reserve - $(elapsed)))
    [ "$cap" -gt 0 ] || { echo "part $name: no time left"; continue; }
    echo "part $name: up to $cap s, from $(elapsed) s"
    setsid bash -c "exec env ${part#* }" >"$OUT/$name.out" 2>&1 &
    pid=$!
    (sleep "$cap" && pkill -TERM -s "$pid" && sleep 3 && pkill -KILL -s "$pid") 2>/dev/null &
    watch=$!
    wait "$pid"
    kill "$watch" 2>/dev/null
    # What a killed gpu_table.sh leaves: its cubecl.toml, nvidia-smi, a PyTorch side.
    rm -f cubecl.toml
    pkill -f "nvidia-smi --query"
    pkill -f "scripts/bench_"
    echo "part $name: ended at $(elapsed) s"
    names+=("$name")
done
for name in "${names[@]}"; do
    echo "### $name"
    grep -a "^== \|first step\|rc=\|^|" "$OUT/$name/log.txt" 2>/dev/null | cut -c1-240
    # Each burnscale phase's summary in a line: the device tool returns a few files only.
    for json in "$OUT/$name"/*.json; do
        [ -e "$json" ] && python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))
keys = ("step_s_median", "first_step_s", "warmup_s", "samples_per_s", "tokens_per_s", "matmul", "mfu")
ranks = [r.get("device_peak_mem_bytes") for r in s.get("ranks", [])]
print(sys.argv[1].rsplit("/", 1)[-1], {k: s[k] for k in keys if k in s}, "device_peak", ranks)' "$json"
    done
    tail -n 5 "$OUT/$name.out"
done
[ -d target ] && tar czf "$OUT/cubecl_cache.tgz" target
ls -l "$OUT"
