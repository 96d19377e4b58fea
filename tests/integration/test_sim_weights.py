"""Weight updates of the sim engine, seen as a trainer and an agent see them.

A trainer's rank 0 runs in this process (its blocking torch calls in threads) and forms real gloo
groups with in-process sim engines over loopback, the way slime forms them with SGLang
(``init_custom_process_group``: store keys prefixed by the group name). Also: checkpoints on
disk, the digest both sides compute, the accuracy the weights set, timeouts, and the SGLang
0.5.23 details of the control endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from agent.sim import add_arguments
from agent.sim.config import engine_config
from common.weights_digest import EMPTY_DIGEST, weights_digest
from harness.polling import wait_for_async
from harness.sim_server import serve

ROOT = Path(__file__).resolve().parents[2]
GROUP = "weight_update_group"
QUESTION = {"text": "Question: what is 12 + 30?", "sampling_params": {"max_new_tokens": 200, "n": 4}}
ARITHMETIC = {"output_len_dist": "fixed", "output_len_median": 80}  # every answer ends before max_new_tokens

pytestmark = pytest.mark.timeout(60)


async def post(session, path, body, status=None):
    async with session.post(path, json=body) as resp:
        out = await resp.json()
        assert status is None or resp.status == status, (resp.status, out)
        return resp.status, out


async def model_info(session):
    async with session.get("/model_info") as resp:
        return await resp.json()


async def answers(session) -> list[str]:
    _, outs = await post(session, "/generate", QUESTION, 200)
    return [o["text"].rsplit("The answer is ", 1)[-1] for o in outs]


async def wait_running(session, running, waiting=0):
    async def ok():
        async with session.get("/v1/loads") as resp:
            load = (await resp.json())["loads"][0]
        return load["num_running_reqs"] == running and load["num_waiting_reqs"] == waiting

    await wait_for_async(ok, 10, f"{running} running and {waiting} waiting requests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the trainer's side


def trainer_group(port: int, world_size: int, timeout_s: float = 30.0):
    """Rank 0's group, formed as a trainer forms it with SGLang (common.weight_group). Blocking."""
    from common.weight_group import join_as_trainer

    return join_as_trainer("127.0.0.1", port, world_size, backend="gloo", group_name=GROUP, timeout_s=timeout_s)


def broadcast_all(pg, tensors) -> None:
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=pg)


def bucket_body(named: dict, **extra) -> dict:
    return {
        "names": list(named),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()],
        "group_name": GROUP,
        "flush_cache": False,
        **extra,
    }


async def session_call(sessions, path: str) -> None:
    """``/begin_weight_update`` or ``/end_weight_update`` on every engine (a 404: an engine imitating SGLang
    0.5.15, which has no sessions)."""
    body = {"selector": "all"} if path == "/begin_weight_update" else {}
    for s in sessions:
        async with s.post(path, json=body) as r:
            assert r.status in (200, 404), (path, r.status, await r.text())


@contextlib.asynccontextmanager
async def weight_session(sessions):
    """A weight-update session open on every engine (SGLang 0.5.23 broadcasts only inside one)."""
    await session_call(sessions, "/begin_weight_update")
    try:
        yield
    finally:
        await session_call(sessions, "/end_weight_update")


@contextlib.asynccontextmanager
async def formed_group(sessions, tp_sizes=None, timeout_s: float = 30.0):
    """The trainer (rank 0) and every rank of the engines, joined concurrently, with a weight-update session
    open on every engine; the session closed and the trainer's group destroyed after.

    Ranks as slime lays them out: engine i gets ``rank_offset = 1 + tp sizes of engines before it``.
    """
    import torch.distributed as dist

    tp_sizes = tp_sizes or [1] * len(sessions)
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(sessions))]
    port = free_port()
    world_size = 1 + sum(tp_sizes)
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": world_size, "group_name": GROUP,
            "backend": "gloo"}  # fmt: skip
    pg, *replies = await asyncio.gather(
        asyncio.to_thread(trainer_group, port, world_size, timeout_s),
        *(
            post(s, "/init_weights_update_group", {**init, "rank_offset": offset})
            for s, offset in zip(sessions, offsets, strict=True)
        ),
    )
    try:
        for status, body in replies:
            assert (status, body) == (
                200,
                {"success": True, "message": "Succeeded to initialize custom process group."},
            )
        async with weight_session(sessions):
            yield pg
    finally:
        dist.destroy_process_group(pg)


