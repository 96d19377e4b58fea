"""The agent against SGLang 0.5.23's contract, as the sim engine serves it by default (docs/weights.md,
"SGLang versions"): weight-update sessions opened and always closed, verification on a model without
``/get_weights_by_name``, a pause that outlives the agent's deadline, disk loads of a dummy-launched
engine, and the older servers (``--sglang-version 0.5.15``) that have no sessions.

One agent's pieces without a coordinator (the ``node`` of test_agent_weights.py); the test plays the
coordinator and, for broadcasts, the trainer's rank 0 (gloo).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import aiohttp
import pytest

from agent.engine_client import EngineClient
from agent.engine_plan import plan_engines
from agent.events import MessageReceived
from common import protocol as p
from coordinator.client_weights import verify_values
from harness.polling import wait_for_async
from tests.integration.test_agent_weights import SLOW, node, versions, wait_generating

pytestmark = pytest.mark.timeout(90)

GROUP = "weight_update_group"


async def server_info(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/server_info") as resp:
        return await resp.json()


async def sessions_open(n) -> dict[str, bool]:
    return {name: (await server_info(url))["rollfleet_weight_update_session"] for name, url in n.urls().items()}


def tensors():
    import torch

    return {
        "sim.accuracy": torch.tensor([0.5]),
        **{f"layer{i}.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) + i for i in range(3)},
    }


async def begin(n, update: int, version: int) -> p.WeightsReport:
    count = len(n.reports("begin"))
    n.handle(MessageReceived(p.WeightsBegin(update, version)))
    return await n.wait_report("begin", count + 1)


@contextlib.asynccontextmanager
async def group(n, update: int):
    """The trainer's rank 0 and every engine of the node in one gloo group (the ``init`` step)."""
    import torch.distributed as dist

    from tests.integration.test_sim_weights import free_port, trainer_group

    names = sorted(n.urls())
    port = free_port()
    offsets = {f"a1/{name}": 1 + i for i, name in enumerate(names)}
    count = len(n.reports("init"))
    n.handle(MessageReceived(p.WeightsInitGroup(update, "127.0.0.1", port, 1 + len(names), GROUP, "gloo", offsets)))
    pg = await asyncio.to_thread(trainer_group, port, 1 + len(names))
    try:
        init = await n.wait_report("init", count + 1)
        assert init.ok, init.error
        yield pg
    finally:
        dist.destroy_process_group(pg)


async def bucket(n, pg, update: int, named: dict, seq: int = 0) -> p.WeightsReport:
    from tests.integration.test_sim_weights import broadcast_all

    count = len(n.reports("bucket"))
    dtypes = [str(t.dtype).removeprefix("torch.") for t in named.values()]
    shapes = [list(t.shape) for t in named.values()]
    n.handle(MessageReceived(p.WeightsBucket(update, seq, GROUP, list(named), dtypes, shapes)))
    await asyncio.to_thread(broadcast_all, pg, list(named.values()))
    return await n.wait_report("bucket", count + 1)


async def finish(n, update: int, version: int, verify: dict | None = None) -> p.WeightsReport:
    count = len(n.reports("finish"))
    n.handle(MessageReceived(p.WeightsFinish(update, version, verify or {})))
    return await n.wait_report("finish", count + 1)


async def abort(n, update: int, version: int) -> p.WeightsReport:
    count = len(n.reports("abort"))
    n.handle(MessageReceived(p.WeightsAbort(update, version, "")))
    return await n.wait_report("abort", count + 1)


async def broadcast(n, update: int, version: int, named: dict, verify: dict | None = None) -> p.WeightsReport:
    assert (await begin(n, update, version)).ok
    async with group(n, update) as pg:
        sent = await bucket(n, pg, update, named)
        assert sent.ok, sent.error
        return await finish(n, update, version, verify)


# ------------------------------------------------------------------------------------------------ sessions


async def test_a_broadcast_runs_inside_a_session_that_its_finish_closes(tmp_path):
    pytest.importorskip("torch")
    async with node(tmp_path) as n:
        assert await sessions_open(n) == {"sim-0": False, "sim-1": False}
        assert (await begin(n, 1, 1)).ok
        assert await sessions_open(n) == {"sim-0": True, "sim-1": True}
        async with group(n, 1) as pg:
            assert (await bucket(n, pg, 1, tensors())).ok
            done = await finish(n, 1, 1, verify_values(list(tensors().items())))
        assert done.ok, done.error
        assert await sessions_open(n) == {"sim-0": False, "sim-1": False}
        assert await versions(n) == {"sim-0": "1", "sim-1": "1"}


