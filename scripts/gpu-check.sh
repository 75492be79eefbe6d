#!/usr/bin/env bash
# One command for a borrowed CUDA machine: the GPU tests, the kernels against the copy ceiling,
# Llama-2-7B/13B step times, NCCL tensor parallelism, KV over NIXL from VRAM to VRAM (when
# the nixl extra is carried) and the four-configuration benchmark.
#
#   OUT=DIR bash scripts/gpu-check.sh         # or: bash scripts/gpu-check.sh DIR
#   DRY=1 OUT=DIR bash scripts/gpu-check.sh   # every stage in its CPU form, for the plumbing
#
# It runs on the machine's own python3 (GPU_CHECK_PYTHON overrides it) and never builds a
# venv: the packages that python3 lacks travel as wheels in the git-ignored .whl/ (made by
# scripts/gpu-wheels.sh where there is network) and are installed with pip --no-index
# --no-deps --target into a temporary folder put on PYTHONPATH. Without DRY=1 it stops at
# once, with one line, when nvidia-smi finds no GPU, and when anything needed cannot be
# imported. A dry run hides the GPU (CUDA_VISIBLE_DEVICES="", Triton interpreted).
#
# Time: at most GPU_CHECK_BUDGET_S (default 400 s) for the stages, each under its own cap
# (shortened to what is left of the budget, skipped under 10 s); about 7 minutes in all.
# Output: at most 8 files in OUT (default bench/results/gpu-check): summary.txt first (written
# at the start and after every stage), kernels.json, gpu_steps_7b.json, gpu_steps_13b.json
# (what `minimemserve sim --calibrate` reads), gpu_generate.json, bench4.json, and logs.tgz
# (every log, the junit XML, env.json). Exit status: 0 when every stage passed or was skipped for a stated reason.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=${DRY:-${GPU_CHECK_DRY_RUN:-0}}
PY=${GPU_CHECK_PYTHON:-python3}

if [ "$DRY" != 1 ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    echo "gpu-check: no GPU (nvidia-smi finds none); DRY=1 runs the stages without one" >&2
    exit 2
fi

OUT_DIR=${1:-${OUT:-$REPO/bench/results/gpu-check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") # logs and XML: packed into logs.tgz
SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
STAGES=$WORK/stages.tsv
: >"$STAGES"
START=$(date +%s)
echo "$START" >"$WORK/started"
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-400}))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 GPU_CHECK_DRY=$DRY
export MINIMEMSERVE_CACHE=$WORK/cache # the benchmark's preset, built here
if [ "$DRY" = 1 ]; then
    # a dry run never touches a GPU, even where there is one; Triton runs interpreted
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
fi

# publish: summary.txt and logs.tgz in OUT_DIR, as they stand (after every stage)
publish() {
    "$PY" scripts/gpu_check_summary.py "$OUT_DIR" "$WORK" "$@" 2>>"$WORK/summary.err" ||
        { echo "gpu-check: the summary failed (summary.err)"; cat "$STAGES" >"$OUT_DIR/summary.txt"; }
    tar -czf "$OUT_DIR/.logs.tgz.tmp" -C "$WORK" --exclude=./cache . 2>/dev/null &&
        mv -f "$OUT_DIR/.logs.tgz.tmp" "$OUT_DIR/logs.tgz"
}

# record NAME STATUS SECONDS CAP
record() { printf '%s\t%s\t%s\t%s\n' "$@" >>"$STAGES"; }

# stage NAME CAP_S COMMAND...: run with a timeout of min(CAP_S, time left) (SIGINT first, so
# pytest still writes its XML), log to NAME.log, record the outcome, publish
stage() {
    local name=$1 cap=$2 left rc began status=ok
    shift 2
    left=$((DEADLINE - $(date +%s)))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        record "$name" "skipped (budget spent)" 0 "$cap"
        publish
        return
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
}

# fail NAME WHY: one loud line, a summary saying it, exit 3
fail() {
    record "$1" "FAILED: $2" $(($(date +%s) - START)) -
    publish --final
    rm -rf "$WORK" "$SITE"
    echo "gpu-check: $2" >&2
    exit 3
}

publish # summary.txt first

# install the carried wheels (nothing is fetched: there is no network)
if compgen -G ".whl/*.whl" >/dev/null; then
    stage install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
    if ! grep -qP '^install\tok' "$STAGES"; then
        # a dry run goes on (.whl/ may hold another Python's wheels); the import check decides
        [ "$DRY" = 1 ] || fail install "pip could not install .whl/ with $PY (install.log)"
        sed -i 's/^install\t[^\t]*/install\tskipped (pip could not install .whl\/ here)/' "$STAGES"
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

