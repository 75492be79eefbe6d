"""The code's shape: no class over 400 lines and no function over 80 in ``minimemserve/``,
``bench/`` and ``triton_kernels/`` (each exception named below, with its reason), no function
in the package taking more than 10 parameters (a spec is one), and no constructor packing
several attributes into one tuple assignment (complexity is ruff's C901, at most 10, in CI's
``ruff check`` of the whole tree)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 10
# "path:name" -> why it may take more parameters (none now).
PARAMETER_EXCEPTIONS: dict[str, str] = {}
# The package and the evaluation lab beside it.
PACKAGES = ("minimemserve", "minimemserve_lab")
CHECKED = ("minimemserve", "minimemserve_lab", "bench", "triton_kernels")
# "path:name" -> why it may be longer. A @triton.jit kernel is one GPU program: its loads,
# masks and accumulators live in registers across the whole body, and splitting it into
# jit helpers only moves lines (they are inlined back), so each kernel stands whole.
EXCEPTIONS = {
    "triton_kernels/paged_decode.py:_paged_decode_kernel": "one Triton program (see above)",
    "triton_kernels/prefix_prefill.py:_prefix_prefill_kernel": "one Triton program (see above)",
}


def oversized(root: Path) -> list[str]:
    """Every class and function under ``root`` longer than its limit, with its length."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            where = path.relative_to(root.parent)
            if lines > limit and f"{where}:{node.name}" not in EXCEPTIONS:
                found.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_class_or_function_is_oversized():
    assert [f for part in CHECKED for f in oversized(ROOT / part)] == []


def test_every_exception_is_still_needed():
    """An exception that no longer exceeds its limit (or no longer exists) is dropped."""
    lengths = {}
    for key in EXCEPTIONS:
        path, name = key.split(":")
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
                lengths[key] = node.end_lineno - node.lineno + 1
    assert all(lengths.get(k, 0) > MAX_FUNCTION_LINES for k in EXCEPTIONS), lengths


def test_the_shape_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    pass\n")
    assert oversized(tmp_path / "pkg") == [f"pkg/m.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]


def packed_in_constructors(root: Path) -> list[str]:
    """Every ``a, b = x, y`` of literal tuples in an ``__init__`` or ``__post_init__`` under
    ``root`` (one attribute per line reads better; unpacking a call's result is fine)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in ("__init__", "__post_init__")):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Tuple) for t in node.targets)
                    and isinstance(node.value, ast.Tuple)
                ):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_constructors_assign_one_attribute_per_statement(tmp_path):
    assert [f for part in PACKAGES for f in packed_in_constructors(ROOT / part)] == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "class A:\n    def __init__(self, x):\n        self.a, self.b = x, 2\n"
        "        self.c, self.d = divmod(x, 2)\n"
    )
    assert packed_in_constructors(tmp_path / "pkg") == ["pkg/m.py:3"]


def too_many_parameters(root: Path) -> list[str]:
    """Every function under ``root`` taking more than :data:`MAX_PARAMETERS` parameters:
    positional, keyword-only, ``*args`` and ``**kwargs`` each count one; ``self`` and ``cls``
    do not. What a function needs that much of is a spec: one parameter."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = fn.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            count -= bool(names) and names[0] in ("self", "cls")
            key = f"{path.relative_to(root.parent)}:{fn.name}"
            if count > MAX_PARAMETERS and key not in PARAMETER_EXCEPTIONS:
                found.append(f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name}: {count}")
    return found


def test_no_function_takes_more_than_ten_parameters():
    assert [f for part in PACKAGES for f in too_many_parameters(ROOT / part)] == []


def test_the_parameter_check_counts_every_kind(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(a, b, /, c, *d, e, f, g, h, i, j, **k):\n    pass\n\n\n"
        "class C:\n    def m(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n"
    )
    assert too_many_parameters(tmp_path / "pkg") == ["pkg/m.py:1 f: 11"]
