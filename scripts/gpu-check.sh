#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: install, run the GPU tests, the kernel
# micro-benchmark, the four-configuration benchmark and a 1.3B-parameter model's step times.
#
#   bash scripts/gpu-check.sh [OUT_DIR]     # $1, else $OUT, else bench/results/gpu-check
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu-check.sh DIR   # the plumbing only, in seconds
#
# Without CUDA the dry run is automatic: what needs the GPU is skipped or replaced by its CPU
# form (test collection, the interpreter smoke check, a tiny model), and the commands a GPU
# run would use are logged. Each stage writes <stage>.log (and its JSON) under OUT_DIR;
# summary.txt is the one-screen result. Stages run under one time budget (GPU_CHECK_BUDGET_S,
# default 450 s, plus installing when the venv lacks torch/triton): about 3 min of tests,
# 1 min of kernels, 1 min of model steps and 1.5 min of the four configurations on an H200.
# Exit status: 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${1:-${OUT:-$REPO/bench/results/gpu-check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
STAGES=$OUT_DIR/stages.tsv
: >"$STAGES"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-450}))
PY=${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}

# stage NAME CAP_S COMMAND...: run with a timeout of min(CAP_S, time left), log to NAME.log,
# record "NAME<TAB>status<TAB>seconds" in stages.tsv
stage() {
    local name=$1 cap=$2 left rc began
    shift 2
    left=$((DEADLINE - $(date +%s)))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        printf '%s\tskipped (budget spent)\t0\n' "$name" >>"$STAGES"
        return
    fi
    echo "== $name (up to ${cap}s): $*"
    began=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    local status=ok
    ((rc == 124 || rc == 137)) && status="timed out after ${cap}s"
    ((rc != 0 && rc != 124 && rc != 137)) && status="failed (exit $rc)"
    printf '%s\t%s\t%s\n' "$name" "$status" $(($(date +%s) - began)) >>"$STAGES"
    echo "   $status; log: $OUT_DIR/$name.log"
}

# setup: only when the venv cannot import what the checks need (setup.sh needs the network)
if ! "$PY" -c "import torch, triton, minimemserve" 2>/dev/null; then
    echo "== setup: bash scripts/setup.sh"
    began=$(date +%s)
    bash scripts/setup.sh >"$OUT_DIR/setup.log" 2>&1
    printf 'setup\t%s\t%s\n' "$([ $? -eq 0 ] && echo ok || echo failed)" \
        $(($(date +%s) - began)) >>"$STAGES"
    PY=$REPO/.venv/bin/python
fi

