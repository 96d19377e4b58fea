"""The agent's weight updates against real sim-engine processes (docs/weights.md).

One agent's pieces, wired as agent/worker.py wires them but without a coordinator: the pure core
(``AgentSession``), the engine supervisor with sim-engine children, the weights executor and real
lease runners committing to an LMDB store. The test plays the coordinator by feeding messages to
the core and reading what it sends; for broadcasts it also plays the trainer's rank 0 (gloo).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.engine_client import EngineClient
from agent.engine_plan import plan_engines
from agent.events import (
    AssignEngine,
    CancelLease,
    Connected,
    EngineChanged,
    EnginesStarted,
    Log,
    MessageReceived,
    RunWeightsStep,
    Send,
    SetWeights,
    StartLease,
)
from agent.lease_runner import LeaseContext, LeaseRunner
from agent.session import AgentSession
from agent.store import GroupStore
from agent.supervisor import EngineSupervisor
from agent.weights import WeightsExecutor
from common import protocol as p
from common.config import RolloutConfig
from common.filters import load_filter
from common.rewards import load_reward
from common.tokenizer import BYTE_TOKENIZER_NAME, load_tokenizer
from common.types import Group
from harness.polling import wait_for_async

pytestmark = pytest.mark.timeout(90)

SLOW = ["--token-latency-ms", "10", "--output-len-dist", "fixed", "--output-len-median", "150"]
"""About 1.5 s per sample: long enough for an update to land in the middle of it."""


class Node:
    """One agent's core and shell pieces; ``sent`` collects what it says to the coordinator."""

    def __init__(self, tmp: Path, supervisor: EngineSupervisor, client: EngineClient, config: RolloutConfig):
        self.supervisor, self.client, self.config = supervisor, client, config
        self.session = AgentSession(
            agent_id="a1", incarnation=1, payload_address="tcp://a1:1", concurrency_per_engine=8
        )
        self.weights = WeightsExecutor(
            supervisor, client, self.handle, fleet=lambda: self.session.weights.current, agent_id="a1", step_deadline=30
        )
        supervisor.prepare = self.weights.prepare
        self.store = GroupStore(tmp / "store", agent_id="a1", sync=False)
        self.sent: list[p.Message] = []
        self.runners: dict[int, LeaseRunner] = {}
        self.tasks: list[asyncio.Task] = []
        self.ctx: LeaseContext | None = None

    def handle(self, event) -> None:
        for ins in self.session.handle(event, time.monotonic()):
            if isinstance(ins, Send):
                self.sent.append(ins.msg)
            elif isinstance(ins, StartLease):
                runner = self.runners[ins.lease] = LeaseRunner(ins.grant, self.ctx, self.handle)
                runner.task = asyncio.ensure_future(runner.run())
                self.tasks.append(runner.task)
            elif isinstance(ins, AssignEngine):
                self.runners[ins.lease].assign(ins)
            elif isinstance(ins, CancelLease):
                self.runners[ins.lease].task.cancel()
            elif isinstance(ins, RunWeightsStep):
                self.weights.submit(ins)
            elif isinstance(ins, SetWeights):
                self.weights.set_current(ins.record)
            elif isinstance(ins, Log):
                logging.getLogger("test").log(ins.level, "%s", ins.text)

    def reports(self, step: str) -> list[p.WeightsReport]:
        return [m for m in self.sent if isinstance(m, p.WeightsReport) and m.step == step]

    async def wait_report(self, step: str, n: int = 1) -> p.WeightsReport:
        await wait_for_async(lambda: len(self.reports(step)) >= n, 30, f"a {step} report")
        return self.reports(step)[n - 1]

    async def group(self, lease: int) -> Group:
        await wait_for_async(
            lambda: any(isinstance(m, p.Receipt) and m.lease == lease for m in self.sent),
            30,
            f"lease {lease}'s receipt",
        )
        receipt = next(m for m in self.sent if isinstance(m, p.Receipt) and m.lease == lease)
        [raw] = await self.store.get_many([receipt.key])
        return Group.from_wire(raw)

    def grant(self, lease: int) -> None:
        self.handle(
            MessageReceived(
                p.Grant(
                    self.session.session,
                    [p.LeaseGrant(lease, 0, lease, 0, prompt="What is 2 + 3?", label="5")],
                )
            )
        )

    def urls(self) -> dict[str, str]:
        return self.supervisor.urls()


