"""The generated reference pages (docs/reference/) are what ``scripts/gen_reference.py`` writes from the code now.

A flag, a message field, a trainer method or a metric added without running the script makes this fail,
naming the page and the command that brings it up to date.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_reference  # noqa: E402

PAGES = gen_reference.pages()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_generated_page_is_up_to_date(name):
    path = ROOT / "docs" / "reference" / name
    expected = PAGES[name]
    actual = path.read_text() if path.exists() else ""
    if actual != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    actual.splitlines(keepends=True),
                    expected.splitlines(keepends=True),
                    f"docs/reference/{name} (as committed)",
                    f"docs/reference/{name} (from the code now)",
                    n=1,
                )
            )[:60]
        )
        pytest.fail(
            f"docs/reference/{name} is out of date with the code: run `python scripts/gen_reference.py` "
            f"and commit the page.\n{diff}",
            pytrace=False,
        )


def test_every_generated_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [name for name in PAGES if f"reference/{name}" not in nav]
    assert not missing, f"generated pages missing from mkdocs.yml's nav: {missing}"