# everything the stages import, before any of them runs
began=$(date +%s)
NEEDS="torch triton numpy transformers safetensors sentencepiece tqdm msgspec zmq pytest
pytest_timeout minimemserve minimemserve.cli"
[ "$DRY" = 1 ] || NEEDS="$NEEDS xdist"
if ! "$PY" -c "
import importlib, sys
missing = []
for name in sys.argv[1].split():
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f'{name} ({type(e).__name__}: {e})')
if missing:
    sys.exit('cannot import ' + '; '.join(missing))
" "$NEEDS" >"$WORK/imports.log" 2>&1; then
    fail imports "$(tail -n 1 "$WORK/imports.log") with $PY; carry the wheels in .whl/ (bash scripts/gpu-wheels.sh)"
fi
if [ "$DRY" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
    >>"$WORK/imports.log" 2>&1; then
    fail imports "nvidia-smi sees a GPU but torch.cuda does not ($PY)"
fi
record imports ok $(($(date +%s) - began)) -

stage env 30 "$PY" -c "
import json, os, platform, torch, triton
cuda = torch.cuda.is_available()
info = {'python': platform.python_version(), 'torch': torch.__version__,
        'triton': triton.__version__, 'cuda': torch.version.cuda,
        'device': torch.cuda.get_device_name() if cuda else 'cpu',
        'capability': list(torch.cuda.get_device_capability()) if cuda else None,
        'gpus': torch.cuda.device_count(), 'dry_run': os.environ['GPU_CHECK_DRY'] == '1'}
print(json.dumps(info, indent=1))
with open('$WORK/env.json', 'w') as f:
    json.dump(info, f)
"
command -v nvidia-smi >/dev/null && nvidia-smi >>"$WORK/env.log" 2>&1

# measurements first (what --calibrate and the kernel targets read), then the tests
# (steps: each decode shape eagerly and through the decode CUDA graphs, with the profiler's
# GPU-busy time and kernel count; generate: LLM.generate end to end, eager against graphs)
if [ "$DRY" = 1 ]; then
    stage kernels 60 "$PY" bench/attention_kernels.py --out "$OUT_DIR"
    # the 7B dry run takes the Triton backend (interpreted), so the graph path runs too
    stage steps-7b 90 "$PY" bench/gpu_steps.py --dry-run --model 7b --backend triton --out "$OUT_DIR"
    stage generate-7b 60 "$PY" bench/gpu_generate.py --dry-run --out "$OUT_DIR"
    stage steps-13b 60 "$PY" bench/gpu_steps.py --dry-run --model 13b --out "$OUT_DIR"
else
    stage kernels 75 "$PY" bench/attention_kernels.py --quick --out "$OUT_DIR"
    stage steps-7b 80 "$PY" bench/gpu_steps.py --model 7b --out "$OUT_DIR"
    stage generate-7b 70 "$PY" bench/gpu_generate.py --out "$OUT_DIR"
    stage steps-13b 70 "$PY" bench/gpu_steps.py --model 13b --out "$OUT_DIR"
fi
for m in 7b 13b; do # the simulator's H200 profile against the measured steps (CPU, seconds)
    [ -f "$OUT_DIR/gpu_steps_$m.json" ] && stage "calibrate-$m" 20 "$PY" -m minimemserve.cli sim \
        --calibrate "$OUT_DIR/gpu_steps_$m.json" --hardware h200
done

# the kernel and backend tests, every case on the GPU (fp32/fp16/bf16, head sizes, block
# sizes, GQA groups, split counts, int64 addressing, masked loads, compiled variants)
K=tests/triton_kernels
TESTS=("$K" tests/attention/test_triton_backend.py tests/test_decode_graphs.py)
# pytest with SIGINT handled even when this script was started with it ignored (as a
# background job is), so a capped run still ends with its summary and junit XML
PYTEST=("$PY" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -p no:cacheprovider -rfE)
if [ "$DRY" = 1 ]; then
    stage gpu-tests 60 "${PYTEST[@]}" -q --collect-only "${TESTS[@]}"
else
    stage gpu-tests 110 "${PYTEST[@]}" -v -n "${GPU_CHECK_WORKERS:-8}" --timeout 90 \
        --durations=10 --junitxml="$WORK/gpu-tests.xml" "${TESTS[@]}"
fi

# two tensor-parallel ranks on one GPU over NCCL: each rank names itself a host of its own
# (NCCL_HOSTID, set by minimemserve.parallel), which NCCL needs to accept two ranks on one device
TP=(tests/parallel/test_tensor_parallel.py -m gpu)
if [ "$DRY" = 1 ]; then
    stage tp-nccl 30 "${PYTEST[@]}" -q --collect-only "${TP[@]}"
else
    # a hang inside NCCL would not see pytest-timeout's signal: its thread method dumps the
    # stacks into the log and ends the run
    stage tp-nccl 70 env NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
        "${PYTEST[@]}" -v --timeout 45 --timeout-method=thread --junitxml="$WORK/tp-nccl.xml" \
        "${TP[@]}"
    if ! grep -qP '^tp-nccl\tok' "$STAGES" && grep -q "Duplicate GPU" "$WORK/tp-nccl.log"; then
        echo "skipped: NCCL refused two ranks on one GPU ('Duplicate GPU detected') even with a" \
            "distinct NCCL_HOSTID per rank; this machine has one GPU" >"$WORK/tp-nccl.note"
        sed -i 's/^tp-nccl\t[^\t]*/tp-nccl\tskipped (NCCL: duplicate GPU, tp-nccl.note)/' "$STAGES"
    fi
fi

# KV over NIXL from VRAM into VRAM (two agents in one process, a GPU test), where the nixl
# extra loads with this python3 (carry it: GPU_WHEELS_NIXL=1 bash scripts/gpu-wheels.sh);
# skipped, with the reason, where it does not. A dry run runs the DRAM tests instead.
NIXL_WHY=$("$PY" -c 'from minimemserve.disagg.nixl import nixl_missing; print(nixl_missing() or "")' 2>&1 |
    tr '\t\n' '  ' | cut -c1-240)
NIXL_TESTS=(tests/disagg/test_nixl.py)
if [ -n "${NIXL_WHY// /}" ]; then
    record nixl-vram "skipped (${NIXL_WHY% })" 0 -
    publish
elif [ "$DRY" = 1 ]; then
    stage nixl-vram 60 "${PYTEST[@]}" -q --timeout 45 -m "not gpu" "${NIXL_TESTS[@]}"
else
    stage nixl-vram 60 "${PYTEST[@]}" -v --timeout 45 --junitxml="$WORK/nixl-vram.xml" \
        -m gpu "${NIXL_TESTS[@]}"
fi

# the four configurations: the tiny-synthetic preset (its tokenizer is trained in about a
# second on pseudo-words: no dataset) over the synthetic LooGLE-like workload
BENCH_CAP=90
if [ "$DRY" = 1 ]; then
    BENCH_CAP=150 # a 32M-parameter model on the CPU, which may be shared
    BENCH=(--device cpu --dtype float32 --runtime inline --configs PD,PD-CC --sessions 1 --rate 1
        --max-turns 2 --max-output-tokens 2 --max-context 256)
else
    BENCH=(--device cuda --dtype bfloat16 --runtime process --sessions 6 --rate 2 --max-turns 3
        --max-output-tokens 32)
fi
echo "minimemserve bench --model \$(minimemserve preset --name tiny-synthetic) --workload loogle" \
    "${BENCH[*]}" >"$WORK/bench4.cmd"
stage bench4 "$BENCH_CAP" bash -c '"$1" -m minimemserve.cli preset --name tiny-synthetic >"$2/preset.txt" &&
    "$1" -m minimemserve.cli bench --model "$(cat "$2/preset.txt")" --workload loogle \
        --no-progress --out "$2/bench4" "${@:4}" &&
    cp "$2/bench4/e2e_loogle.json" "$3/bench4.json"' bench4 "$PY" "$WORK" "$OUT_DIR" "${BENCH[@]}"

# nothing else may stay in OUT_DIR: at most 8 files come back
for f in "$OUT_DIR"/* "$OUT_DIR"/.[!.]*; do
    [ -e "$f" ] || continue
    case $(basename "$f") in
    summary.txt | kernels.json | gpu_steps_7b.json | gpu_steps_13b.json | gpu_generate.json | bench4.json | logs.tgz) ;;
    *) mkdir -p "$WORK/moved" && mv "$f" "$WORK/moved/" ;;
    esac
done
publish --final
FAILED=$(grep -cv -P '^[^\t]+\t(ok|skipped)' "$STAGES")
rm -rf "$WORK" "$SITE" # all of it is in logs.tgz
echo "results in $OUT_DIR (summary.txt first); $FAILED stage(s) not ok; $(($(date +%s) - START)) s in all"
cat "$OUT_DIR/summary.txt"
[ "$FAILED" -eq 0 ]
