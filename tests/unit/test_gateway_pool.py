"""``coordinator serve --gateways``: how many gateways ``auto`` starts, the socket they share, their supervisor."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq

from common.errors import ConfigError
from coordinator.gateways import HUNG_AFTER, GatewayPool, auto_gateways, listen, usable_cores


@pytest.mark.parametrize(("cores", "gateways"), [(1, 0), (2, 0), (7, 0), (8, 1), (16, 2), (31, 3), (64, 4), (512, 4)])
def test_auto_is_one_gateway_per_8_cores_none_below_8_at_most_4(cores, gateways):
    assert auto_gateways(cores) == gateways


def test_a_cgroup_quota_caps_the_cores_counted(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    limited = tmp_path / "cpu.max"
    limited.write_text("200000 100000\n")  # two CPUs' worth of time
    assert usable_cores(str(limited)) == min(2, affinity)
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max 100000\n")
    assert usable_cores(str(unlimited)) == affinity
    assert usable_cores(str(tmp_path / "absent")) == affinity  # no cgroup v2 file: the affinity alone
    garbled = tmp_path / "garbled"
    garbled.write_text("nonsense\n")
    assert usable_cores(str(garbled)) == affinity


@pytest.mark.parametrize(
    ("bind", "message"),
    [("ipc:///tmp/x.sock", "needs a tcp:// --bind"), ("tcp://127.0.0.1:*", "numeric port")],
)
def test_gateways_refuse_a_bind_they_cannot_share(bind, message):
    with pytest.raises(ConfigError, match=message):
        listen(bind)


def test_the_shared_socket_is_non_blocking_and_port_0_resolves():
    sock, zmq_bind, endpoint = listen("tcp://127.0.0.1:0")
    try:
        port = sock.getsockname()[1]
        assert port > 0 and sock.getblocking() is False  # a gateway losing an accept() race must not block
        assert zmq_bind == endpoint == f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()


def test_a_gateway_waiting_for_its_restart_is_not_judged_hung():
    """Between an exit and the restart its backoff delays, a slot has no process: the supervisor must skip it,
    however long the gateway was silent before, and keep running (its failure would stop the coordinator)."""
    ctx = zmq.Context()
    pool = GatewayPool(ctx, 1, "tcp://127.0.0.1:0", max_bytes=1 << 20)
    try:
        slot = pool.slots[0]
        slot.proc, slot.started, slot.seen = None, time.monotonic() - 10 * HUNG_AFTER, time.monotonic() - 5 * HUNG_AFTER

        async def supervise_a_while():
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.supervise(), 0.6)

        asyncio.run(supervise_a_while())
        assert slot.proc is None and slot.restarts == 0
    finally:
        pool.stop()
        ctx.term()
