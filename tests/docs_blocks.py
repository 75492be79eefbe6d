"""The fenced ``bash`` and ``python`` blocks of the project's Markdown, and how to test each.

A block runs as written unless the line right before it (or a run of such lines) marks it:

- ``<!-- docs-test: skip, REASON -->``: never run (it needs a GPU, several hosts, installs
  something, or takes too long); it is still checked: a ``bash`` block's syntax, every
  ``minimemserve`` command and ``python`` script in it parsed with its arguments (a dry run:
  the script's imports run and its argument parser is called, then it stops), a script that
  ``bash`` runs checked for syntax; a ``python`` block compiled, checked for undefined names and
  its absolute imports run.
- ``<!-- docs-test: slow, REASON -->``: checked as ``skip`` by default; run in the whole set
  (``pytest -m docs_full tests/test_docs.py``).
- ``<!-- docs-test: args ARGS -->``: ``ARGS`` appended to every ``minimemserve`` and ``python``
  command of the block to make it quick (``--sessions 2``).
- ``<!-- docs-test: server [ARGS] -->``: ``minimemserve serve [ARGS]`` is started on a free
  loopback port before the block and stopped after it; port 8000 in the block becomes that
  port, and the block's own ``serve`` commands are parsed instead of run.

A mark with another word, or one that is not right before a block, is an error naming its file
and line.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LANGS = ("bash", "python")
KINDS = ("skip", "slow", "args", "server")
NEEDS_REASON = ("skip", "slow")
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
PORT = re.compile(r"\b8000\b")  # the port the docs' servers listen on
CLI = ("minimemserve", ".venv/bin/minimemserve")
PYTHON = ("python", "python3", ".venv/bin/python")
SEPARATORS = ("&&", "||", ";", "|", "&", ";;", "(", ")")


class DocsMarkError(ValueError):
    """A ``docs-test`` mark that cannot be read, named by file and line."""


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and text, and its marks (kind -> value)."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``README.md:42``: the block's file (from the repository) and line."""
        try:
            shown = self.path.relative_to(REPO)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"

    def runs(self, full: bool) -> bool:
        """Whether the block is run (else only checked): ``skip`` never, ``slow`` in the
        whole set only."""
        return "skip" not in self.marks and (full or "slow" not in self.marks)


def doc_files() -> list[Path]:
    """README.md, docs/*.md and bench/README.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/README.md"]


def _mark(path: Path, number: int, body: str) -> tuple[str, str]:
    kind, _, value = body.replace(",", " ", 1).partition(" ")
    value = value.strip()
    if kind not in KINDS:
        raise DocsMarkError(f"{path}:{number}: unknown docs-test mark {kind!r}; one of {KINDS}")
    if kind in NEEDS_REASON and not value:
        raise DocsMarkError(f"{path}:{number}: docs-test {kind} needs a reason after a comma")
    if kind == "args" and not value:
        raise DocsMarkError(f"{path}:{number}: docs-test args names no arguments")
    return kind, value


def blocks(path: Path) -> list[Block]:
    """Every fenced ``bash`` and ``python`` block of ``path`` with its marks."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    pending: dict[str, str] = {}
    pending_line = 0
    i = 0
    while i < len(lines):
        mark, fence = MARK.match(lines[i]), FENCE.match(lines[i])
        if mark:
            kind, value = _mark(path, i + 1, mark.group(1))
            pending[kind] = value
            pending_line = pending_line or i + 1
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise DocsMarkError(f"{path}:{i + 1}: a fenced block that never closes")
            lang = fence.group(1)
            if pending and lang not in LANGS:
                raise DocsMarkError(
                    f"{path}:{pending_line}: docs-test mark before a {lang!r} block"
                )
            if lang in LANGS:
                text = "\n".join(lines[i + 1 : end]) + "\n"
                found.append(Block(path, i + 1, lang, text, dict(pending)))
            pending, pending_line, i = {}, 0, end
        elif pending:
            raise DocsMarkError(f"{path}:{pending_line}: docs-test mark not right before a block")
        i += 1
    if pending:
        raise DocsMarkError(f"{path}:{pending_line}: docs-test mark not right before a block")
    return found


UNFENCED = re.compile(r"^ {4,}(\.venv/bin/)?(python3?|minimemserve|bash|pip|curl) ")


def unfenced_commands(path: Path) -> list[str]:
    """``file:line`` of every command in an indented code block: the test sees fenced blocks
    only, so a documented command must be in one."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and UNFENCED.match(line):
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


# --------------------------------------------------------------------------- bash blocks


def logical_lines(text: str) -> list[str]:
    """A bash block's lines with ``\\`` continuations joined."""
    out, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of one logical line (split at ``&&``, ``|``, ``;``, ``&``), each as
    its words, comments dropped; a line shlex cannot split gives none."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return []
    out: list[list[str]] = [[]]
    for word in words:
        if word in SEPARATORS:
            out.append([])
        else:
            out[-1].append(word)
    return [c for c in out if c]


@dataclass(frozen=True)
class Check:
    """A dry run: ``kind`` is ``cli`` (``minimemserve`` with ``argv``), ``script`` (``python
    SCRIPT argv``), ``module`` (``python -m MODULE``: it must be importable), ``bash`` (the
    script's syntax) or ``imports`` (``argv`` is Python import statements to run)."""

    kind: str
    argv: tuple[str, ...]


def command_check(words: list[str]) -> Check | None:
    """What a dry run of one command checks, or None (a command the project does not own)."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value before the command
    if not words:
        return None
    head, rest = words[0], tuple(words[1:])
    if head in CLI:
        return Check("cli", rest)
    if head in PYTHON and rest[:1] == ("-m",) and len(rest) > 1:
        return Check("module", rest[1:])
    if head in PYTHON and rest and rest[0].endswith(".py"):
        return Check("script", rest)
    if head == "bash" and rest and rest[0].endswith(".sh"):
        return Check("bash", rest)
    return None


def _is_project_command(words: list[str]) -> bool:
    check = command_check(words)
    return check is not None and check.kind in ("cli", "script", "module")


def is_serve(words: list[str]) -> bool:
    """Whether a command starts ``minimemserve serve``."""
    check = command_check(words)
    return check is not None and check.kind == "cli" and check.argv[:1] == ("serve",)


def bash_checks(block: Block) -> list[Check]:
    """The dry runs of every command of a bash block that the project owns."""
    found = []
    for line in logical_lines(block.text):
        for words in commands(line):
            check = command_check(words)
            if check is not None:
                found.append(check)
    return found


def _strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def bash_script(block: Block, port: int | None) -> str:
    """The script that runs a bash block: ``args`` appended to the project's commands, the
    block's own ``serve`` commands left out when a server runs beside it (``port``)."""
    extra = block.marks.get("args", "")
    lines = ["set -euo pipefail"]
    for line in logical_lines(block.text):
        words = [w for c in commands(line) for w in c]
        if port is not None and commands(line) and is_serve(commands(line)[0]):
            lines.append(f"# left out, the test's server runs instead: {line}")
            continue
        code = _strip_comment(line)
        if extra and commands(line) and _is_project_command(commands(line)[-1]) and words:
            background = code.endswith("&") and not code.endswith("&&")
            code = code[:-1].rstrip() if background else code
            code = f"{code} {extra}" + (" &" if background else "")
        lines.append(code)
    script = "\n".join(lines) + "\n"
    return PORT.sub(str(port), script) if port is not None else script


def python_imports(text: str) -> list[str]:
    """The absolute import statements of a Python block, each as source."""
    tree = ast.parse(text)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
            out.append(ast.unparse(node))
    return out