async def send_bucket(pg, sessions, named: dict, **extra) -> list:
    """One bucket: the engines' POSTs pending while rank 0 broadcasts, as SGLang requires."""
    posts = [asyncio.ensure_future(post(s, "/update_weights_from_distributed", bucket_body(named, **extra)))
             for s in sessions]  # fmt: skip
    try:
        await asyncio.to_thread(broadcast_all, pg, list(named.values()))
    finally:
        replies = await asyncio.gather(*posts)
    return replies


# --------------------------------------------------------------------------- broadcast


async def test_broadcast_in_buckets_reaches_two_engines_and_sets_accuracy():
    torch = pytest.importorskip("torch")
    config = {**ARITHMETIC, "accuracy": 0.0, "weight_version": "0"}
    async with serve(**config) as (e1, s1), serve(**config) as (e2, s2):
        assert "\\boxed{42}." not in await answers(s1)  # accuracy 0: every answer is off
        buckets = [
            {"model.embed.weight": torch.randn(4, 3).to(torch.bfloat16), "model.norm.bias": torch.randn(5)},
            {"sim.accuracy": torch.tensor([1.0]), "model.head.index": torch.arange(6, dtype=torch.int64)},
        ]
        sent = {name: t for bucket in buckets for name, t in bucket.items()}
        async with formed_group([s1, s2]) as pg:
            for i, bucket in enumerate(buckets):
                extra = {"weight_version": "7"} if i == len(buckets) - 1 else {}
                for status, body in await send_bucket(pg, [s1, s2], bucket, **extra):
                    assert (status, body["success"]) == (200, True), body
                    said = " Weight version updated to 7." if extra else ""  # SGLang's suffix
                    assert body["message"] == "Succeeded to update parameter online." + said
            for s, engine in ((s1, e1), (s2, e2)):
                info = await model_info(s)
                assert info["weight_version"] == "7"
                assert info["weight_digest"] == weights_digest(sent.items()) != EMPTY_DIGEST
                assert all(torch.equal(engine.weights.tensors[n], t) for n, t in sent.items())
                assert set(await answers(s)) == {"\\boxed{42}."}  # sim.accuracy 1.0: every answer right
            async with s1.get("/server_info") as r:
                si = await r.json()
            assert si["weight_digest"] == weights_digest(sent.items()) and si["sim"]["accuracy"] == 1.0
            assert si["sim"]["weight_groups"] == [GROUP]

            # A later bucket overwrites what it names and keeps the rest.
            update = {"sim.accuracy": torch.tensor([0.0])}
            for status, body in await send_bucket(pg, [s1, s2], update, weight_version="8"):
                assert status == 200, body
            sent.update(update)
            assert (await model_info(s2))["weight_digest"] == weights_digest(sent.items())
            assert "\\boxed{42}." not in await answers(s2)

            for s in (s1, s2):
                await post(s, "/destroy_weights_update_group", {"group_name": GROUP}, 200)
                status, body = await post(s, "/destroy_weights_update_group", {"group_name": GROUP})
                assert (status, body) == (
                    400,
                    {"success": False, "message": "The group to be destroyed does not exist."},
                )
                async with s.get("/server_info") as r:
                    assert (await r.json())["sim"]["weight_groups"] == []


async def test_a_tensor_parallel_engine_joins_with_every_rank_and_updates_wait_for_requests():
    torch = pytest.importorskip("torch")
    timed = {"token_latency_ms": 5, "output_len_dist": "fixed", "output_len_median": 2000, "weight_version": "0"}
    async with serve(tp_size=2, **timed) as (e1, s1), serve(**timed) as (e2, s2):
        async with formed_group([s1, s2], tp_sizes=[2, 1]) as pg:  # world_size 4: ranks 1-2 and 3
            body = {"text": "a", "sampling_params": {"max_new_tokens": 60}}
            first = asyncio.ensure_future(post(s1, "/generate", body, 200))
            await wait_running(s1, 1)
            named = {"w": torch.arange(3.0)}
            replies = await send_bucket(pg, [s1, s2], named, weight_version="1")
            assert first.done()  # not paused: the update waited for the request in flight
            assert [status for status, _ in replies] == [200, 200], replies
            _, out = first.result()
            assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 60}]
            for s in (s1, s2):
                info = await model_info(s)
                assert (info["weight_version"], info["weight_digest"]) == ("1", weights_digest(named.items()))


