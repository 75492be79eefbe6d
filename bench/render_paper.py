"""Render the numbers of README.md and docs/simulator.md from the committed evaluations.

Every ``<!-- sim_paper RUN:BLOCK -->`` ... ``<!-- /sim_paper -->`` block in those files is
written again from ``docs/paper/RUN/sim_paper.json`` (``minimemserve_lab.paper.RENDERERS``
names the blocks); a test checks that the committed files are what this writes.

    python bench/render_paper.py
"""

from __future__ import annotations

import json
from pathlib import Path

from minimemserve_lab import paper

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "simulator.md")


def committed() -> dict[str, dict]:
    """Every committed evaluation, by its directory's name."""
    return {
        p.parent.name: json.loads(p.read_text())
        for p in sorted((ROOT / "docs" / "paper").glob("*/sim_paper.json"))
    }


def main() -> None:
    """Rewrite the blocks of :data:`DOCS` in place."""
    results = committed()
    for doc in DOCS:
        doc.write_text(paper.render_blocks(doc.read_text(), results))
        print(f"rendered {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
