"""Dry runs of documented commands in one process: ``python tests/docs_dry_run.py OUT.json``.

Reads ``[[kind, [argv...]], ...]`` (see ``docs_blocks.Check``) from standard input and
writes ``[error or null, ...]``, in the same order, to ``OUT.json``. A ``cli`` or ``script``
check runs the command's imports and argument parsing as the command would (abbreviated
options refused, so a renamed option is not matched by its old prefix), then stops before any
work; ``module`` finds the module; ``bash`` checks a script's syntax; ``imports`` runs import
statements.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Parsed(Exception):
    """Raised once the outermost argument parse of a command succeeded: the dry run's end."""


def _stop_after_parsing() -> None:
    """Make the outermost ``parse_args``/``parse_known_args`` raise :class:`Parsed` on success
    (sub-parsers parse inside it), and every parser refuse abbreviated options."""
    depth = [0]

    def outermost(method):
        def wrapper(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed
            return result

        return wrapper

    init = argparse.ArgumentParser.__init__

    def strict_init(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    argparse.ArgumentParser.__init__ = strict_init
    argparse.ArgumentParser.parse_args = outermost(argparse.ArgumentParser.parse_args)
    argparse.ArgumentParser.parse_known_args = outermost(argparse.ArgumentParser.parse_known_args)


def _run(target: str, argv: list[str], as_module: bool) -> str | None:
    """Run ``target`` (a script path or module) as ``__main__`` with ``argv`` until it parsed
    its arguments; the error, or None."""
    err = io.StringIO()
    saved = sys.argv, list(sys.path)
    sys.argv = [target, *argv]
    if not as_module:
        sys.path.insert(0, str(Path(target).resolve().parent))  # as `python SCRIPT` has it
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        return "it ran to the end without parsing any arguments"
    except Parsed:
        return None
    except SystemExit as e:  # -h prints its help and exits 0; a bad option exits 2
        if e.code in (0, None):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {e.code}"
    except BaseException as e:  # an import that fails, say: the dry run's finding
        return f"{type(e).__name__}: {e}"
    finally:
        sys.argv, sys.path[:] = saved


def check(kind: str, argv: list[str]) -> str | None:
    """One dry run; the error it found, or None."""
    if kind == "cli":
        return _run("minimemserve.cli", argv, as_module=True)
    if kind == "script":
        path = REPO / argv[0]
        return _run(str(path), argv[1:], False) if path.exists() else f"no such script {argv[0]}"
    if kind == "module":
        found = importlib.util.find_spec(argv[0]) is not None
        return None if found else f"no module named {argv[0]}"
    if kind == "bash":
        path = REPO / argv[0]
        if not path.exists():
            return f"no such script {argv[0]}"
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        return None if res.returncode == 0 else res.stderr.strip()
    if kind == "imports":
        try:
            exec("\n".join(argv), {})
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    return f"unknown check {kind!r}"


def main() -> None:
    checks = json.load(sys.stdin)
    _stop_after_parsing()
    errors = [check(kind, list(argv)) for kind, argv in checks]
    Path(sys.argv[1]).write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
