"""Hung engines (alive, never answering: SIGSTOP) on every weight path, against real sim-engine processes.

A hung engine is an engine lost: a disk update leaves it out within seconds and succeeds on the others,
an abort's clean-up does not wait on it, the health probe finds one during generation within the
agent's ``--health-timeout``; errors name the engine, the call and the deadline. One agent's pieces
without a coordinator (the ``node`` of test_agent_weights.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from agent.engine_client import EngineClient
from agent.engine_plan import plan_engines
from agent.events import MessageReceived
from agent.supervisor import EngineSupervisor
from common import protocol as p
from common.errors import EngineUnavailable
from harness.polling import wait_for_async
from tests.integration.test_agent_weights import node, versions

pytestmark = pytest.mark.timeout(90)


@contextlib.contextmanager
def frozen(pid: int):
    """The process stopped (SIGSTOP) for the block; killed after it, whatever happened (never left stopped)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)


async def test_a_disk_update_leaves_a_frozen_engine_out_and_succeeds_on_the_others(tmp_path):
    """Red if the update waits on the frozen engine (it fails, or runs into the test's timeout), or if the engine
    comes back serving anything but the fleet's version."""
    async with node(tmp_path) as n:
        victim = n.supervisor.pids()["sim-1"]
        with frozen(victim):
            n.handle(MessageReceived(p.WeightsFromDisk(1, 3, str(tmp_path))))
            report = await n.wait_report("disk")
            assert report.ok, report.error
            assert report.engines == {"sim-0": 3}
            assert n.weights.current.version == 3
            await wait_for_async(lambda: n.supervisor.pids().get("sim-1") not in (None, victim), 30, "the restart")
        await wait_for_async(lambda: n.supervisor.state("sim-1") == "healthy", 30, "the restarted engine to serve")
        assert await versions(n) == {"sim-0": "3", "sim-1": "3"}, "the restart loaded the recorded checkpoint"


async def test_an_aborts_clean_up_does_not_wait_on_a_frozen_engine(tmp_path):
    """An update aborted after a disk load whose sweep must re-load the checkpoint on an engine that froze:
    the abort reports within seconds and names nothing empty; the frozen engine goes down."""
    async with node(tmp_path) as n:
        n.handle(MessageReceived(p.WeightsFromDisk(1, 2, str(tmp_path))))
        assert (await n.wait_report("disk")).ok
        victim = n.supervisor.pids()["sim-1"]
        n.weights.engines.stale.add("sim-1")  # behind: the abort's sweep re-loads it
        with frozen(victim):
            n.handle(MessageReceived(p.WeightsAbort(9, 2, str(tmp_path))))
            report = await n.wait_report("abort")
            assert n.weights.current.version == 2
            assert all(why for why in (report.error or "x").split("; ")), report.error
            await wait_for_async(lambda: n.supervisor.pids().get("sim-1") not in (None, victim), 30, "the restart")


async def test_the_health_probe_finds_a_frozen_engine_within_its_timeout(tmp_path):
    """``--health-timeout`` is the probe's deadline: a SIGSTOPped engine goes down (and is restarted)."""
    client = EngineClient()
    changes: list[tuple[str, str]] = []
    sup = EngineSupervisor(
        plan_engines("sim", count=1),
        log_dir=tmp_path / "logs",
        client=client,
        health_interval=0.5,
        health_timeout=1.0,
        on_change=lambda name, state: changes.append((name, state)),
    )
    try:
        await sup.start()
        victim = sup.pids()["sim-0"]
        with frozen(victim):
            await wait_for_async(lambda: ("sim-0", "down") in changes, 20, "the frozen engine to go down")
        await wait_for_async(lambda: sup.state("sim-0") == "healthy", 30, "the restart")
    finally:
        await sup.stop()
        await client.close()


async def test_calls_in_flight_to_an_engine_that_went_down_end_with_engine_unavailable(tmp_path):
    """A /generate to a hung engine never answers (no reply, no reset), and a long one keeps going: once the engine
    is down, ``drop`` ends the calls in flight to it, so their groups go to another engine; a call cancelled by its
    owner stays cancelled."""
    from tests.integration.test_agent_sglang import url_engine

    async with url_engine("--token-latency-ms", "50") as url:
        client = EngineClient()
        try:
            body = ([1, 2, 3], {"max_new_tokens": 10_000, "ignore_eos": True})
            call = asyncio.ensure_future(client.generate(url, *body, "rf-a"))
            owned = asyncio.ensure_future(client.generate(url, *body, "rf-b"))
            await asyncio.sleep(0.3)
            owned.cancel()
            assert client.drop(url, "engine sim-0 is down") >= 1
            with pytest.raises(EngineUnavailable, match="engine sim-0 is down"):
                await call
            with pytest.raises(asyncio.CancelledError):
                await owned
            assert client.drop(url, "again") == 0
        finally:
            await client.close()
