"""The suite's own layout: the files ``scripts/test.sh`` runs alone exist (a renamed one would join the
parallel phase silently)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_FILES

ROOT = Path(__file__).resolve().parents[2]


def test_every_heavy_file_exists():
    missing = sorted(f for f in HEAVY_FILES if not (ROOT / f).is_file())
    assert not missing, f"tests/conftest.py HEAVY_FILES names files that are not there: {missing}"


def test_no_two_test_files_share_a_basename():
    """pytest imports test modules by basename (rootdir-relative, no packages): two files named alike in
    tests/unit and tests/cluster make the whole run stop with "import file mismatch"."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path