@contextlib.asynccontextmanager
async def node(tmp_path, *, engines=2, sim_args=(), specs=None, partial=True, n_samples=2):
    client = EngineClient()
    specs = specs or plan_engines("sim", count=engines, sim_args=list(sim_args))
    holder: list[Node] = []

    def on_change(name: str, state: str) -> None:
        if holder:
            url = sup.urls("healthy").get(name)
            holder[0].handle(EngineChanged(name, state, url, sup.all_retired()))

    sup = EngineSupervisor(specs, log_dir=tmp_path / "logs", client=client, health_interval=0.5, on_change=on_change)
    config = RolloutConfig(
        n_samples_per_prompt=n_samples,
        rollout_batch_size=1,
        max_new_tokens=400,
        dynamic_filter="none",
        partial_rollout=partial,
    )
    n = Node(tmp_path, sup, client, config)
    holder.append(n)
    n.ctx = LeaseContext(
        config,
        load_reward(config.reward),
        load_filter(config.dynamic_filter),
        load_tokenizer(BYTE_TOKENIZER_NAME),
        None,
        client,
        n.store,
        "a1",
    )
    executor = None
    try:
        await sup.start()
        n.handle(EnginesStarted(tuple(sup.urls("healthy").items())))
        n.handle(Connected())
        n.handle(MessageReceived(p.Welcome(7, config.to_dict(), 1.0, 30.0, [], [])))
        executor = asyncio.ensure_future(n.weights.run())
        yield n
    finally:
        for task in [*n.tasks, executor]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [*n.tasks, executor] if t is not None), return_exceptions=True)
        await sup.stop()
        await client.close()
        await n.store.drain()
        n.store.close()


async def versions(n: Node) -> dict[str, str]:
    return {name: (await n.client.model_info(url))["weight_version"] for name, url in n.urls().items()}


async def wait_generating(n: Node, tokens: int = 20) -> None:
    """Until some engine's running requests generated ``tokens`` tokens (a sample is in flight, past its start)."""
    first: dict[str, int] = {}

    async def running() -> bool:
        async with aiohttp.ClientSession() as http:
            for name, url in n.urls().items():
                async with http.get(url + "/v1/loads") as resp:
                    load = (await resp.json())["loads"][0]
                if load["num_running_reqs"] > 0:
                    first.setdefault(name, load["num_used_tokens"])
                    if load["num_used_tokens"] >= first[name] + tokens:
                        return True
        return False

    await wait_for_async(running, 20, "a sample in flight")


# ---------------------------------------------------------------------------- disk


async def test_a_disk_update_changes_every_engines_version(tmp_path):
    async with node(tmp_path) as n:
        assert set((await versions(n)).values()) == {"default"}
        n.handle(MessageReceived(p.WeightsFromDisk(1, 3, str(tmp_path))))
        report = await n.wait_report("disk")
        assert report.ok, report.error
        assert report.engines == {"sim-0": 3, "sim-1": 3} and report.session == 7
        assert await versions(n) == {"sim-0": "3", "sim-1": "3"}
        assert n.weights.current.version == 3 and n.session.weights.current.path == str(tmp_path)
        assert not n.session.weights.updating
        assert [e.version for e in n.session.engines()] == [3, 3]


@pytest.mark.parametrize("partial", [True, False])
async def test_a_sample_in_flight_is_continued_or_regenerated(tmp_path, partial):
    async with node(tmp_path, engines=1, sim_args=SLOW, partial=partial) as n:
        n.grant(1)
        await wait_generating(n)
        n.handle(MessageReceived(p.WeightsFromDisk(1, 1, str(tmp_path))))
        assert (await n.wait_report("disk")).ok
        group = await n.group(1)
        for sample in group.samples:
            spans = sample.weight_versions
            assert sample.weight_version == "1" and sample.status != "aborted"
            assert spans[-1][2] == len(sample.response_tokens) == len(sample.response_logprobs)
            if partial:
                assert [v for v, _, _ in spans] == ["default", "1"], spans
                assert 0 < spans[0][2] == spans[1][1] < spans[1][2]
            else:
                assert spans == [["1", 0, len(sample.response_tokens)]]


async def test_an_abort_after_a_disk_update_reloads_the_last_checkpoint(tmp_path):
    async with node(tmp_path) as n:
        n.handle(MessageReceived(p.WeightsFromDisk(1, 2, str(tmp_path))))
        assert (await n.wait_report("disk")).ok
        n.handle(MessageReceived(p.WeightsFromDisk(2, 3, str(tmp_path))))
        assert (await n.wait_report("disk", 2)).ok
        # Another agent failed: the coordinator aborts, the fleet stays on version 2.
        n.handle(MessageReceived(p.WeightsAbort(2, 2, str(tmp_path))))
        report = await n.wait_report("abort")
        assert report.ok, report.error
        assert await versions(n) == {"sim-0": "2", "sim-1": "2"}
        assert sorted(n.supervisor.urls("healthy")) == ["sim-0", "sim-1"]


