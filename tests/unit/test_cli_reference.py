"""The command-line pages list every flag each command accepts, and no flag that does not exist.

``docs/reference/cli.md`` is generated from the parsers (``scripts/gen_reference.py``; that it is up to date
is ``test_reference_pages.py``'s check); the hand-written pages that explain the flags in practice,
``docs/operate/configuration.md`` and ``docs/operate/engines.md``, are checked here against the parsers.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATED = DOCS / "reference" / "cli.md"
EXPLAINED = (DOCS / "operate" / "configuration.md", DOCS / "operate" / "engines.md")


def _explained() -> str:
    return "\n".join(path.read_text() for path in EXPLAINED)


def _commands() -> dict[str, argparse.ArgumentParser]:
    out = {}
    for prog, parser in (("coordinator", coordinator_parser()), ("agent", agent_parser())):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{prog} {name}": sub for name, sub in action.choices.items()})
    return out


def _flags(command: str) -> list[str]:
    parser = _commands()[command]
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


@pytest.mark.parametrize("page", ["generated", "explained"])
@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_flag_is_in_the_command_pages(command, page):
    reference = GENERATED.read_text() if page == "generated" else _explained()
    assert f"`{command}" in reference or f"## {command}" in reference, command
    missing = [
        f
        for f in _flags(command)
        if not re.search(rf"`{re.escape(f)}(?![\w-])|[ ,`]{re.escape(f)}(?![\w-])", reference)
    ]
    where = GENERATED.name if page == "generated" else " + ".join(p.name for p in EXPLAINED)
    assert not missing, f"{command}: flags missing from {where}: {missing} (run python scripts/gen_reference.py)"


def test_the_explained_pages_name_no_flag_that_does_not_exist():
    known = {s for p in _commands().values() for a in p._actions for s in a.option_strings}
    # flags of other programs the pages quote: SGLang's launch_server, torchrun
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", _explained()))
    assert named <= known, sorted(named - known)
