"""The README and the documentation pages say what the code and the suite do.

- the README's quick start is the two commands, and both scripts exist;
- every test the guarantee table (docs/concepts/guarantees.md) names exists, and every row of the table
  has planted bugs in scripts/guarantee_mutations.py (and every guarantee with planted bugs has a row);
- the count of planted bugs the pages give is the count of ``MUTATIONS``;
- every page under docs/ is in the site's navigation (mkdocs.yml), and every docs/ link of the README exists.

The links and anchors between pages are checked by ``mkdocs build --strict`` (scripts/test.sh).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUARANTEES = DOCS / "concepts" / "guarantees.md"
sys.path.insert(0, str(ROOT / "scripts"))

from guarantee_mutations import MUTATIONS  # noqa: E402


def _table_rows() -> dict[str, list[str]]:
    """Each numbered row of the guarantee table: its number -> its cells."""
    rows = {}
    for line in GUARANTEES.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def _test_files() -> dict[str, Path]:
    return {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_readme_quick_start_is_the_two_commands():
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quick start")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert (ROOT / script).is_file(), script


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the detail into a page under docs/"


@pytest.mark.parametrize("row", sorted(_table_rows(), key=int))
def test_every_test_a_guarantee_names_exists(row):
    proved_by = _table_rows()[row][-1]
    files = _test_files()
    named = re.findall(r"`(test_\w+\.py)(?:::(\w+)(…)?)?`", proved_by)
    assert named, f"guarantee {row} names no test"
    for name, function, cut in named:
        assert name in files, f"guarantee {row} names {name}, which is not under tests/"
        if function:
            defined = _functions(files[name])
            found = any(f.startswith(function) for f in defined) if cut else function in defined
            assert found, f"guarantee {row} names {name}::{function}{cut}, which {name} does not define"


def test_every_guarantee_row_has_planted_bugs_and_every_planted_bug_a_row():
    planted = {m.guarantee for m in MUTATIONS} - {"metrics"}
    rows = set(_table_rows())
    assert rows == {str(i) for i in range(1, len(rows) + 1)}, f"rows are not numbered 1..n: {sorted(rows)}"
    assert planted == rows, (
        f"rows without planted bugs: {sorted(rows - planted, key=int)}; "
        f"planted bugs for rows the table lacks: {sorted(planted - rows, key=int)}"
    )


@pytest.mark.parametrize("page", ["concepts/guarantees.md", "develop/planted-bugs.md"])
def test_the_count_of_planted_bugs_is_the_count_of_mutations(page):
    text = (DOCS / page).read_text()
    counts = [int(n) for n in re.findall(r"(\d+) planted bugs in all", text)]
    assert counts == [len(MUTATIONS)], (
        f"docs/{page} says {counts} planted bugs; scripts/guarantee_mutations.py has {len(MUTATIONS)}"
    )
    metrics = sum(1 for m in MUTATIONS if m.guarantee == "metrics")
    assert re.search(rf"\b{metrics} for the per-batch\s+metrics", text), (
        f"docs/{page}: the metrics count is not {metrics}"
    )


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w./-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"


def test_every_docs_link_of_the_readme_exists():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
