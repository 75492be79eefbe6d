"""The package's import graph: layers, no cycles, and no project import hidden inside a
function.

:data:`LAYERS` is the package's layer stack, bottom first: a unit (a top-level module or
subpackage of ``minimemserve``, or ``triton_kernels``) imports only units of lower layers, and
a unit missing from the table fails, so a new one is placed before it lands.

A function-level import is allowed only for a module that wraps an optional heavy
dependency (triton, flash-attn, matplotlib, ZeroMQ), or for the evaluation lab
(``minimemserve_lab``) in the command that runs one of its jobs, marked ``# lazy: <why>`` on
its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minimemserve", "triton_kernels", "minimemserve_lab")

# Bottom first. Core: errors up to the engine (and the KV link table); runtimes: the in-process
# runtime, the deployment spec that builds any runtime (the process runtimes, which take it, only
# when first used), the process runtimes, and LLM (the package root exports them); workloads
# and the shared command-line options; the server and the simulator; the evaluation lab (the
# paper's reproduction, the benchmark harness: outside the package, which imports it only inside
# the commands that run it); the command line over everything.
LAYERS = (
    ("errors", "sharegpt", "triton_kernels"),
    ("sampling", "blocks", "memory"),
    ("request", "attention", "mempool"),
    ("serving", "model", "recipes", "decode_graphs"),
    ("scheduler", "presets", "links"),
    ("config",),
    ("parallel",),
    ("engine",),
    ("inprocess",),
    ("deployment",),
    ("disagg",),
    ("llm",),
    ("minimemserve",),
    ("workloads",),
    ("options", "explain"),
    ("server", "sim"),
    ("minimemserve_lab",),
    ("cli",),
)


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


def _unit(module: str) -> str:
    """The layer-table name of a module: ``minimemserve.disagg.rpc`` -> ``disagg``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "minimemserve" and len(parts) > 1 else parts[0]


def upward_edges(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a unit from its own or a higher layer, and every unplaced unit."""
    rank = {unit: i for i, names in enumerate(layers) for unit in names}
    bad = sorted({f"{_unit(m)} is in no layer" for m in edges if _unit(m) not in rank})
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = _unit(m), _unit(t)
            if a != b and a in rank and b in rank and rank[b] >= rank[a]:
                bad.append(f"{m} imports {t}: layer {rank[a]} ({a}) -> {rank[b]} ({b})")
    return bad


def test_imports_only_go_down_the_layer_stack():
    edges, _ = _graph()
    assert upward_edges(edges) == []


def test_the_layer_check_catches_a_planted_upward_edge():
    """The real graph with one upward edge planted (the engine importing the process
    runtime), one sideways edge, and one unplaced module: each is reported."""
    edges, _ = _graph()
    planted = {m: set(t) for m, t in edges.items()}
    planted["minimemserve.engine"].add("minimemserve.disagg.runtime")
    planted["minimemserve.server.app"].add("minimemserve.sim.runner")
    planted["minimemserve.extra"] = {"minimemserve.engine"}
    assert upward_edges(planted) == [
        "extra is in no layer",
        "minimemserve.engine imports minimemserve.disagg.runtime: layer 7 (engine) -> 10 (disagg)",
        "minimemserve.server.app imports minimemserve.sim.runner: layer 15 (server) -> 15 (sim)",
    ]


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
