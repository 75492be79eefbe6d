#!/usr/bin/env bash
# The four configurations at Llama-2-7B scale on one GPU, and the simulator fitted to the same
# run: a second check for a borrowed CUDA machine, beside scripts/gpu-check.sh.
#
#   OUT=DIR bash scripts/gpu-check-7b.sh         # or: bash scripts/gpu-check-7b.sh DIR
#   DRY=1 OUT=DIR bash scripts/gpu-check-7b.sh   # every stage in its CPU form, for the plumbing
#
# Stages, each under its own cap (shortened to what is left of GPU_CHECK_7B_BUDGET_S, default
# 660 s; skipped under 10 s):
#   tiny-process  the tiny-synthetic bench, process runtime, two instances on the GPU, no
#                 --num-blocks (each sizes its pool from its share of the GPU)
#   steps-7b      bench/gpu_steps.py: Llama-2-7B step times (what the fit reads)
#   calibrate     minimemserve sim --calibrate: the H200 profile fitted to them, held-out error
#   rate-W        the simulator (fitted profile) picks the load: 0.8 of PD's knee
#   bench-W       PD, PD-CC, 1P1D, 1P1D-CC on llama-2-7b-dummy (bf16, random weights), two
#                 instances on the one GPU, KV between them over CUDA IPC (device to device)
#   compare-W     simulated (fitted profile) against measured TTFT, JCT, TPOT, and the KV
#                 hand-offs: bytes, ms and GB/s each
# for W in GPU_CHECK_7B_WORKLOADS (default "loogle sharegpt"; ShareGPT is its stand-in of the
# dataset's turns and word counts, MINIMEMSERVE_SHAREGPT=shape: the dataset cannot travel).
#
# Python and wheels as in scripts/gpu-check.sh (the machine's python3, .whl/ installed with
# --no-index into a temporary folder). Output: at most 8 files in OUT: summary.txt (written
# after every stage), gpu_steps_7b.json, profile_7b.json, e2e_tiny.json, e2e_loogle.json,
# e2e_sharegpt.json and logs.tgz. Exit status 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DRY:-${GPU_CHECK_DRY_RUN:-0}}
PY=${GPU_CHECK_PYTHON:-python3}
WORKLOADS=${GPU_CHECK_7B_WORKLOADS:-loogle sharegpt}

