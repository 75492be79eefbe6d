"""Every fenced ``bash`` and ``python`` block of README.md, docs/*.md and bench/README.md runs as
written, in a temporary directory, on the tiny preset, over loopback, within a time limit; a
block marked ``skip`` (or ``slow``, outside the whole set) is checked without running it: its
commands' options parsed, its Python compiled, its imports run. The marks: docs_blocks.py.

``pytest tests/test_docs.py`` runs the default set; ``pytest -m docs_full tests/test_docs.py``
the whole set, ``slow`` blocks run too.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from docs_blocks import (
    REPO,
    Block,
    Check,
    DocsMarkError,
    bash_checks,
    bash_script,
    blocks,
    commands,
    doc_files,
    is_serve,
    logical_lines,
    python_imports,
    unfenced_commands,
)

BLOCK_TIMEOUT_S = 300  # one block, run
FULL_TIMEOUT_S = 900  # one block of the whole set
SERVER_START_S = 180  # until a started server answers /health
DRY_RUN_TIMEOUT_S = 300  # every dry run of a set, in one process
ALL = [b for path in doc_files() for b in blocks(path)]


def _venv_bin() -> Path:
    return Path(sys.executable).parent


def _env() -> dict[str, str]:
    """The blocks' environment: the project's interpreter and commands first on PATH, the
    checkout importable, nothing proxied (loopback only)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PATH"] = f"{_venv_bin()}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _workdir(tmp: Path) -> Path:
    """A temporary folder laid out as the checkout's root: its scripts and benchmarks copied
    (their results stay here), ``.venv`` the interpreter's environment."""
    work = tmp / "work"
    work.mkdir()
    for folder in ("bench", "scripts"):
        shutil.copytree(REPO / folder, work / folder, ignore=shutil.ignore_patterns("results"))
    (work / ".venv").symlink_to(_venv_bin().parent)
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _server(block: Block, work: Path, env: dict[str, str]):
    """``minimemserve serve`` with the block's ``server`` arguments on a free loopback port;
    yields the port once ``/health`` answers; stopped (SIGINT, then killed) afterwards."""
    port = _free_port()
    argv = [str(_venv_bin() / "minimemserve"), "serve", "--port", str(port)]
    argv += block.marks["server"].split()
    with open(work / "server.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, work / "server.log")
            yield port
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the server did not answer /health in time: {log}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)


def run_block(block: Block, tmp: Path, timeout_s: float) -> None:
    """Run ``block`` in a fresh folder under ``tmp``; fails with its output unless it exits 0."""
    work, env = _workdir(tmp), _env()
    server = _server(block, work, env) if "server" in block.marks else None
    with server if server else _nothing() as port:
        if block.lang == "bash":
            (work / "block.sh").write_text(bash_script(block, port))
            argv = ["bash", "block.sh"]
        else:
            text = block.text if port is None else block.text.replace("8000", str(port))
            (work / "block.py").write_text(text)
            argv = [sys.executable, "block.py"]
        try:
            res = subprocess.run(
                argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{block.name} ran over {timeout_s} s:\n{e.stdout}\n{e.stderr}")
    assert res.returncode == 0, f"{block.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


@contextmanager
def _nothing():
    yield None


# --------------------------------------------------------------------------- dry runs


def checks_of(block: Block, full: bool) -> list[Check]:
    """What is checked of ``block`` without running it: everything when it does not run, else
    only the ``serve`` commands a test server replaces."""
    if block.lang == "python":
        return [] if block.runs(full) else [Check("imports", tuple(python_imports(block.text)))]
    checks = bash_checks(block)
    if not block.runs(full):
        return checks
    if "server" not in block.marks:
        return []
    serves = [w for line in logical_lines(block.text) for w in commands(line) if is_serve(w)]
    return [c for c in checks if c.kind == "cli" and c.argv[:1] == ("serve",)][: len(serves)]


def dry_run(checks: list[Check], tmp: Path) -> list[str | None]:
    """Every check in one process (tests/docs_dry_run.py); one error or None per check."""
    out = tmp / "dry_run.json"
    res = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("docs_dry_run.py")), str(out)],
        input=json.dumps([[c.kind, list(c.argv)] for c in checks]),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=DRY_RUN_TIMEOUT_S,
    )
    assert res.returncode == 0 and out.exists(), res.stderr[-3000:]
    return json.loads(out.read_text())


