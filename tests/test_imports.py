"""The package's import graph: no cycles, and no project import hidden inside a function.

A function-level import is allowed only for a module that wraps an optional heavy
dependency (triton, flash-attn, matplotlib, ZeroMQ), marked ``# lazy: <why>`` on its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minimemserve", "triton_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, known) -> list[str]:
    """Project modules an import statement loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor if is_pkg else anchor[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    return [n for n in names if n in known]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    known = _modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    hidden = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, str(path))
        is_pkg = path.name == "__init__.py"
        top = set(tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets = _targets(node, module, is_pkg, known)
            if node in top or _guarded(tree, node):
                edges[module].update(t for t in targets if t != module)
            elif targets and "# lazy: " not in lines[node.lineno - 1]:
                hidden.append(f"{module}:{node.lineno} imports {targets} inside a function")
    return edges, hidden


def _guarded(tree: ast.Module, node: ast.stmt) -> bool:
    """Module-level imports under ``if``/``try`` (e.g. TYPE_CHECKING) count as top level."""
    for stmt in tree.body:
        if isinstance(stmt, ast.If | ast.Try) and node in set(ast.walk(stmt)):
            return not any(
                isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                for n in ast.walk(stmt)
            )
    return False


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    edges, _ = _graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_no_project_imports_inside_functions():
    _, hidden = _graph()
    assert hidden == []


def test_the_checker_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# packages only the process runtime (ProcessCluster, its RPC) may need at import time
PROCESS_RUNTIME_ONLY = {"msgspec", "zmq"}


def _top_level_externals(path: Path) -> set[str]:
    """Root names of the modules ``path`` imports when it is imported (not in functions)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if node not in set(tree.body) and not _guarded(tree, node):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_engine_imports_without_the_process_runtime_packages():
    """``import minimemserve`` (engine, model, attention, kernels) loads no module that needs
    msgspec or pyzmq; only the process runtime does, on first use of ``ProcessCluster``."""
    edges, _ = _graph()
    known = _modules()
    reached, todo = set(), ["minimemserve"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(edges[m] | {p for p in known if m.startswith(p + ".")})
    assert {"minimemserve.engine", "minimemserve.llm", "minimemserve.attention"} <= reached
    bad = {m: sorted(_top_level_externals(known[m]) & PROCESS_RUNTIME_ONLY) for m in reached}
    assert {m: b for m, b in bad.items() if b} == {}
