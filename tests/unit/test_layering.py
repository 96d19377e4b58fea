"""Imports run one way: ``common`` <- ``coordinator``, ``common`` <- ``agent``; ``harness`` (the test
harness) may import all three; nothing shipped imports ``tests`` or ``scripts``.

Read from the source with ``ast``, so a lazy import inside a function counts as much as one at the top.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> the project packages it may import (besides itself)
ALLOWED = {
    "common": set(),
    "coordinator": {"common"},
    "agent": {"common"},
    "harness": {"common", "coordinator", "agent"},
}
PROJECT = set(ALLOWED) | {"tests", "scripts"}


def imported_top_levels(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations(package: str, root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for line, top in imported_top_levels(path):
            if top in PROJECT and top != package and top not in ALLOWED[package]:
                out.append(f"{path.relative_to(root)}:{line} imports {top}")
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package):
    assert violations(package) == []


def test_the_check_sees_a_forbidden_lazy_import(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "x.py").write_text("def f():\n    from agent.worker import Agent\n")
    assert violations("common", root=tmp_path) == ["common/x.py:2 imports agent"]
