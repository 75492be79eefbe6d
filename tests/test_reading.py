"""The reading path of ``docs/reading.md``, measured in code lines (no docstrings, comments
or blank lines): the heart (each stop's ``Read:`` units: a file, or ``file::Class`` /
``file::Class.method``), and the whole in-process path (every package function that runs
while ``LLM`` serves a two-turn conversation under PD-CC and under 1P1D-CC, module level
excluded). ``pytest -s tests/test_reading.py`` prints the counts; the README quotes them."""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from functools import cache
from pathlib import Path

from minimemserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minimemserve"
HEART_MAX = 1500
PATH_MAX = 3000
QUOTE_TOLERANCE = 0.05  # the README's rounded numbers stay within 5 % of the counts
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@cache
def _parsed(path: Path) -> tuple[ast.Module, frozenset[int]]:
    """``path``'s syntax tree and its code lines: lines holding a token other than a comment
    or a docstring (of the module, a class or a function)."""
    src = path.read_text()
    tree = ast.parse(src)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, *_DEFS)) and ast.get_docstring(node, clean=False):
            first = node.body[0]
            docs.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in _NOT_CODE:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return tree, frozenset(lines)


def _span(node: ast.AST) -> range:
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return range(start, node.end_lineno + 1)


def unit_lines(unit: str) -> set[tuple[str, int]]:
    """The code lines of ``unit`` (``path`` or ``path::Qual.name``), as ``(path, line)``."""
    rel, _, qual = unit.partition("::")
    path = ROOT / rel
    assert path.is_file(), f"docs/reading.md names {rel}, which does not exist"
    tree, lines = _parsed(path)
    node: ast.AST = tree
    for name in qual.split(".") if qual else ():
        found = [n for n in node.body if isinstance(n, _DEFS) and n.name == name]
        assert found, f"docs/reading.md names {unit}: no {name} in {rel}"
        node = found[0]
    span = _span(node) if qual else range(1, len(path.read_text().splitlines()) + 1)
    return {(rel, n) for n in lines if n in span}


def heart() -> list[tuple[str, list[str]]]:
    """The stops of docs/reading.md in order: ``(title, units)``."""
    stops: list[tuple[str, list[str]]] = []
    for line in (ROOT / "docs" / "reading.md").read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith("Read: "):
            stops.append((title, re.findall(r"`([^`]+)`", line)))
    return stops


def _function_starts(rel: str) -> dict[int, ast.AST]:
    tree, _ = _parsed(ROOT / rel)
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[_span(node).start] = node
            out[node.lineno] = node
    return out


def served_path() -> set[tuple[str, int]]:
    """The code lines of every package function that runs while the tiny preset serves a
    two-turn conversation in this process under PD-CC and 1P1D-CC."""
    ran: set[tuple[str, int]] = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)):
            ran.add((code.co_filename, code.co_firstlineno))

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for config in ("PD-CC", "1P1D-CC"):
        with LLM(None, config=config, num_blocks=64) as llm:
            prompt = llm.tokenizer.encode("Read the pool calls of a request.")
            sys.setprofile(profile)
            try:
                first = llm.generate([prompt], params)[0]
                llm.generate([prompt + first.token_ids + prompt], params)
            finally:
                sys.setprofile(None)
    lines: set[tuple[str, int]] = set()
    for file, start in ran:
        rel = str(Path(file).relative_to(ROOT))
        if (node := _function_starts(rel).get(start)) is not None:
            _, code = _parsed(ROOT / rel)
            lines |= {(rel, n) for n in code if n in _span(node)}
    return lines


def _quoted(what: str) -> int:
    """The number the README quotes for ``what`` ("heart" or "path"): "N code lines"."""
    text = (ROOT / "README.md").read_text()
    marker = {"heart": "the heart", "path": "the whole in-process path"}[what]
    m = re.search(re.escape(marker) + r"[^.]*?([\d,]+) code lines", text)
    assert m, f"README.md quotes no '{marker} ... N code lines'"
    return int(m.group(1).replace(",", ""))


def test_the_reading_path_is_short_and_the_readme_quotes_it():
    stops = heart()
    assert [t.split(" ", 1)[0] for t, _ in stops] == [f"{i}." for i in range(1, 9)]
    total: set[tuple[str, int]] = set()
    print()
    for title, units in stops:
        lines = set().union(*map(unit_lines, units))
        total |= lines
        print(f"{len(lines):5d}  {title}")
    path = served_path() | total
    print(f"{len(total):5d}  the heart (limit {HEART_MAX})")
    print(f"{len(path):5d}  the whole in-process path (limit {PATH_MAX})")
    assert len(total) <= HEART_MAX
    assert len(path) <= PATH_MAX
    for what, n in (("heart", len(total)), ("path", len(path))):
        assert abs(_quoted(what) - n) <= QUOTE_TOLERANCE * n, (what, _quoted(what), n)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(tmp_path, monkeypatch):
    src = (
        '"""Module."""\n\n\ndef f(x):\n    """Doc,\n    two lines."""\n'
        "    # note\n    return (\n        x  # why\n    )\n"
    )
    (tmp_path / "m.py").write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(n for _, n in unit_lines("m.py")) == [4, 8, 9, 10]
    assert sorted(n for _, n in unit_lines("m.py::f")) == [4, 8, 9, 10]