DRY=${GPU_CHECK_DRY_RUN:-0}
if [ "$DRY" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
    2>/dev/null; then
    echo "no CUDA device: dry run"
    DRY=1
fi
if [ "$DRY" = 1 ]; then
    # a dry run never touches a GPU, even where there is one; triton runs interpreted
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
fi

export GPU_CHECK_OUT=$OUT_DIR GPU_CHECK_DRY=$DRY
stage env 60 "$PY" -c "
import json, os, platform, torch, triton
cuda = torch.cuda.is_available()
info = {'python': platform.python_version(), 'torch': torch.__version__,
        'triton': triton.__version__, 'cuda': torch.version.cuda,
        'device': torch.cuda.get_device_name() if cuda else 'cpu',
        'capability': list(torch.cuda.get_device_capability()) if cuda else None,
        'dry_run': os.environ['GPU_CHECK_DRY'] == '1'}
print(json.dumps(info, indent=1))
with open(os.path.join(os.environ['GPU_CHECK_OUT'], 'env.json'), 'w') as f:
    json.dump(info, f)
"
command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT_DIR/env.log" 2>&1

# run_shards: one pytest per argument (a space-separated list of test paths), all at once,
# since most of their time is Triton compiling kernels on the CPU; fails if any shard fails
run_shards() {
    local i=0 rc=0 pids=() shard
    for shard in "$@"; do
        i=$((i + 1))
        # shellcheck disable=SC2086  # a shard is a list of paths
        "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=5 \
            --junitxml="$OUT_DIR/gpu-tests-$i.xml" $shard >"$OUT_DIR/gpu-tests-$i.log" 2>&1 &
        pids+=($!)
    done
    i=0
    for pid in "${pids[@]}"; do
        i=$((i + 1))
        wait "$pid" || rc=1
        echo "shard $i: $(tail -n 1 "$OUT_DIR/gpu-tests-$i.log")"
    done
    return $rc
}
export -f run_shards
export PY OUT_DIR

K=tests/triton_kernels
if [ "$DRY" = 1 ]; then
    # collect the GPU tests (imports, parametrisation) without running them
    stage gpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider --collect-only -m gpu \
        $K tests/attention/test_triton_backend.py tests/parallel
    stage kernels 60 "$PY" bench/kernels.py --out "$OUT_DIR"
    stage model-steps 60 "$PY" bench/gpu_steps.py --dry-run --out "$OUT_DIR"
else
    # every case of the kernel and backend tests runs on the GPU, the gpu-marked ones included
    stage gpu-tests 200 bash -c 'run_shards "$@"' run_shards "$K/test_paged_decode.py" \
        "$K/test_prefix_prefill.py" tests/attention/test_triton_backend.py \
        "$K/test_store_kv.py $K/test_compile_variants.py $K/test_int64_addressing.py \
         $K/test_masked_loads.py $K/test_interpreter_mode.py" \
        "tests/parallel/test_tensor_parallel.py -m gpu"
    stage kernels 90 "$PY" bench/kernels.py --quick --out "$OUT_DIR"
    stage model-steps 90 "$PY" bench/gpu_steps.py --out "$OUT_DIR"
fi

# the four-configuration benchmark on the GPU, one process per instance where supported
MMS=$(dirname "$PY")/minimemserve
stage bench-options 60 "$MMS" bench -h
BENCH=("$MMS" bench --device cuda --dtype bfloat16 --workload sharegpt --sessions 16 --rate 4
    --max-turns 3 --max-output-tokens 32 --out "$OUT_DIR/bench4" --no-progress)
if grep -q -- "--runtime" "$OUT_DIR/bench-options.log"; then
    BENCH+=(--runtime process)
fi
echo "${BENCH[*]}" >"$OUT_DIR/bench4.cmd"
if [ "$DRY" = 1 ]; then
    printf 'bench4\tskipped (dry run; command in bench4.cmd)\t0\n' >>"$STAGES"
else
    stage bench4 120 "${BENCH[@]}"
fi

# the one-screen summary
"$PY" - <<'EOF'
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(os.environ["GPU_CHECK_OUT"])


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None


lines = []
env = load("env.json") or {}
mode = "DRY RUN (no GPU used)" if env.get("dry_run") else "GPU run"
lines.append(f"gpu-check: {mode} on {env.get('device', '?')}, torch {env.get('torch', '?')}, "
             f"triton {env.get('triton', '?')}, CUDA {env.get('cuda')}")
lines.append("")
lines.append(f"{'stage':14}{'seconds':>8}  status")
for row in (out / "stages.tsv").read_text().splitlines():
    name, status, secs = row.split("\t")
    lines.append(f"{name:14}{secs:>8}  {status}")
counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for xml in sorted(out.glob("gpu-tests-*.xml")):
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    for key in counts:
        counts[key] += int(suite.get(key, 0))
if counts["tests"]:
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines.append(f"tests: {passed} passed, {counts['failures']} failed, {counts['errors']} "
                 f"errors, {counts['skipped']} skipped (gpu-tests-*.log)")
log = out / "gpu-tests.log"
collected = re.findall(r"\d+/\d+ tests collected.*", log.read_text()) if log.exists() else []
if collected:
    lines.append(f"tests (dry run, gpu-marked): {collected[-1]}")
kern = load("kernels.json")
if kern:
    for r in kern.get("decode", []):
        if r["batch"] in (1, 64) and r["dtype"] == "bfloat16":
            lines.append(f"decode {r['batch']}x{r['context']} bf16: {r['gbps']:.0f} GB/s "
                         f"({r['pct_peak'] or 0:.0f}% of peak, {r['pct_copy']:.0f}% of copy), "
                         f"SDPA {r['sdpa_gbps']:.0f} GB/s")
    for r in kern.get("prefill", []):
        lines.append(f"prefill 4k cached {r['cached']:.0%} {r['dtype']}: {r['tflops']:.0f} TFLOP/s, "
                     f"{r['pct_sdpa']:.0f}% of SDPA ({r['sdpa_tflops']:.0f})")
    for t in kern.get("targets", []):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = "" if t["value_pct"] is None else f" ({t['value_pct']:.0f}%)"
        lines.append(f"target {verdict}{value}: {t['target']}")
steps = load("gpu_steps.json")
if steps:
    lines.append(f"model steps ({steps['parameters'] / 1e9:.2f}B params, {steps['dtype']}, "
                 f"{steps['backend']}): median / p99 ms")
    for r in steps["steps"]:
        lines.append(f"  {r['shape']:34}{r['step_ms_median']:9.2f}{r['step_ms_p99']:9.2f}")
bench = load("bench4/e2e_sharegpt.json")
if bench:
    lines.append("four configurations (sharegpt): mean TTFT / JCT / TPOT, errors")
    for config, s in bench["summaries"].items():
        vals = [s.get(k) for k in ("ttft_mean", "jct_mean", "tpot_mean")]
        shown = " / ".join("-" if v is None else f"{v:.4g}" for v in vals)
        lines.append(f"  {config:10}{shown}, {s.get('errors')} errors of {s.get('requests')}")
text = "\n".join(lines) + "\n"
(out / "summary.txt").write_text(text)
print("\n" + text)
EOF

FAILED=$(grep -cv -P '\tok\t|\tskipped' "$STAGES")
echo "results in $OUT_DIR (summary.txt); $FAILED stage(s) not ok; $(($(date +%s) - START)) s in all"
[ "$FAILED" -eq 0 ]