def static_errors(block: Block, tmp: Path) -> list[str]:
    """A block's errors found without running anything: bash syntax; Python syntax and
    undefined names (ruff's F821)."""
    if block.lang == "bash":
        res = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        return [res.stderr.strip()] if res.returncode else []
    try:
        compile(block.text, block.name, "exec")
    except SyntaxError as e:
        return [f"SyntaxError: {e}"]
    path = tmp / "block.py"
    path.write_text(block.text)
    ruff = shutil.which("ruff", path=str(_venv_bin())) or shutil.which("ruff")
    if ruff is None:
        return []
    res = subprocess.run(
        [ruff, "check", "--no-cache", "--isolated", "--select", "F821", "--output-format",
         "concise", str(path)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    return [ln for ln in res.stdout.splitlines() if "F821" in ln]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[tuple[str, bool], list[str]]:
    """``{(block name, full): [errors]}`` of every block's dry runs, default and whole set."""
    tmp = tmp_path_factory.mktemp("dry")
    keyed = [((b.name, full), c) for full in (False, True) for b in ALL for c in checks_of(b, full)]
    errors = dry_run([c for _, c in keyed], tmp)
    found: dict[tuple[str, bool], list[str]] = {}
    for (key, check), error in zip(keyed, errors):
        if error is not None:
            found.setdefault(key, []).append(f"{check.kind} {' '.join(check.argv)}: {error}")
    return found


def check_block(block: Block, full: bool, tmp: Path, dry: dict) -> None:
    """Check ``block`` statically and by its dry runs, then run it when it runs in this set."""
    errors = static_errors(block, tmp) + dry.get((block.name, full), [])
    assert not errors, f"{block.name}: " + "\n".join(errors)
    if block.runs(full):
        run_block(block, tmp, FULL_TIMEOUT_S if full else BLOCK_TIMEOUT_S)


@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_docs_block(block, tmp_path, dry_runs):
    """The default set: every block checked; unmarked, ``args`` and ``server`` blocks run."""
    check_block(block, False, tmp_path, dry_runs)


@pytest.mark.docs_full
@pytest.mark.timeout(FULL_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_docs_block_full(block, tmp_path, dry_runs):
    """The whole set: ``slow`` blocks run too; ``skip`` blocks are checked as by default."""
    check_block(block, True, tmp_path, dry_runs)


# --------------------------------------------------------------------------- the test itself


def _md(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return blocks(path)


def test_every_doc_has_its_blocks_found():
    names = {b.path.name for b in ALL}
    assert {"README.md", "serving.md", "hosts.md", "ray.md"} <= names
    readme = [b for b in ALL if b.path == REPO / "README.md"]
    assert len(readme) >= 4 and {b.lang for b in readme} == {"bash", "python"}


def test_every_documented_command_is_in_a_fenced_block(tmp_path):
    found = [line for path in doc_files() for line in unfenced_commands(path)]
    assert not found, "indented commands the docs test cannot see: " + "; ".join(found)
    path = tmp_path / "doc.md"
    path.write_text("Run:\n\n    minimemserve bench --rate 2\n\n```bash\nminimemserve x\n```\n")
    assert unfenced_commands(path) == ["doc.md:3: minimemserve bench --rate 2"]


def test_a_renamed_option_fails_the_docs_test(tmp_path):
    """A documented command whose option no longer exists fails its dry run, with the option
    named; the same command spelled right passes; so does one with an abbreviation refused."""
    md = (
        "<!-- docs-test: skip, long -->\n```bash\nminimemserve bench --sessionz 2\n```\n"
        "<!-- docs-test: skip, long -->\n```bash\nminimemserve bench --sessions 2 --rate 1\n```\n"
        "<!-- docs-test: slow, long -->\n```bash\npython bench/throughput.py --quik\n```\n"
        "<!-- docs-test: skip, long -->\n```bash\nminimemserve bench --sess 2\n```\n"
    )
    found = _md(tmp_path, md)
    checks = [c for b in found for c in checks_of(b, False)]
    errors = dry_run(checks, tmp_path)
    assert "unrecognized arguments: --sessionz 2" in errors[0]
    assert errors[1] is None
    assert "unrecognized arguments: --quik" in errors[2]
    assert "unrecognized arguments: --sess 2" in errors[3]


def test_a_renamed_option_fails_a_block_that_runs(tmp_path):
    (block,) = _md(tmp_path, "```bash\nminimemserve preset --named tiny\n```\n")
    with pytest.raises(AssertionError, match="unrecognized arguments"):
        run_block(block, tmp_path, 120)


def test_a_python_block_with_an_undefined_name_or_a_moved_import_fails(tmp_path):
    text = (
        "<!-- docs-test: skip, two hosts -->\n```python\nfrom minimemserve import LLM\n"
        "LLM(None).generate(['x'], SamplingParams())\n```\n"
        "<!-- docs-test: skip, two hosts -->\n```python\n"
        "from minimemserve.nowhere import LLM\nLLM\n```\n"
    )
    undefined, moved = _md(tmp_path, text)
    assert any("SamplingParams" in e for e in static_errors(undefined, tmp_path))
    (error,) = dry_run(checks_of(moved, False), tmp_path)
    assert "No module named 'minimemserve.nowhere'" in error


def test_marks_are_read_strictly(tmp_path):
    bad = {
        "<!-- docs-test: skipp, x -->\n```bash\ntrue\n```\n": "unknown docs-test mark 'skipp'",
        "<!-- docs-test: skip -->\n```bash\ntrue\n```\n": "needs a reason",
        "<!-- docs-test: args -->\n```bash\ntrue\n```\n": "names no arguments",
        "<!-- docs-test: skip, x -->\n\ntext\n```bash\ntrue\n```\n": "not right before a block",
        "<!-- docs-test: skip, x -->\n```json\n{}\n```\n": "before a 'json' block",
        "```bash\ntrue\n": "never closes",
    }
    for text, message in bad.items():
        with pytest.raises(DocsMarkError, match=message):
            _md(tmp_path, text)
    (block,) = _md(
        tmp_path, "<!-- docs-test: args --sessions 2 -->\n```bash\nminimemserve x\n```\n"
    )
    assert block.marks == {"args": "--sessions 2"}


def test_args_and_server_marks_shape_the_script():
    block = Block(
        REPO / "x.md",
        1,
        "bash",
        "minimemserve serve --config PD &   # here\nminimemserve bench \\\n  --rate 1  # quick\n"
        "curl localhost:8000/health\n",
        {"args": "--sessions 2", "server": ""},
    )
    script = bash_script(block, 4321)
    assert "# left out, the test's server runs instead: minimemserve serve" in script
    assert "minimemserve bench    --rate 1 --sessions 2\n" in script
    assert "curl localhost:4321/health" in script


def test_no_bench_script_shadows_an_importable_module():
    """``python bench/NAME.py`` puts bench/ first on the import path, so a file there named as
    a module the environment has (the standard library's, or an installed distribution's)
    would be imported in its place: bench/kernels.py once hid the ``kernels`` package that
    transformers imports."""
    installed = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    for dist in importlib.metadata.distributions():
        installed.add(dist.metadata["Name"].lower().replace("-", "_"))
    clashes = sorted(p.name for p in (REPO / "bench").glob("*.py") if p.stem in installed)
    assert not clashes, f"bench/ files named as importable modules: {clashes}"
