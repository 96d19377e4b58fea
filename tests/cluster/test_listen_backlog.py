"""A fleet that reconnects at once (after a coordinator restart) is queued by the kernel, not dropped.

libzmq listens with a backlog of 100 unless told otherwise. Measured with 10,000 simulated agents
dialling one coordinator at once on loopback: with 100, 6,559 registered and the rest stalled in SYN
retries (6,572 after 32 s); with 4,096, all but 8 (those never resend a Register) within 15 s. The
queue's length is the kernel's to show: ``ss`` lists it as a listening socket's Send-Q.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from common.transport import LISTEN_BACKLOG


def _listen_queue(port: int) -> int:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    lines = [line.split() for line in out.splitlines() if line.strip()]
    assert lines, f"nothing listens on port {port}"
    return int(lines[0][2])  # State Recv-Q Send-Q ...: for a listener Send-Q is its backlog


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listener's backlog")
@pytest.mark.parametrize("gateways", ["0", "1"])
def test_the_coordinator_listens_with_room_for_a_whole_fleet_dialling_at_once(make_cluster, gateways):
    cluster = make_cluster()
    cluster.start_coordinator("--gateways", gateways)
    assert _listen_queue(cluster.port) == min(LISTEN_BACKLOG, _somaxconn())