if [ "$DRY" != 1 ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    echo "gpu-check-7b: no GPU (nvidia-smi finds none); DRY=1 runs the stages without one" >&2
    exit 2
fi

OUT_DIR=${1:-${OUT:-bench/results/gpu-check-7b}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-7b.XXXXXX")
SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-7b-site.XXXXXX")
STAGES=$WORK/stages.tsv
: >"$STAGES"
START=$(date +%s)
# a dry run shares a small CPU: its stages get SCALE times their caps, and the budget with them
SCALE=1
[ "$DRY" = 1 ] && SCALE=3
DEADLINE=$((START + ${GPU_CHECK_7B_BUDGET_S:-$((660 * SCALE))}))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export MINIMEMSERVE_CACHE=$WORK/cache MINIMEMSERVE_SHAREGPT=shape
if [ "$DRY" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
    MODE="DRY RUN (no GPU used)"
else
    MODE="GPU run"
fi

# summary.txt: the stages, then the tables each stage printed (the tails of their logs)
publish() {
    {
        echo "gpu-check-7b: $MODE, $(($(date +%s) - START)) s so far; GPU numbers only from a GPU run"
        printf '%-14s%8s%6s  %s\n' stage seconds cap status
        awk -F'\t' '{printf "%-14s%8s%6s  %s\n", $1, $3, $4, $2}' "$STAGES"
        for log in tiny-process steps-7b calibrate rate-loogle bench-loogle compare-loogle \
            rate-sharegpt bench-sharegpt compare-sharegpt; do
            [ -f "$WORK/$log.log" ] || continue
            echo
            echo "== $log"
            grep -v -e '^\s*$' -e 'it/s\]' -e '%|' "$WORK/$log.log" | tail -n 30
        done
    } >"$OUT_DIR/.summary.tmp" && mv -f "$OUT_DIR/.summary.tmp" "$OUT_DIR/summary.txt"
    tar -czf "$OUT_DIR/.logs.tgz.tmp" -C "$WORK" --exclude=./cache . 2>/dev/null &&
        mv -f "$OUT_DIR/.logs.tgz.tmp" "$OUT_DIR/logs.tgz"
}

record() { printf '%s\t%s\t%s\t%s\n' "$@" >>"$STAGES"; }

# stage NAME CAP_S COMMAND...: as in scripts/gpu-check.sh
stage() {
    local name=$1 cap=$(($2 * SCALE)) left rc began status=ok
    shift 2
    left=$((DEADLINE - $(date +%s)))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        record "$name" "skipped (budget spent)" 0 "$cap"
        publish
        return 1
    fi
    echo "== $name (up to ${cap}s): $*"
    began=$(date +%s)
    timeout --signal=INT --kill-after=15 "$cap" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    ((rc == 124 || rc == 137)) && status="timed out after ${cap}s"
    ((rc != 0 && rc != 124 && rc != 137)) && status="failed (exit $rc)"
    record "$name" "$status" $(($(date +%s) - began)) "$cap"
    echo "   $status"
    publish
    [ "$status" = ok ]
}

fail() {
    record "$1" "FAILED: $2" $(($(date +%s) - START)) -
    publish
    rm -rf "$WORK" "$SITE"
    echo "gpu-check-7b: $2" >&2
    exit 3
}

publish
if compgen -G ".whl/*.whl" >/dev/null; then
    if ! stage install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
        # a dry run goes on (.whl/ may hold another Python's wheels); the import check decides
        [ "$DRY" = 1 ] || fail install "pip could not install .whl/ with $PY (install.log)"
        sed -i 's/^install\t[^\t]*/install\tskipped (pip could not install .whl\/ here)/' "$STAGES"
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "
import importlib, sys
for name in 'torch triton numpy safetensors sentencepiece tqdm msgspec zmq minimemserve.cli'.split():
    importlib.import_module(name)
import torch
sys.exit(0 if sys.argv[1] == '1' or torch.cuda.is_available() else 'torch.cuda is not available')
" "$DRY" >"$WORK/imports.log" 2>&1; then
    fail imports "$(tail -n 1 "$WORK/imports.log") with $PY; carry the wheels in .whl/ (bash scripts/gpu-wheels.sh)"
fi
record imports ok 0 -

MMS=("$PY" -m minimemserve.cli)
if [ "$DRY" = 1 ]; then
    TINY=(--device cpu --dtype float32 --runtime process --sessions 1 --rate 1 --max-turns 2
        --max-output-tokens 2 --max-context 256 --configs PD,1P1D)
    STEPS=(--dry-run)
    # the 7B stages in their CPU form: the tiny model, in this process, a few requests
    BIG=(--model tiny-synthetic --device cpu --dtype float32 --runtime inline --max-turns 2
        --max-output-tokens 4 --max-context 256)
    MAX_RATE=1
else
    TINY=(--device cuda --dtype bfloat16 --runtime process --sessions 6 --rate 2 --max-turns 3
        --max-output-tokens 32)
    STEPS=()
    BIG=(--model llama-2-7b-dummy --device cuda --dtype bfloat16 --runtime process --max-turns 4)
    MAX_RATE=8 # the frontend's own work per request is not simulated: keep the load sane
fi
OUTPUT=(--max-output-tokens 128) # ShareGPT's answers, capped; LooGLE's are short already

stage tiny-process 120 "${MMS[@]}" bench --model tiny-synthetic --workload loogle --no-progress \
    --out "$WORK/tiny" "${TINY[@]}" && cp "$WORK/tiny/e2e_loogle.json" "$OUT_DIR/e2e_tiny.json"
stage steps-7b 60 "$PY" bench/gpu_steps.py --model 7b "${STEPS[@]}" --out "$OUT_DIR"
PROFILE=h200
stage calibrate 40 "${MMS[@]}" sim --calibrate "$OUT_DIR/gpu_steps_7b.json" --hardware h200 \
    --write "$OUT_DIR/profile_7b.json" && PROFILE=$OUT_DIR/profile_7b.json

for w in $WORKLOADS; do
    extra=()
    [ "$w" = sharegpt ] && extra=("${OUTPUT[@]}")
    [ "$DRY" = 1 ] && extra=()
    stage "rate-$w" 60 "$PY" bench/shared_gpu.py pick-rate --workload "$w" --max-turns 4 \
        --hardware "$PROFILE" --max-rate "$MAX_RATE" --out "$WORK/rate-$w.txt" "${extra[@]}" ||
        echo "1 8" >"$WORK/rate-$w.txt"
    read -r rate sessions <"$WORK/rate-$w.txt"
    [ "$DRY" = 1 ] && sessions=1
    stage "bench-$w" 300 "${MMS[@]}" bench --workload "$w" --configs PD,PD-CC,1P1D,1P1D-CC \
        --sessions "$sessions" --rate "$rate" --no-progress --out "$WORK/bench-$w" "${BIG[@]}" \
        "${extra[@]}" || continue
    cp "$WORK/bench-$w/e2e_$w.json" "$OUT_DIR/e2e_$w.json"
    stage "compare-$w" 90 bash -c '"$1" bench/shared_gpu.py handoffs "$2" &&
        "$1" bench/shared_gpu.py compare --bench "$2" --hardware "$3"' compare "$PY" \
        "$OUT_DIR/e2e_$w.json" "$PROFILE"
done

for f in "$OUT_DIR"/* "$OUT_DIR"/.[!.]*; do # at most 8 files come back
    [ -e "$f" ] || continue
    case $(basename "$f") in
    summary.txt | gpu_steps_7b.json | profile_7b.json | e2e_*.json | logs.tgz) ;;
    *) mkdir -p "$WORK/moved" && mv "$f" "$WORK/moved/" ;;
    esac
done
publish
FAILED=$(grep -cv -P '^[^\t]+\t(ok|skipped)' "$STAGES")
rm -rf "$WORK" "$SITE"
echo "results in $OUT_DIR (summary.txt first); $FAILED stage(s) not ok; $(($(date +%s) - START)) s in all"
cat "$OUT_DIR/summary.txt"
[ "$FAILED" -eq 0 ]
