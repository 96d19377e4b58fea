"""Every planted bug of ``scripts/check_guarantees.py`` still applies to the code as it is.

A mutation whose snippet no longer occurs exactly once is reported STALE by the check, and the
guarantee it stands for is then not checked at all; this test fails at once instead, naming it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from guarantee_mutations import MUTATIONS  # noqa: E402


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_snippet_occurs_exactly_once(m):
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its snippet occurs {text.count(m.old)} times in {m.path}; update it"
    test_file = m.test.split("::")[0]
    assert (ROOT / test_file).exists(), f"{m.name}: the test {m.test} is not there"


def test_every_guarantee_row_has_a_mutation():
    assert {m.guarantee for m in MUTATIONS} == {str(i) for i in range(1, 13)} | {"metrics"}
