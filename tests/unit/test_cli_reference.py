"""The README's command reference lists every flag each command accepts (and no flag that does not exist)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = README.parent / "docs"


def _section(text: str) -> str:
    start = text.index("## Command reference\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _reference() -> str:
    """README's command reference, with the ``## Command reference`` section of any docs/*.md (a feature's own page)."""
    parts = [_section(README.read_text())]
    parts += [_section(t) for t in (p.read_text() for p in sorted(DOCS.glob("*.md"))) if "## Command reference\n" in t]
    return "\n".join(parts)


def _commands() -> dict[str, argparse.ArgumentParser]:
    out = {}
    for prog, parser in (("coordinator", coordinator_parser()), ("agent", agent_parser())):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{prog} {name}": sub for name, sub in action.choices.items()})
    return out


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_flag_is_in_the_command_reference(command):
    reference = _reference()
    assert f"`{command}" in reference, command
    flags = [s for a in _commands()[command]._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if not re.search(rf"`{re.escape(f)}(?![\w-])", reference)]
    assert not missing, f"{command}: flags missing from the README's command reference: {missing}"


def test_the_reference_names_no_flag_that_does_not_exist():
    known = {s for p in _commands().values() for a in p._actions for s in a.option_strings}
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", _reference()))
    assert named <= known, sorted(named - known)