async def test_an_engine_sigkilled_as_a_disk_update_starts_is_left_out_and_catches_up(tmp_path):
    async with node(tmp_path) as n:
        os.kill(n.supervisor.pids()["sim-1"], signal.SIGKILL)
        n.handle(MessageReceived(p.WeightsFromDisk(1, 3, str(tmp_path))))
        report = await n.wait_report("disk")
        # A disk load is whole per engine: the death fails nothing, the survivor holds the version.
        assert report.ok, report.error
        assert report.engines == {"sim-0": 3}
        assert n.weights.current.version == 3
        await wait_for_async(lambda: n.supervisor.state("sim-1") == "healthy", 30, "the restart")
        assert await versions(n) == {"sim-0": "3", "sim-1": "3"}, "the restart loaded the recorded checkpoint"


# ---------------------------------------------------------------------------- version mismatch


@contextlib.asynccontextmanager
async def old_build_engine():
    """An SGLang build from before weight versions (reference section 9): updates succeed, no label."""

    async def ok(request):
        return web.json_response({"success": True, "message": "ok", "status": "ok"})

    async def info(request):
        return web.json_response({"model_path": "m", "tokenizer_path": "m", "is_generation": True})

    async def healthy(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health_generate", healthy)
    app.router.add_get("/health", healthy)
    app.router.add_get("/model_info", info)
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
        app.router.add_post(path, ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_an_engine_that_does_not_report_the_new_version_fails_the_step_naming_it(tmp_path):
    async with old_build_engine() as url:
        specs = plan_engines("sim", count=1) + plan_engines("url", urls=[url])
        async with node(tmp_path, specs=specs) as n:
            n.handle(MessageReceived(p.WeightsFromDisk(1, 4, str(tmp_path))))
            report = await n.wait_report("disk")
            assert not report.ok
            assert "engine url-0 of agent a1" in report.error and "expected '4'" in report.error
            assert "sim-0" not in report.error
            assert report.engines == {"sim-0": 4}, "the failed engine left the pool"
            assert n.supervisor.state("url-0") == "stale"


# ---------------------------------------------------------------------------- restarts


async def test_a_restarted_engine_reloads_the_current_disk_version_before_it_serves(tmp_path):
    async with node(tmp_path, engines=1) as n:
        n.handle(MessageReceived(p.WeightsFromDisk(1, 5, str(tmp_path))))
        assert (await n.wait_report("disk")).ok
        [url] = n.urls().values()
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/rollfleet/crash", json={}):
                pass
        await wait_for_async(lambda: n.supervisor.state("sim-0") == "down", 20, "the crash seen")
        await wait_for_async(lambda: n.supervisor.state("sim-0") == "healthy", 30, "the restart")
        assert await versions(n) == {"sim-0": "5"}


async def test_a_welcome_after_a_broadcast_keeps_engines_behind_out_of_the_pool(tmp_path):
    async with node(tmp_path, engines=1) as n:
        weights = p.FleetWeights(6, "distributed", "")
        n.handle(Connected())
        n.handle(MessageReceived(p.Welcome(8, n.config.to_dict(), 1.0, 30.0, [], [], weights=weights)))
        await wait_for_async(lambda: n.supervisor.state("sim-0") == "stale", 20, "the engine marked stale")
        assert n.session.capacity() == 0
        assert [e.state for e in n.session.engines()] == ["stale"]


# ---------------------------------------------------------------------------- broadcast


async def test_a_broadcast_update_with_a_gloo_rank_0_in_this_process(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.integration.test_sim_weights import GROUP, broadcast_all, free_port, trainer_group

    async with node(tmp_path) as n:
        n.handle(MessageReceived(p.WeightsBegin(1, 2)))
        assert (await n.wait_report("begin")).ok
        port = free_port()
        n.handle(
            MessageReceived(p.WeightsInitGroup(1, "127.0.0.1", port, 3, GROUP, "gloo", {"a1/sim-0": 1, "a1/sim-1": 2}))
        )
        pg = await asyncio.to_thread(trainer_group, port, 3)
        try:
            assert (await n.wait_report("init")).ok
            named = {"sim.accuracy": torch.tensor([1.0]), "layer.w": torch.arange(6, dtype=torch.float32)}
            n.handle(MessageReceived(p.WeightsBucket(1, 0, GROUP, list(named), ["float32", "float32"], [[1], [6]])))
            await asyncio.to_thread(broadcast_all, pg, list(named.values()))
            bucket = await n.wait_report("bucket")
            assert bucket.ok and bucket.seq == 0, bucket.error
            n.handle(MessageReceived(p.WeightsFinish(1, 2)))
            finish = await n.wait_report("finish")
            assert finish.ok and finish.engines == {"sim-0": 2, "sim-1": 2}, finish.error
            assert await versions(n) == {"sim-0": "2", "sim-1": "2"}
            assert n.session.weights.current.kind == "distributed" and not n.session.weights.updating
        finally:
            import torch.distributed as dist

            dist.destroy_process_group(pg)