async def test_a_new_group_after_destroy_and_a_broadcast_that_never_comes():
    torch = pytest.importorskip("torch")
    async with serve(weight_sync_timeout=1.0, weight_version="3") as (engine, s):
        for _ in range(2):  # the same group name forms again once destroyed, on both sides
            async with formed_group([s]) as pg:
                status, body = await post(s, "/init_weights_update_group", {
                    "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                    "group_name": GROUP, "backend": "gloo"})  # fmt: skip
                assert status == 400 and "already been created" in body["message"]
                assert pg is not None
                # Rank 0 never broadcasts: the call fails once --weight-sync-timeout has passed.
                t0 = time.monotonic()
                status, body = await post(s, "/update_weights_from_distributed",
                                          bucket_body({"w": torch.zeros(3)}, weight_version="4"))  # fmt: skip
                elapsed = time.monotonic() - t0
                assert status == 400 and body["success"] is False, body
                assert "Failed to update parameter online" in body["message"]
                assert 0.9 <= elapsed < 10, elapsed
                info = await model_info(s)
                assert (info["weight_version"], info["weight_digest"]) == ("3", EMPTY_DIGEST)
                await post(s, "/destroy_weights_update_group", {"group_name": GROUP}, 200)


async def test_init_fails_within_the_timeout_when_the_trainer_never_joins():
    pytest.importorskip("torch")
    async with serve(weight_sync_timeout=1.0) as (engine, s):
        body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "gloo"}  # fmt: skip
        t0 = time.monotonic()
        status, out = await post(s, "/init_weights_update_group", body)
        assert status == 400 and out["message"].startswith("Failed to initialize custom process group"), out
        assert time.monotonic() - t0 < 10  # the rendezvous retries once within its timeout
        status, out = await post(s, "/destroy_weights_update_group", {"group_name": GROUP})
        assert status == 400  # nothing was formed


async def test_bad_group_and_bucket_requests_are_400_before_any_collective():
    torch = pytest.importorskip("torch")
    async with serve() as (engine, s):
        base = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        for body, words in (
            ({**base, "backend": "nccl"}, "gloo"),  # SGLang's default backend; the sim has no GPU
            ({**base, "rank_offset": 2, "backend": "gloo"}, "world_size"),
            ({**base, "rank_offset": 0, "backend": "gloo"}, "world_size"),
            ({"master_address": "127.0.0.1", "backend": "gloo"}, "Field required: master_port"),
        ):
            status, out = await post(s, "/init_weights_update_group", body)
            assert status == 400 and out["success"] is False and words in out["message"], (body, out)
        async with weight_session([s]):
            status, out = await post(s, "/update_weights_from_distributed", bucket_body({"w": torch.zeros(2)}))
        assert status == 400 and "init_weights_update_group" in out["message"]  # no such group
        async with formed_group([s]) as pg:
            ok = bucket_body({"w": torch.zeros(2)})
            for body, words in (
                ({**ok, "dtypes": ["float99"]}, "'w': unknown dtype 'float99'"),
                ({**ok, "dtypes": ["torch.float32"]}, "'w': unknown dtype"),
                ({**ok, "shapes": [[2, -1]]}, "'w': shape"),
                ({**ok, "names": ["w", "v"]}, "differ in length"),
                ({**ok, "load_format": "flattened_bucket"}, "load_format"),
                (bucket_body({"sim.accuracy": torch.zeros(2)}), "sim.accuracy must hold one number"),
                ({**ok, "names": None}, "Field required: names"),
            ):
                status, out = await post(s, "/update_weights_from_distributed", body)
                assert status == 400 and words in out["message"], (body, out)
            assert (await model_info(s))["weight_digest"] == EMPTY_DIGEST
            # Nothing was broadcast for the refused requests, so the group is still in step.
            named = {"w": torch.ones(2)}
            [(status, out)] = await send_bucket(pg, [s], named)
            assert status == 200, out
            assert (await model_info(s))["weight_digest"] == weights_digest(named.items())
            # A value out of range is refused after the broadcast, and nothing of the bucket is kept.
            [(status, out)] = await send_bucket(pg, [s], {"sim.accuracy": torch.tensor([1.5]), "v": torch.ones(1)})
            assert status == 400 and "sim.accuracy must be in [0, 1]" in out["message"], out
            assert (await model_info(s))["weight_digest"] == weights_digest(named.items())


# --------------------------------------------------------------------------- disk


def write_safetensors(directory: Path, named: dict) -> None:
    from safetensors import TensorSpec, serialize_file

    specs = {
        name: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), data_ptr=t.data_ptr(), data_len=t.nbytes
        )  # fmt: skip
        for name, t in named.items()
    }
    directory.mkdir()
    serialize_file(specs, str(directory / "model.safetensors"))


