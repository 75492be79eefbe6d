"""The package's size in code lines (counted as ``tests/test_reading.py`` counts them: no
docstrings, comments or blank lines), and the evaluation lab kept out of it: what only
evaluations use lives in ``minimemserve_lab``, which ``import minimemserve`` never loads.
``pytest -s tests/test_package_size.py`` prints the count."""

from __future__ import annotations

import subprocess
import sys

from test_reading import PACKAGE, ROOT, _parsed

PACKAGE_MAX = 15_000


def package_lines() -> int:
    """Code lines of every ``minimemserve/**/*.py``."""
    return sum(len(_parsed(path)[1]) for path in sorted(PACKAGE.rglob("*.py")))


def test_the_package_is_at_most_15000_code_lines():
    n = package_lines()
    print(f"\n{n:6d}  code lines in minimemserve/ (limit {PACKAGE_MAX})")
    assert n <= PACKAGE_MAX


def test_importing_the_package_does_not_import_the_lab():
    code = (
        "import sys, minimemserve, minimemserve.cli, minimemserve.sim\n"
        "lab = sorted(m for m in sys.modules if m.startswith('minimemserve_lab'))\n"
        "assert not lab, lab\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
