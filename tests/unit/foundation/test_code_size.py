"""Code you can read (docs/architecture.md, "Packages"): no class over 300 lines and no function over
60, docstrings included, in any teamrl package; checked on the source by AST."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [*sorted(ROOT.glob("packages/*/src/teamrl")), ROOT / "src" / "teamrl"]
MAX_LINES = {ast.ClassDef: 300, ast.FunctionDef: 60, ast.AsyncFunctionDef: 60}


def _oversized() -> list[str]:
    found = []
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                limit = MAX_LINES.get(type(node))
                length = node.end_lineno - node.lineno + 1 if limit else 0
                if limit and length > limit:
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines > {limit}"
                    )
    return found


def test_sources_found() -> None:
    assert len(SOURCES) == 5 and all(s.is_dir() for s in SOURCES)


def test_no_class_over_300_lines_no_function_over_60() -> None:
    assert _oversized() == []
