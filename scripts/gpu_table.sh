#!/usr/bin/env bash
# Issue 14's GPU tables on a lent GPU machine, each in one device call (the device tool
# carries 64 MiB, one stripped and xz'd binary at a time).
#
#     scripts/gpu_table.sh mingpt BENCH OUT
#     scripts/gpu_table.sh vit VIT_FINETUNE OUT
#     scripts/gpu_table.sh article ARTICLE_BENCH OUT [BENCH FLAGS...]
#     scripts/gpu_table.sh profile BINARY OUT STEPS [BINARY FLAGS...]
#     scripts/gpu_table.sh probe VIT_FINETUNE OUT
#     scripts/gpu_table.sh nccl COLLECTIVE_CHECK OUT
#     scripts/gpu_table.sh test TEST_BINARY OUT [FILTER...]
#
# mingpt: minGPT beside PyTorch eager and the plain Burn loop, cuBLAS's products
# (`--matmul cublas`) and the engine's ZeRO-3 variants beside single, bf16-mixed, a second
# process of the same configuration for the first step with a warm kernel cache, the 303M
# row, and CUDA's stream-ordered allocator under cubecl's pools beside the default (on an
# H200 the phases took 133, over 140, 4, 72 and 4 s with a cold kernel cache: about 6
# minutes, the machine's start aside). BENCH is a `cargo bench
# --no-run --features cuda --bench mingpt_throughput` binary. MINGPT_ROWS=matmul: the 57M rows
# (f32, bf16-mixed) with cubecl's and cuBLAS's products, and the 303M row, nothing else;
# MINGPT_ROWS=bf16: the 57M bf16-mixed row alone, cubecl's products and cuBLAS's.
#
# vit: the article's ViT-L/16 at 224 px, batch 16, AdamW: PyTorch eager
# (scripts/bench_vit_torch.py: 20 timed steps after 3 warm-up ones) and `vit_finetune
# --weights none` (30 steps, the first reported apart) in bf16-true (and again with
# `--matmul cublas`: cuBLAS's products instead of cubecl's) and bf16-mixed (likewise), then
# under zero3 on one rank: bf16-true, bf16-mixed and bf16-true with `--offload params`
# (VIT_ROWS=single: the first four burnscale rows only; VIT_ROWS=zero3: the three ZeRO-3
# rows only, each given VIT_FLAGS as well, e.g. VIT_FLAGS="--matmul cublas"). VIT_FINETUNE
# is a `cargo build --release --features cuda --example vit_finetune` binary.
#
# article: one article's tables on the GPU at the article's size (issue 17): ARTICLE_BENCH is
# a `cargo bench --no-run --features cuda --bench hf_bert_large` (or `--bench fabric_vit`)
# binary, given BENCH FLAGS (hf_bert_large's `--steps 3` for a shorter run); the tables' CSV,
# JSON and SVG land in OUT/article-tables. The tables are written at the end; each rung's
# summary line goes to log.txt as it ends, so a run cut by the cap keeps the finished ones.
#
# profile: BINARY (a training example) run for STEPS `--max-steps` with cubecl's profiling log
# on (each kernel timed on the device); OUT gets the log as profile.log.gz, which
# `scripts/kernel_times.py` splits into steps and sums by kernel family.
#
# probe: a tiny ViT for two steps in bf16-true, for its summary's `peak_flops`: the MFU probe's
# bf16 GEMM rate (a chain of 8192^3 products), the binary's GEMMs measured with few kernels to
# compile (a cuda-nvrtc binary compiled ViT-L/16's kernels for over 6 minutes).
#
# test: a `cargo test --no-run --features cuda` binary (its tests that need a GPU run there:
# `burnscale_nn`'s `gemm` for cuBLAS's products) with this script's environment.
#
# nccl: COLLECTIVE_CHECK (`cargo build --release --features cuda --example collective_check`)
# runs the conformance suite on the NCCL engine, one rank (NCCL refuses two ranks on one GPU),
# then with that rank leaving and panicking after its first collective: the engine's leave
# in its `Drop`, and under unwinding, which must end at once with a failure, not hang or
# abort. NCCL_DEBUG=VERSION logs NCCL's version (a device mean needs ncclAvg, NCCL 2.10).
#
# AUTOTUNE=minimal|balanced|extensive|full sets cubecl's autotune level (by default
# balanced: a group's tuning stops at the first candidate within 0.8 of the roofline peak
# that cubecl measures itself; full sets no such bound), tunes afresh in every process (no
# autotune cache, which keeps a decision whatever the level) and logs every candidate's time
# or error, the bounds and the winner to OUT/autotune.log.
#
# NO_TORCH=1 leaves out the vit table's PyTorch phases (when a call on the same warm machine
# has taken them).
#
# ACCELERATOR=libtorch (default cuda) runs burnscale's phases on Burn's LibTorch backend, from
# binaries built with `--features tch` against this machine's PyTorch (scripts/libtorch.sh
# cuda), whose libraries it puts on LD_LIBRARY_PATH.
#
# OUT: a folder for log.txt (the tables, each phase's start and end), smi.csv (nvidia-smi
# every 250 ms: the device's own memory figure) and one summary JSON per burnscale phase.
# Each phase has its own time cap, so one that runs long or fails does not cost the rest.
set -u
if [ $# -lt 3 ] || { [ "$1" != article ] && [ "$1" != profile ] && [ "$1" != test ] \
        && [ $# -ne 3 ]; } \
    || { [ "$1" = profile ] && [ $# -lt 4 ]; } \
    || { [ "$1" != mingpt ] && [ "$1" != vit ] && [ "$1" != probe ] && [ "$1" != article ] \
        && [ "$1" != profile ] && [ "$1" != test ] && [ "$1" != nccl ]; }; then
    echo "usage: $0 mingpt|vit|probe|nccl BINARY OUT, $0 article BINARY OUT [BENCH FLAGS...]," \
        "$0 profile BINARY OUT STEPS [BINARY FLAGS...] or $0 test BINARY OUT [FILTER...]" >&2
    exit 2
fi
table=$1
bin=$2
out=$3
mkdir -p "$out"
log="$out/log.txt"

# cubecl compiles kernels with NVPTX at run time and reads libdevice under $CUDA_PATH;
# cudarc opens libnccl.so, which the NCCL wheel ships only as libnccl.so.2.
# CUDA_PATH as given, else the toolkit's.
libdevice=$(find /usr/local -path '*nvvm/libdevice/libdevice.10.bc' 2>/dev/null | head -n1)
export CUDA_PATH=${CUDA_PATH:-${libdevice%/nvvm/libdevice/libdevice.10.bc}}
nccl=$(find /opt /usr/lib /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -n1)
mkdir -p /tmp/gpu_table_lib
ln -sf "$nccl" /tmp/gpu_table_lib/libnccl.so
# The linear layers' cuBLAS (crates/nn/src/cublas.rs): the toolkit's, else PyTorch's wheel's;
# its directory holds the cublasLt it loads.
cublas=$(find /usr/local/cuda/targets/x86_64-linux/lib /usr/local /usr/lib -name 'libcublas.so.1*' \
    2>/dev/null | head -n1)
[ -n "$cublas" ] || cublas=$(python3 -c 'import glob, nvidia, os; print(sorted(glob.glob(os.path.join(os.path.dirname(nvidia.__path__[0]), "nvidia", "**", "libcublas.so.*"), recursive=True))[0])' 2>/dev/null)
ln -sf "$cublas" /tmp/gpu_table_lib/libcublas.so
export LD_LIBRARY_PATH=/tmp/gpu_table_lib:/usr/local/cuda/targets/x86_64-linux/lib:$(dirname "${cublas:-/}"):${LD_LIBRARY_PATH:-}
accelerator=${ACCELERATOR:-cuda}
if [ "$accelerator" = libtorch ]; then
    torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    export LD_LIBRARY_PATH=$torch_lib:$LD_LIBRARY_PATH
fi
# cubecl reads cubecl.toml from the working directory up; this script writes its own.
[ -e cubecl.toml ] && { echo "cubecl.toml exists here: move it away first" >&2; exit 2; }
{
    echo "CUDA_PATH=$CUDA_PATH nccl=$nccl cublas=$cublas accelerator=$accelerator"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee -a "$log"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits \
    -lms 250 >"$out/smi.csv" &
smi=$!
trap 'rm -f cubecl.toml; kill $smi 2>/dev/null' EXIT
# Compiled kernels are kept across processes (autotune decisions too, unless AUTOTUNE is set),
# in a cubecl environment (target/environment) of the binary's own: cubecl keys an autotune
# decision without the compiler, and a cuda-nvrtc binary's choice (an asynchronous-barrier
# matmul) made a later LLVM binary's first matmul panic on the same machine.
export CUBECL_ENVIRONMENT=${CUBECL_ENVIRONMENT:-$(basename "$bin")}
printf '[compilation]\ncache = true\n' >cubecl.toml
if [ -n "${AUTOTUNE:-}" ]; then
    printf '[autotune]\nlevel = "%s"\ndisable_cache = true\n[autotune.logger]\nlevel = "full"\nfile = "%s"\n' \
        "$AUTOTUNE" "$out/autotune.log" >>cubecl.toml
fi

capped() { # NAME CAP COMMAND...: COMMAND capped at CAP seconds, its start and end logged
    local name=$1 cap=$2
    shift 2
    echo "== $name start $(date +%T.%N) :: $*" | tee -a "$log"
    timeout "$cap" "$@" 2>&1 | tee -a "$log"
    echo "== $name end $(date +%T.%N) rc=${PIPESTATUS[0]}" | tee -a "$log"
}

phase() { # NAME CAP ARGS...: one burnscale process, capped at CAP seconds
    capped "$1" "$2" "$bin" --accelerator "$accelerator" --summary-json "$out/$1.json" "${@:3}"
    pkill -f scripts/bench_mingpt_torch.py # a capped phase's PyTorch side
}

torch_vit() { # NAME CAP ARGS...: PyTorch's side of a ViT row, capped at CAP seconds
    [ "${NO_TORCH:-0}" = 1 ] && return
    capped "$1" "$2" python3 scripts/bench_vit_torch.py --device cuda "${@:3}"
}

if [ "$table" = article ]; then
    # The bench's driver starts each rung as a process of its own binary.
    export CARGO_TARGET_DIR=$out
    capped article 560 "$bin" --accelerator "$accelerator" "${@:4}"
    exit 0
fi

if [ "$table" = profile ]; then
    printf '[profiling.logger]\nlevel = "medium"\nfile = "%s"\nappend = false\n' \
        "$out/profile.log" >>cubecl.toml
    capped profile 280 "$bin" --accelerator "$accelerator" "${@:5}" --max-steps "$4"
    gzip -f "$out/profile.log"
    exit 0
fi

if [ "$table" = test ]; then
    capped test 300 "$bin" "${@:4}" --nocapture
    exit 0
fi

if [ "$table" = nccl ]; then
    export NCCL_DEBUG=VERSION
    capped nccl_suite 120 "$bin" --nccl --devices 1 --timeout-s 30
    capped nccl_leave 60 "$bin" --nccl --devices 1 --timeout-s 30 --leave-rank 0
    capped nccl_panic 60 "$bin" --nccl --devices 1 --timeout-s 30 --panic-rank 0
    exit 0
fi

if [ "$table" = probe ]; then
    phase probe 400 --weights none --model tiny --batch-size 4 --max-steps 2 --eval-interval 0 \
        --precision bf16-true
    exit 0
fi

if [ "$table" = vit ]; then
    vit=(--weights none --model vit-l-16 --image-size 224 --batch-size 16 --max-steps 30
        --eval-interval 0)
    if [ "${VIT_ROWS:-all}" != zero3 ]; then
        torch_vit torch_bf16_true 120 --model vit-l-16 --precision bf16-true
        torch_vit torch_bf16_mixed 120 --model vit-l-16 --precision bf16-mixed
        phase vit_bf16_true 240 "${vit[@]}" --precision bf16-true
        phase vit_bf16_true_cublas 120 "${vit[@]}" --precision bf16-true --matmul cublas
        phase vit_bf16_mixed 150 "${vit[@]}" --precision bf16-mixed
        phase vit_bf16_mixed_cublas 120 "${vit[@]}" --precision bf16-mixed --matmul cublas
    fi
    [ "${VIT_ROWS:-all}" = single ] && exit 0
    # One rank alone in its weights' dtype runs as a replica; bf16-mixed and offloaded ranks
    # copy their units, so they reshard after forward and gather again for backward.
    vit+=(${VIT_FLAGS:-})
    phase vit_bf16_true_zero3 60 "${vit[@]}" --precision bf16-true --strategy zero3
    phase vit_bf16_mixed_zero3 90 "${vit[@]}" --precision bf16-mixed --strategy zero3
    phase vit_bf16_true_offload 90 "${vit[@]}" --precision bf16-true --strategy zero3 \
        --offload params
    exit 0
fi

m57=(--n-layer 8 --n-head 8 --n-embd 768 --block-size 256 --batch-size 16)
m57_bf16_matmul() { # CAP: the 57M bf16-mixed row, cubecl's products beside cuBLAS's
    phase m57_bf16 "$1" "${m57[@]}" --steps 20 --warmup 3 --precision bf16-mixed --no-plain \
        --also "--matmul cublas"
}
if [ "${MINGPT_ROWS:-all}" = bf16 ]; then
    m57_bf16_matmul 200
    exit 0
fi
if [ "${MINGPT_ROWS:-all}" = matmul ]; then
    # cubecl's products (the default) beside cuBLAS's, each precision in one process.
    phase m57_f32 120 "${m57[@]}" --steps 20 --warmup 3 --also "--matmul cublas"
    m57_bf16_matmul 120
    phase m303_f32 110 --n-layer 24 --n-head 16 --n-embd 1024 --block-size 512 \
        --batch-size 8 --steps 6 --warmup 2
    exit 0
fi
# Alone in f32 ZeRO-3 gathers nothing (one graph, as single): --reshard-after-forward is
# refused there, and measured under bf16-mixed below, where the rank computes on a copy.
phase m57_f32 170 "${m57[@]}" --steps 20 --warmup 3 \
    --also "--matmul cublas" \
    --also "--strategy zero3" \
    --also "--strategy zero3 --offload params"
phase m57_bf16 200 "${m57[@]}" --steps 20 --warmup 3 --precision bf16-mixed --no-plain \
    --also "--matmul cublas" \
    --also "--strategy zero3 --reshard-after-forward false"
phase m57_f32_warm 45 "${m57[@]}" --steps 10 --warmup 2 --no-plain --no-torch
phase m303_f32 110 --n-layer 24 --n-head 16 --n-embd 1024 --block-size 512 --batch-size 8 \
    --steps 6 --warmup 2
# CUDA's stream-ordered allocator under cubecl's pools, beside the default (synchronous).
printf '[memory.cuda]\nallocator = "async"\n' >>cubecl.toml
phase m57_f32_async 45 "${m57[@]}" --steps 10 --warmup 2 --no-plain --no-torch