async def test_disk_checkpoints_replace_the_weights_and_set_accuracy(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    async with serve(**ARITHMETIC, accuracy=0.0) as (engine, s):
        first = {"sim.accuracy": torch.tensor([1.0]), "model.w": torch.randn(3, 2).to(torch.bfloat16)}
        write_safetensors(tmp_path / "step1", first)
        await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "step1"), "weight_version": "1"}, 200)
        info = await model_info(s)
        assert (info["weight_version"], info["weight_digest"]) == ("1", weights_digest(first.items()))
        assert info["model_path"] == str(tmp_path / "step1")
        assert set(await answers(s)) == {"\\boxed{42}."}

        # No weights file: only the label and model_path change.
        (tmp_path / "labels-only").mkdir()
        await post(
            s, "/update_weights_from_disk", {"model_path": str(tmp_path / "labels-only"), "weight_version": "2"}, 200
        )
        info = await model_info(s)
        assert (info["weight_version"], info["weight_digest"]) == ("2", weights_digest(first.items()))

        # weights.pt (torch.save of a dict) replaces the whole set; without sim.accuracy, --accuracy is back.
        second = {"model.v": torch.arange(4, dtype=torch.int32)}
        (tmp_path / "step3").mkdir()
        torch.save(second, tmp_path / "step3" / "weights.pt")
        await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "step3"), "weight_version": "3"}, 200)
        info = await model_info(s)
        assert (info["weight_version"], info["weight_digest"]) == ("3", weights_digest(second.items()))
        assert "\\boxed{42}." not in await answers(s)

        # A bad checkpoint changes nothing, the label included.
        write_safetensors(tmp_path / "bad", {"sim.accuracy": torch.tensor([2.0])})
        status, out = await post(
            s, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad"), "weight_version": "4"}
        )
        assert status == 400 and "sim.accuracy must be in [0, 1]" in out["message"], out
        (tmp_path / "corrupt").mkdir()
        (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a checkpoint")
        status, out = await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "corrupt")})
        assert status == 400 and "cannot read" in out["message"], out
        info = await model_info(s)
        assert (info["weight_version"], info["weight_digest"]) == ("3", weights_digest(second.items()))
        assert info["model_path"] == str(tmp_path / "step3")


# --------------------------------------------------------------------------- SGLang 0.5.23 details


async def test_disk_update_in_an_in_place_pause_with_running_requests_is_400_but_applied(tmp_path):
    torch = pytest.importorskip("torch")
    async with serve(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        running = asyncio.ensure_future(
            post(s, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1000}})
        )
        await wait_running(s, 1)
        await post(s, "/pause_generation", {"mode": "in_place"}, 200)
        named = {"model.w": torch.ones(2)}
        (tmp_path / "ckpt").mkdir()
        torch.save(named, tmp_path / "ckpt" / "weights.pt")
        status, out = await post(
            s, "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt"), "weight_version": "5"}
        )
        assert status == 400 and out["success"] is False
        assert out["message"].startswith("Weights were updated, but the cache was not flushed")
        info = await model_info(s)
        assert (info["weight_version"], info["weight_digest"]) == ("5", weights_digest(named.items()))
        # flush_cache false is the documented way round it.
        await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt"), "flush_cache": False}, 200)
        await post(s, "/continue_generation", {}, 200)
        status, out = await running
        assert status == 200 and out["meta_info"]["weight_version"] == "5"