@pytest.mark.parametrize("step", ["begin", "init", "bucket", "bucket-in-flight"])
async def test_an_update_aborted_at_any_step_leaves_no_session_open(tmp_path, step):
    """Aborted after its begin, its init, a bucket, or while a bucket waits for a broadcast that never comes:
    every engine's session is closed (or, for an engine still blocked in the receive, closed by the next
    begin), and the next update begins and completes on every engine."""
    pytest.importorskip("torch")
    async with node(tmp_path, sim_args=["--weight-sync-timeout", "3"]) as n:
        assert (await begin(n, 1, 1)).ok
        if step != "begin":
            async with group(n, 1) as pg:
                if step == "bucket":
                    assert (await bucket(n, pg, 1, tensors())).ok
                elif step == "bucket-in-flight":
                    named = tensors()
                    dtypes = [str(t.dtype).removeprefix("torch.") for t in named.values()]
                    shapes = [list(t.shape) for t in named.values()]
                    n.handle(MessageReceived(p.WeightsBucket(1, 0, GROUP, list(named), dtypes, shapes)))
                    await asyncio.sleep(0.5)  # the engines are now waiting in the receive; rank 0 never sends
                assert (await abort(n, 1, 0)).update_id == 1
        else:
            await abort(n, 1, 0)
        if step != "bucket-in-flight":
            # The end the abort sent runs to its end on the engine even if the agent stopped waiting (a loaded
            # machine): the sessions close.
            async def closed() -> bool:
                return await sessions_open(n) == {"sim-0": False, "sim-1": False}

            await wait_for_async(closed, 10, "every session closed after the abort")
        done = await broadcast(n, 2, 2, tensors())
        assert done.ok and done.engines == {"sim-0": 2, "sim-1": 2}, done.error
        assert await sessions_open(n) == {"sim-0": False, "sim-1": False}


async def test_an_older_server_without_sessions_takes_broadcasts_too(tmp_path):
    pytest.importorskip("torch")
    async with node(tmp_path, sim_args=["--sglang-version", "0.5.15"]) as n:
        done = await broadcast(n, 1, 1, tensors(), verify_values(list(tensors().items())))
        assert done.ok and done.engines == {"sim-0": 1, "sim-1": 1}, done.error
        assert n.weights.engines.sessions == {} and n.weights.broadcast.sessionless == {"sim-0", "sim-1"}


# ------------------------------------------------------------------------------------------------ verify


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
async def test_a_verified_update_passes_and_a_corrupted_last_tensor_fails_naming_engine_and_tensor(
    tmp_path, architecture
):
    """Qwen2 has no ``/get_weights_by_name`` on SGLang 0.5.23 (checksums are compared), Llama has (rows are
    read back). Only the last tensor is corrupted (``--corrupt-tensors``): a check that read only the first
    or middle tensor would pass it."""
    pytest.importorskip("torch")
    named = tensors()
    last = list(named)[-1]
    async with node(tmp_path, engines=1, sim_args=["--architecture", architecture]) as n:
        done = await broadcast(n, 1, 1, named, verify_values(list(named.items())))
        assert done.ok, done.error
        assert n.weights.verifier.read_mode == {"sim-0": "checksum" if architecture.startswith("Qwen") else "values"}
    async with node(
        tmp_path / "bad", engines=1, sim_args=["--architecture", architecture, "--corrupt-tensors", last]
    ) as n:
        done = await broadcast(n, 1, 1, named, verify_values(list(named.items())))
        assert not done.ok
        assert "engine sim-0 of agent a1" in done.error and repr(last) in done.error, done.error
        assert "differ from what the trainer sent" in done.error, done.error


# ------------------------------------------------------------------------------------------------ pause


@contextlib.asynccontextmanager
async def url_engine(*args: str):
    """A sim engine process the agent attaches to by URL (it is not restarted when it fails a check)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.sim", "--port", "0", *args], stdout=subprocess.PIPE, text=True
    )
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert "listening on" in line, line
        yield line.split("listening on ")[1].strip()
    finally:
        proc.kill()
        proc.wait()


async def test_a_pause_that_outlives_the_agents_deadline_never_leaves_the_engine_paused(tmp_path):
    """SGLang 0.5.23's abort pause re-checks once a second: with requests in flight it answers after the
    agent's confirm deadline (0.3 s here). The engine is left out of the update and, once its pause is
    over, continued: it serves again."""
    async with url_engine(*SLOW) as url:
        specs = plan_engines("url", urls=[url])
        async with node(tmp_path, specs=specs) as n:
            n.weights.broadcast.confirm_deadline = 0.3
            n.grant(1)
            await wait_generating(n)
            report = await begin(n, 1, 1)
            assert report.members == [], report

            async def ready() -> bool:
                async with aiohttp.ClientSession() as http, http.get(url + "/ready") as resp:
                    return resp.status == 200

            await wait_for_async(ready, 20, "the engine continued after its late pause")


# ------------------------------------------------------------------------------------------------ disk


async def test_an_engine_launched_with_dummy_weights_takes_a_disk_update(tmp_path):
    from tests.integration.test_sim_weights import write_safetensors

    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt"
    write_safetensors(ckpt, {"sim.accuracy": torch.tensor([1.0])})
    async with node(tmp_path, engines=1, sim_args=["--load-format", "dummy"]) as n:
        n.handle(MessageReceived(p.WeightsFromDisk(1, 1, str(ckpt))))
        report = await n.wait_report("disk")
        assert report.ok, report.error
        assert await versions(n) == {"sim-0": "1"}


async def test_a_key_protected_engine_works_with_its_key_and_fails_clearly_without(tmp_path):
    async with url_engine("--api-key", "s3cret") as url:
        with_key, without = EngineClient(api_key="s3cret"), EngineClient()
        try:
            assert "weight_version" in await with_key.model_info(url)
            with pytest.raises(Exception, match="401") as err:
                await without.model_info(url)
            assert "--engine-api-key" in str(err.value)
        finally:
            await with_key.close()
            await without.close()
