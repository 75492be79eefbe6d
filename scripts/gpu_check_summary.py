"""The one-screen ``summary.txt`` of ``scripts/gpu-check.sh``, rewritten after every stage.

    python3 scripts/gpu_check_summary.py OUT_DIR WORK_DIR [--final]

Standard library only, so it runs even when the package or torch cannot be imported. It
reads the stage table and logs under WORK_DIR and the JSON under OUT_DIR (kernels.json,
gpu_steps_7b.json, gpu_steps_13b.json, gpu_generate.json, bench4.json) and writes
OUT_DIR/summary.txt: every stage's status and time, then every number. Each section stands
alone: a missing or broken file is named, and the rest is still written.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

STEP_MODELS = ("7b", "13b")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MAX_LISTED_FAILURES = 12


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0f}%"


def header(work: Path, final: bool) -> list[str]:
    env = _load(work / "env.json") or {}
    mode = "DRY RUN (no GPU used)" if os.environ.get("GPU_CHECK_DRY") == "1" else "GPU run"
    started = float((work / "started").read_text()) if (work / "started").exists() else None
    elapsed = "" if started is None else f"{time.time() - started:.0f} s"
    state = f"finished in {elapsed}" if final else f"in progress ({elapsed} so far)"
    return [
        f"gpu-check: {mode}, {state}",
        f"device {env.get('device', '?')} (capability {env.get('capability')}), "
        f"python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}, CUDA {env.get('cuda')}",
    ]


def stages(work: Path) -> list[str]:
    lines = [f"{'stage':12}{'seconds':>8}{'cap':>6}  status"]
    table = work / "stages.tsv"
    for row in table.read_text().splitlines() if table.exists() else []:
        name, status, secs, cap = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"{name:12}{secs:>8}{cap:>6}  {status}")
    return lines


def _junit(path: Path) -> dict | None:
    """Counts and failed test ids of a junit XML file, or None if there is none."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    failed = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = failed
    return counts


def _log_counts(log: Path) -> dict | None:
    """Counts from pytest's verbose lines, for a run cut short before it wrote its XML."""
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    words = re.findall(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text)
    if not words:
        return None
    failed = re.findall(r"^FAILED (\S+)", text, re.M) or re.findall(r"(\S+::\S+) FAILED", text)
    return {
        "passed": words.count("PASSED"),
        "failures": words.count("FAILED"),
        "errors": words.count("ERROR"),
        "skipped": words.count("SKIPPED"),
        "failed": sorted(set(failed)),
    }


def tests(work: Path, name: str, title: str) -> list[str]:
    log = work / f"{name}.log"
    collected = (
        re.findall(r"(\d+(?:/\d+)? tests? collected[^\n]*)", log.read_text())
        if (log.exists())
        else []
    )
    counts, source = _junit(work / f"{name}.xml"), "junit XML"
    if counts is None:
        counts, source = _log_counts(log), "log (no XML: cut short?)"
    if counts is None:
        return [f"{title} (dry run): {collected[-1]}" if collected else f"{title}: no results"]
    lines = [
        f"{title}: {counts['passed']} passed, {counts['failures']} failed, {counts['errors']} "
        f"errors, {counts['skipped']} skipped (from the {source})"
    ]
    for test in counts["failed"][:MAX_LISTED_FAILURES]:
        lines.append(f"  failed: {test}")
    if len(counts["failed"]) > MAX_LISTED_FAILURES:
        lines.append(f"  ... and {len(counts['failed']) - MAX_LISTED_FAILURES} more (logs.tgz)")
    return lines


def kernels(out: Path) -> list[str]:
    k = _load(out / "kernels.json")
    if k is None:
        return ["kernels: no kernels.json"]
    if k.get("device") == "cpu":
        return [
            f"kernels (dry run): interpreter check ok = {k.get('interpreter_check_ok')}, "
            f"max abs error {k.get('max_abs_err', 0):.1e}"
        ]
    lines = [
        f"kernels on {k['device']}: copy ceiling {k['copy_gbps']:.0f} GB/s measured "
        f"(spec sheet {k.get('peak_gbps')}); flash-attn {k.get('flash_attn')}",
        f"  {'decode':28}{'GB/s':>7}{'of copy':>9}{'of spec':>9}{'SDPA GB/s':>11}  SDPA backend",
    ]
    for r in k.get("decode", []):
        what = f"{r['model']} {SHORT_DTYPE.get(r['dtype'], r['dtype'])} {r['batch']}x{r['context']}"
        lines.append(
            f"  {what:28}{r['gbps']:>7.0f}{_pct(r['pct_copy']):>9}"
            f"{_pct(r.get('pct_peak')):>9}{r['sdpa_gbps']:>11.0f}"
            f"  {r['sdpa_backend']}"
        )
    lines.append(
        f"  {'prefill 2x4096':28}{'TF/s':>7}{'of SDPA':>9}{'SDPA TF/s':>11}"
        f"{'FA TF/s':>9}{'max err':>9}  SDPA backend"
    )
    for r in k.get("prefill", []):
        what = f"{r['model']} {SHORT_DTYPE.get(r['dtype'], r['dtype'])} cached {r['cached']:.0%}"
        fa = r.get("flash_attn_tflops")
        lines.append(
            f"  {what:28}{r['tflops']:>7.0f}{_pct(r['pct_sdpa']):>9}"
            f"{r['sdpa_tflops']:>11.0f}{'-' if fa is None else f'{fa:.0f}':>9}"
            f"{r['max_abs_err_vs_sdpa']:>9.2g}  {r['sdpa_backend']}"
        )
    for t in k.get("targets", []):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  target {verdict} ({_pct(t['value_pct'])}): {t['target']}")
    return lines


