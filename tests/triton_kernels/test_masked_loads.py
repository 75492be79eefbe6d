"""Every masked load of every kernel says what masked-off lanes hold.

A compiled masked load without ``other=`` leaves those lanes undefined (the interpreter
happens to zero them, so the numeric tests on the CPU cannot see the difference); with a
head size that is not a power of two, or past the end of a sequence, undefined lanes that
hold NaN bits poison whole rows of a ``tl.dot``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "triton_kernels"


def _masked_loads(tree: ast.AST):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "tl"
            and any(kw.arg == "mask" for kw in node.keywords)
        ):
            yield node


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_every_masked_load_has_other(path):
    tree = ast.parse(path.read_text())
    missing = [n.lineno for n in _masked_loads(tree) if all(kw.arg != "other" for kw in n.keywords)]
    assert not missing, f"{path.name}: masked tl.load without other= at lines {missing}"


def test_the_check_sees_the_kernels_loads():
    counts = {
        p.name: len(list(_masked_loads(ast.parse(p.read_text())))) for p in KERNELS.glob("*.py")
    }
    assert counts["prefix_prefill.py"] >= 8 and counts["paged_decode.py"] >= 5
