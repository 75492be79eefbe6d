"""scripts/gpu-check.sh: it stops at once without a GPU, and a rehearsal of the borrowed GPU
machine gets through the wheel install and every stage in dry mode.

The rehearsal copies the working tree as the machine receives it (tracked and untracked, not
ignored, files, plus ``.whl/``), downloads the wheels the image lacks with
scripts/gpu-wheels.sh (for this interpreter's version), and runs the script with only the
image's packages importable (the others hidden unless installed from ``.whl/``), pip unable
to reach an index, a fresh HOME, ``python3`` on the PATH and no nvidia-smi.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check.sh"
MAX_FILES = 8  # what comes back from the machine's $OUT
STAGES = (
    "imports",
    "install",
    "env",
    "kernels",
    "steps-7b",
    "steps-13b",
    "generate-7b",
    "calibrate-7b",
    "calibrate-13b",
    "gpu-tests",
    "tp-nccl",
    "bench4",
)

# Imported first by every python3 of the rehearsal: a distribution that is not on the image
# (nor needed by this machine's versions of the image's packages) cannot be imported from
# this interpreter's site-packages, only from elsewhere on sys.path (the folder the script
# installs .whl/ into).
SITECUSTOMIZE = r"""
import importlib.abc, importlib.machinery, importlib.metadata, re, site, sys

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
hidden_dirs = set(site.getsitepackages())
tops, needs = {{}}, {{}}
for dist in importlib.metadata.distributions():
    name = norm(dist.metadata["Name"] or "")
    tops[name] = set()
    for f in dist.files or ():
        top = f.parts[0] if f.parts else ""
        skip = top.endswith((".dist-info", ".data", ".pth")) or top in ("", "..", "__pycache__")
        if not skip:
            tops[name].add(top.split(".")[0])
    needs[name] = {{norm(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0])
                   for r in dist.requires or () if "extra ==" not in r}}
# the image's packages and what this machine's versions of them need
on_image, todo = set(), [n for n in {image!r} if n in tops]
while todo:
    n = todo.pop()
    if n not in on_image:
        on_image.add(n)
        todo.extend(m for m in needs.get(n, ()) if m in tops)
allowed = set().union(*(tops[n] for n in on_image))
hidden = set().union(*(t for n, t in tops.items() if n not in on_image)) - allowed


class HideOffImage(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in hidden or "." in fullname:
            return None
        elsewhere = [p for p in sys.path if p not in hidden_dirs]
        spec = importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{fullname!r}} (not on the image)",
                                      name=fullname)
        return spec