def steps(out: Path, work: Path) -> list[str]:
    lines = []
    for m in STEP_MODELS:
        s = _load(out / f"gpu_steps_{m}.json")
        if s is None:
            lines.append(f"model steps {m}: no gpu_steps_{m}.json")
            continue
        lines.append(
            f"model steps {s.get('model_name', m)} ({s['parameters'] / 1e9:.2f}B "
            f"params, {s['dtype']}, {s['backend']} attention, {len(s['steps'])} "
            f"shapes)"
        )
        lines.append(
            f"  {'shape':34}{'engine ms':>10}{'p99 ms':>8}{'tok/s':>9}{'eager ms':>9}"
            f"{'busy ms':>8}{'kernels':>8}{'/layer':>7}{'graph ms':>9}{'busy ms':>8}"
            f"{'wall/busy':>10}"
        )
        for r in s["steps"]:
            lines.append(_step_line(r))
        if s.get("graph_memory_bytes"):
            lines.append(f"  decode graphs: {s['graph_memory_bytes'] / 2**20:.0f} MiB")
        cal = work / f"calibrate-{m}.log"
        if cal.exists():
            lines.append(f"  sim --calibrate (H200 roofline against these steps), {cal.name}:")
            lines += [f"    {x}" for x in cal.read_text().splitlines()[-40:]]
    return lines


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _step_line(r: dict) -> str:
    """One shape: the engine's time, then eager and graph times with their GPU-busy time
    and kernels, and the engine's wall time over its GPU-busy time."""
    graph, busy = r.get("graph_ms_median"), r.get("graph_gpu_busy_ms")
    engine_busy = busy if graph is not None else r.get("gpu_busy_ms")
    ratio = r["step_ms_median"] / engine_busy if engine_busy else None
    return (
        f"  {r['shape']:34}{r['step_ms_median']:>10.2f}{r['step_ms_p99']:>8.2f}"
        f"{r['tokens_per_s']:>9.0f}{_num(r.get('eager_ms_median'), '.2f'):>9}"
        f"{_num(r.get('gpu_busy_ms'), '.2f'):>8}{_num(r.get('kernels'), 'd'):>8}"
        f"{_num(r.get('kernels_per_layer'), '.1f'):>7}{_num(graph, '.2f'):>9}"
        f"{_num(busy, '.2f'):>8}{_num(ratio, '.2f'):>10}"
    )


def generate(out: Path) -> list[str]:
    g = _load(out / "gpu_generate.json")
    if g is None:
        return ["LLM.generate end to end: no gpu_generate.json"]
    lines = [
        f"LLM.generate end to end on {g['device']}: {g['model']}, {g['dtype']}, "
        f"{g['prompt_tokens']}-token prompts"
    ]
    for m in g["modes"]:
        for r in m["runs"]:
            extra = ""
            if "speedup" in r:
                extra = f", {r['speedup']:.2f}x eager, {r['same_tokens_as_eager']} same tokens"
            lines.append(
                f"  {m['mode']:7} batch {r['batch']:3}: {r['output_tokens_per_s']:9.1f} output "
                f"tok/s ({r['output_tokens']} in {r['seconds']:.2f} s{extra})"
            )
    return lines


def tp(work: Path) -> list[str]:
    note = work / "tp-nccl.note"
    lines = tests(work, "tp-nccl", "tensor parallel, NCCL, 2 ranks on one GPU")
    if note.exists():
        lines.append(f"  {note.read_text().strip()}")
    return lines


def bench4(out: Path, work: Path) -> list[str]:
    b = _load(out / "bench4.json")
    cmd = work / "bench4.cmd"
    lines = [f"four configurations: {cmd.read_text().strip()}"] if cmd.exists() else []
    if b is None:
        return lines + ["  no bench4.json"]
    lines.append(f"  {'config':10}{'TTFT mean':>11}{'JCT mean':>11}{'TPOT mean':>11}  errors")
    for config, s in b.get("summaries", {}).items():
        vals = [s.get(k) for k in ("ttft_mean", "jct_mean", "tpot_mean")]
        shown = "".join("-".rjust(11) if v is None else f"{v:>11.4g}" for v in vals)
        lines.append(f"  {config:10}{shown}  {s.get('errors')} of {s.get('requests')} requests")
    return lines


def main() -> None:
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    final = "--final" in sys.argv[3:]
    sections = [
        lambda: header(work, final),
        lambda: stages(work),
        lambda: kernels(out),
        lambda: steps(out, work),
        lambda: generate(out),
        lambda: tests(work, "gpu-tests", "kernel and backend tests"),
        lambda: tp(work),
        lambda: bench4(out, work),
    ]
    lines = []
    for section in sections:
        try:
            lines += section()
        except Exception as e:  # one broken input must not cost the rest of the summary
            lines.append(f"(a summary section failed: {type(e).__name__}: {e})")
        lines.append("")
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    lines.append(f"files: {', '.join(files)} (logs, junit XML, env: logs.tgz)")
    tmp = out / ".summary.txt.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out / "summary.txt")


if __name__ == "__main__":
    main()
