"""The shipped systemd units pass ``systemd-analyze verify``, and their example config files are valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import build_parser as agent_parser
from common.config_file import parse_args_with_config
from coordinator.cli import build_parser as coordinator_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = ("rollfleet-coordinator.service", "rollfleet-agent.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not on this machine")
def test_units_pass_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart's program exists: point it at this environment's console scripts.
    bindir = str(Path(sys.executable).parent)
    for unit in UNITS:
        text = (DEPLOY / unit).read_text().replace("/opt/rollfleet/venv/bin", bindir)
        assert f"{bindir}/" in text, unit
        (tmp_path / unit).write_text(text)
    out = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / u) for u in UNITS]], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_units_run_as_the_dedicated_user_with_the_hardening_on(unit):
    lines = set((DEPLOY / unit).read_text().splitlines())
    for setting in (
        "User=rollfleet",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/rollfleet",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=",
        "RestartPreventExitStatus=2",
    ):
        assert setting in lines, (unit, setting)
    users = (DEPLOY / "rollfleet.sysusers.conf").read_text()
    assert "u rollfleet " in users


def test_the_agent_unit_leaves_gpus_reachable():
    text = (DEPLOY / "rollfleet-agent.service").read_text()
    settings = [line for line in text.splitlines() if not line.startswith("#")]
    for hides_gpus in ("PrivateDevices=yes", "DevicePolicy=closed", "MemoryDenyWriteExecute=yes"):
        assert hides_gpus not in settings


@pytest.mark.parametrize(
    "example, parser, command",
    [("coordinator.toml.example", coordinator_parser, "serve"), ("agent.toml.example", agent_parser, "join")],
)
def test_example_config_files_hold_only_valid_flags(example, parser, command):
    args, effective = parse_args_with_config(parser(), [command, "--config", str(DEPLOY / example)])
    assert effective["data-dir"].startswith("/var/lib/rollfleet/")
    assert args.log_format == "json"