sys.meta_path.insert(0, HideOffImage())
"""


def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPU_CHECK_", "PIP_", "VIRTUAL_ENV", "PYTHON"))
    }
    env.pop("DRY", None)
    env.pop("OUT", None)
    return env | extra


def test_no_gpu_says_so_in_one_line_and_stops(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    began = time.monotonic()
    res = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        env=_env(OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert time.monotonic() - began < 10
    out = (res.stdout + res.stderr).strip()
    assert len(out.splitlines()) == 1 and "no GPU" in out, out
    assert list(tmp_path.iterdir()) == []


def _copy_tree(dest: Path) -> None:
    """The working tree as the GPU machine receives it: tracked and untracked, not ignored."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tree the GPU machine receives is unknown")
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.mark.slow
def test_device_rehearsal_installs_the_wheels_and_runs_every_stage(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the rehearsal is for machines without one")
    repo, image, out = tmp_path / "repo", tmp_path / "image", tmp_path / "out"
    _copy_tree(repo)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheel_env = _env(GPU_WHEELS_PYTHON_VERSION=version, GPU_WHEELS_PIP_PYTHON=sys.executable)
    got = subprocess.run(
        ["bash", "scripts/gpu-wheels.sh"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=180,
        env=wheel_env,
    )
    if got.returncode != 0:
        pytest.skip(f"could not download the wheels (no network?): {got.stderr[-500:]}")
    wheels = sorted(p.name for p in (repo / ".whl").glob("*.whl"))
    assert {w.split("-")[0] for w in wheels} == {"msgspec", "pyzmq"}, wheels
    assert sum(p.stat().st_size for p in (repo / ".whl").iterdir()) < 16 * 2**20

    listed = subprocess.run(
        ["bash", "scripts/gpu-wheels.sh", "--list"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    (image / "site").mkdir(parents=True)
    (image / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE.format(image=listed))
    (image / "bin").mkdir()
    python3 = image / "bin" / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    (tmp_path / "home").mkdir()
    env = _env(
        PATH=f"{image / 'bin'}:/usr/bin:/bin",
        HOME=str(tmp_path / "home"),
        PYTHONPATH=str(image / "site"),
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        http_proxy="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
    )
    hidden = subprocess.run(
        ["python3", "-c", "import msgspec"], env=env, cwd=repo, capture_output=True, text=True
    )
    assert hidden.returncode != 0 and "not on the image" in hidden.stderr, hidden.stderr

    res = subprocess.run(
        ["bash", "scripts/gpu-check.sh"],
        cwd=repo,
        env=env | {"DRY": "1", "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = res.stdout[-4000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= MAX_FILES and "summary.txt" in files, files
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("gpu-check: DRY RUN") and "finished" in summary, summary
    for name in STAGES:
        assert any(
            line.split()[:1] == [name] and line.endswith(" ok") for line in summary.splitlines()
        ), (name, summary)
    nixl = [line for line in summary.splitlines() if line.split()[:1] == ["nixl-vram"]]
    assert len(nixl) == 1 and "skipped (nixl does not load" in nixl[0], summary  # not carried
    assert "collected" in summary and "interpreter check ok = True" in summary
    for name in ("gpu_steps_7b.json", "gpu_steps_13b.json"):
        steps = json.loads((out / name).read_text())  # what `sim --calibrate` reads
        assert steps["dry_run"] and all(s["logits_finite"] for s in steps["steps"])
    bench = json.loads((out / "bench4.json").read_text())
    assert set(bench["summaries"]) == {"PD", "PD-CC"}
    assert all(s["errors"] == 0 for s in bench["summaries"].values())
    assert "logs.tgz" in files


def test_a_gpu_with_a_package_missing_fails_at_once(tmp_path):
    """nvidia-smi sees a GPU but msgspec is not importable (no .whl/): one line saying so,
    exit 3, before any stage; the summary records it."""
    repo, fake, out = tmp_path / "repo", tmp_path / "fake", tmp_path / "out"
    _copy_tree(repo)
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Pretend GPU (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    (fake / "sitecustomize.py").write_text("import sys\nsys.modules['msgspec'] = None\n")
    env = _env(
        PATH=f"{fake}:{os.environ['PATH']}",
        PYTHONPATH=str(fake),
        OUT=str(out),
        GPU_CHECK_PYTHON=sys.executable,
    )
    res = subprocess.run(
        ["bash", "scripts/gpu-check.sh"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "cannot import" in res.stderr
    assert "msgspec" in res.stderr
    summary = (out / "summary.txt").read_text()
    assert "imports" in summary and "FAILED: cannot import" in summary, summary
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "summary.txt"]


def _bench_module(name: str, monkeypatch):
    """``bench/<name>.py`` as a module (the bench scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_gpu_paths_of_the_benchmarks_and_the_summary_on_the_cpu(tmp_path, monkeypatch):
    """What only a GPU run executes, here with tiny shapes and a stand-in timer: the kernel
    sweep's rows and targets, the step grid at the Llama-2 shapes, and the summary of it all."""
    kernels = _bench_module("attention_kernels", monkeypatch)
    monkeypatch.setattr(kernels, "device_peaks", lambda device: ("NVIDIA H200", 4.8e12, 989e12))
    monkeypatch.setattr(kernels, "copy_gbps", lambda device: 4300.0)
    monkeypatch.setattr(kernels, "time_cuda", lambda fn: (fn(), 1e-3)[1])
    monkeypatch.setattr(kernels, "MODELS", {"llama2-7b": (2, 2)})
    monkeypatch.setattr(kernels, "QUICK_DECODE", ((2, 48),))
    monkeypatch.setattr(kernels, "PREFILL_TOKENS", 32)
    monkeypatch.setattr(kernels, "DECODE_TARGET", (2, 48, 80.0))
    seen = []
    report = kernels.run_gpu(True, torch.device("cpu"), progress=lambda r: seen.append(1))
    assert len(seen) == 3 and len(report["decode"]) == 1 and len(report["prefill"]) == 2
    assert report["decode"][0]["sdpa_backend"] in {b.lower() for b in kernels.SDPA_ORDER}
    assert [t["met"] is not None for t in report["targets"]] == [True, True]
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "out" / "kernels.json").write_text(json.dumps(report))

    steps = _bench_module("gpu_steps", monkeypatch)
    for model, sizes in steps.GPU_MODELS.items():
        per_token = 2 * sizes["num_hidden_layers"] * sizes["num_key_value_heads"] * 128 * 2
        shapes = steps.gpu_shapes(100 * 2**30 // per_token)  # 100 GiB of bf16 KV
        batches = {s.decodes for s in shapes if s.name.startswith("decode")}
        assert batches == set(steps.DECODE_BATCHES), (model, [s.name for s in shapes])
        rows = [
            {"shape": s.name, "step_ms_median": 1.0, "step_ms_p99": 2.0, "tokens_per_s": 1e3}
            | (
                {"eager_ms_median": 30.0, "gpu_busy_ms": 5.0, "kernels": 320}
                | {"kernels_per_layer": 10.0, "graph_ms_median": 1.0, "graph_gpu_busy_ms": 0.9}
                if s.decodes and not s.prefills
                else {}
            )
            for s in shapes
        ]
        (tmp_path / "out" / f"gpu_steps_{model}.json").write_text(
            json.dumps(
                {
                    "model_name": f"llama2-{model}",
                    "parameters": 7e9,
                    "dtype": "bfloat16",
                    "backend": "triton",
                    "model": sizes,
                    "steps": rows,
                }
            )
        )
    run = {"batch": 1, "output_tokens": 128, "seconds": 0.5, "output_tokens_per_s": 256.0}
    graphs = run | {"output_tokens_per_s": 512.0, "speedup": 2.0, "same_tokens_as_eager": "1 of 1"}
    modes = [{"mode": "eager", "runs": [run]}, {"mode": "graphs", "runs": [graphs]}]
    (tmp_path / "out" / "gpu_generate.json").write_text(
        json.dumps(
            {"device": "H200", "model": "7b", "dtype": "bf16", "prompt_tokens": 128, "modes": modes}
        )
    )
    (tmp_path / "work" / "stages.tsv").write_text("kernels\tok\t40\t75\n")
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_check_summary.py"),
            tmp_path / "out",
            tmp_path / "work",
            "--final",
        ],
        check=True,
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "copy ceiling 4300 GB/s" in summary and "llama2-7b bf16 2x48" in summary
    assert "model steps llama2-13b" in summary and "decode 256x" in summary
    assert "   10.0     1.00    0.90      1.11" in summary  # per layer, graph ms, busy, wall/busy
    assert "graphs  batch   1:     512.0 output tok/s" in summary and "2.00x eager" in summary
    assert "section failed" not in summary, summary