async def test_flush_cache_while_paused_ignores_waiting_requests():
    async with serve(slots=1, token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        body = {"text": "a", "sampling_params": {"max_new_tokens": 1000}}
        calls = [asyncio.ensure_future(post(s, "/generate", body)) for _ in range(2)]
        await wait_running(s, 1, 1)
        async with s.get("/flush_cache") as r:
            assert r.status == 400  # not paused: the running and the waiting request count
        await post(s, "/pause_generation", {"mode": "in_place"}, 200)
        async with s.get("/flush_cache") as r:
            assert r.status == 400  # in_place keeps a running request
        await post(s, "/continue_generation", {}, 200)
        await post(s, "/pause_generation", {"mode": "retract"}, 200)
        async with s.get("/flush_cache") as r:
            assert r.status == 200, await r.text()  # retracted requests wait, and waiting ones do not count
        await post(s, "/pause_generation", {"mode": "abort"}, 200)
        await post(s, "/continue_generation", {}, 200)
        for status, out in await asyncio.gather(*calls):
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_control_endpoints_need_a_json_object_body():
    async with serve() as (engine, s):
        for path in ("/pause_generation", "/continue_generation", "/abort_request", "/update_weights_from_disk",
                     "/update_weight_version", "/init_weights_update_group", "/update_weights_from_distributed",
                     "/destroy_weights_update_group"):  # fmt: skip
            for raw in (b"", b"null"):
                async with s.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    out = await r.json()
                    assert r.status == 400 and "Field required" in out["message"], (path, raw, out)
        await post(s, "/pause_generation", {}, 200)  # {} takes the defaults
        await post(s, "/continue_generation", {}, 200)


async def test_generate_schema_errors_are_strings_and_0523_sampling_keys_are_accepted():
    async with serve() as (engine, s):
        status, out = await post(s, "/generate", {"text": "a", "sampling_params": {"bogus": 1}})
        assert status == 400 and isinstance(out["error"], str) and "bogus" in out["error"]
        status, out = await post(s, "/generate", {"text": "a", "sampling_params": {"beam_width": "wide"}})
        assert status == 400 and isinstance(out["error"], str) and "beam_width" in out["error"]
        params = {"max_new_tokens": 3, "structural_tag": "{}", "beam_width": 1, "watermark": None, "choice": None}
        await post(s, "/generate", {"text": "a", "sampling_params": params}, 200)


async def test_zero_token_finish_names_its_version_and_the_launch_label():
    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    cfg = engine_config(parser.parse_args(["--port", "0", "--weight-version", "w5", "--weight-sync-timeout", "5"]), {})
    assert (cfg["weight_version"], cfg["weight_sync_timeout"]) == ("w5", 5.0)
    async with serve(weight_version="w5") as (engine, s):
        _, out = await post(s, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}, 200)
        assert out["meta_info"]["completion_tokens"] == 0
        assert out["meta_info"]["weight_versions"] == [{"version": "w5", "start": 0, "end": 0}]
        _, out = await post(s, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}, 200)
        assert out["meta_info"]["weight_versions"] == [{"version": "w5", "start": 0, "end": 2}]


# --------------------------------------------------------------------------- without torch


async def test_without_torch_the_weight_calls_are_400_and_the_rest_works(tmp_path):
    """An engine process that cannot import torch: label-only disk updates and generation still work."""
    code = "import sys; sys.modules['torch'] = None; from agent.sim import main; main(['--port', '0'])"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.startswith("rollfleet-sim listening on "), (line, proc.stderr.read() if proc.poll() else "")
        async with aiohttp.ClientSession(line.split(" on ", 1)[1].strip()) as s:
            body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                    "group_name": GROUP, "backend": "gloo"}  # fmt: skip
            status, out = await post(s, "/init_weights_update_group", body)
            assert status == 400 and "torch is not installed" in out["message"], out
            (tmp_path / "ckpt").mkdir()
            (tmp_path / "ckpt" / "weights.pt").write_bytes(b"unreadable without torch")
            status, out = await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt")})
            assert status == 400 and "torch is not installed" in out["message"], out
            await post(s, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "9"}, 200)
            _, out = await post(s, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}, 200)
            assert out["meta_info"]["weight_version"] == "9"
            assert (await model_info(s))["weight_digest"] == EMPTY_DIGEST
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()
