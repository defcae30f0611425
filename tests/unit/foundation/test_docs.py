"""Docs live in the repository: every doc the code cites ships with it.

A reader who clones the repository must be able to follow each reference in a docstring, comment,
test or manifest. So no file under the code trees may cite the engineers' notes that are not in
the repository, every ``docs/<name>.md`` cited exists, every numbered section cited
(``docs/algorithms.md §6``) is a ``## 6.`` heading of that file, and every reliability case id cited
(``docs/reliability.md R-fuzz``) is a heading of docs/reliability.md. Plain file reads, no imports of
the project: this runs in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CODE_TREES = ("packages", "src", "tests", "scripts", "deploy")
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}  # plus hidden and *.egg-info folders
# Notes kept outside the repository for engineers only; spelled in parts so this file does not cite them.
OUTSIDE_NOTES = ("ALGORITHMS", "RELIABILITY", "STYLE", "LEARNING-NOTES")
OUTSIDE_RE = re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in OUTSIDE_NOTES) + r")\.md\b")
DOC_RE = re.compile(r"(?<![\w/.-])docs/([\w-]+)\.md\b")
SECTION_RE = re.compile(r"docs/([\w-]+)\.md((?:(?:,\s*|\s+and\s+|\s*-\s*|\s+)§\s?\d+[a-z]?)+)")
CASE_RE = re.compile(r"docs/reliability\.md,?\s+((?:R-[a-z][\w-]*)(?:(?:,\s*|\s+and\s+)R-[a-z][\w-]*)*)")


def code_files() -> list[Path]:
    out = []
    for tree in CODE_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if any(p in SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in rel[:-1]):
                continue
            if path.is_file() and not path.name.startswith("."):
                out.append(path)
    return out


def read(path: Path) -> str:
    data = path.read_bytes()
    return "" if b"\0" in data[:8192] else data.decode("utf-8", errors="replace")


def citations(regex: re.Pattern[str]) -> list[tuple[str, int, re.Match[str]]]:
    found = []
    for path in code_files():
        for n, line in enumerate(read(path).splitlines(), 1):
            for m in regex.finditer(line):
                found.append((str(path.relative_to(ROOT)), n, m))
    return found


def test_the_code_trees_are_found() -> None:
    files = {str(p.relative_to(ROOT)) for p in code_files()}
    assert "tests/unit/foundation/test_docs.py" in files
    assert any(f.startswith("packages/") and f.endswith(".py") for f in files)


def test_no_citation_of_notes_outside_the_repository() -> None:
    bad = [f"{f}:{n}: {m.group(0)}" for f, n, m in citations(OUTSIDE_RE)]
    assert not bad, "cite docs/*.md or the README instead:\n" + "\n".join(bad)


def test_every_cited_doc_exists() -> None:
    cited = citations(DOC_RE)
    assert cited, "the code cites no docs/*.md at all: is the pattern still right?"
    missing = [
        f"{f}:{n}: {m.group(0)}" for f, n, m in cited if not (ROOT / "docs" / f"{m.group(1)}.md").is_file()
    ]
    assert not missing, "cited but not in docs/:\n" + "\n".join(missing)


def test_every_cited_section_exists() -> None:
    missing = []
    for f, n, m in citations(SECTION_RE):
        doc = ROOT / "docs" / f"{m.group(1)}.md"
        if not doc.is_file():
            continue  # reported by test_every_cited_doc_exists
        headings = set(re.findall(r"^##+ (\d+)\.", doc.read_text(encoding="utf-8"), re.M))
        for section in re.findall(r"§\s?(\d+)", m.group(2)):
            if section not in headings:
                missing.append(f"{f}:{n}: {m.group(0)} (no '## {section}.' heading in docs/{doc.name})")
    assert not missing, "\n".join(missing)


def test_every_cited_reliability_case_exists() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    ids = set(re.findall(r"^## (R-[a-z][\w-]*):", text, re.M))
    assert ids, "docs/reliability.md has no '## R-...:' headings"
    missing = [
        f"{f}:{n}: {case}"
        for f, n, m in citations(CASE_RE)
        for case in re.findall(r"R-[a-z][\w-]*", m.group(1))
        if case not in ids
    ]
    assert not missing, "no such case in docs/reliability.md:\n" + "\n".join(missing)


def test_readme_lists_every_doc() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    docs_line = next((line for line in readme.split("\n\n") if line.startswith("Docs:")), "")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in docs_line, f"README's Docs line does not list docs/{doc.name}"
