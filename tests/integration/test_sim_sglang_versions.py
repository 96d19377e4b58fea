"""The sim engine imitating SGLang 0.5.23 (the default) and 0.5.15 (``--sglang-version``), over real HTTP.

One test per behaviour of agent/sim/versions.py, each for 0.5.23 and, where the releases differ, for
0.5.15 too: weight-update sessions, ``/weights_checker``, ``/get_weights_by_name`` by model class,
the abort-mode pause and continue (a client that gives up), ``abort_sent``, API keys, ``--load-format
dummy``, the 5 s keep-alive, ``/tokenize`` with a built-in chat template, ``--corrupt-tensors``.
"""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import pytest
from aiohttp import web

from agent.sim import SimEngine, make_app
from agent.sim.http import RUNNER_OPTIONS
from common.errors import ConfigError
from common.weight_rows import tensor_checksum
from harness.polling import wait_for_async
from harness.sim_server import serve
from tests.integration.test_sim_weights import broadcast_all, bucket_body, formed_group, post, send_bucket

pytestmark = pytest.mark.timeout(60)

NOT_FOUND = {"detail": "Not Found"}
UNAUTHORIZED = {"error": "Unauthorized"}
GET_FAILED = {"error": {"message": "Get parameter by name failed"}}
SLOW = {"token_latency_ms": 2, "output_len_dist": "fixed", "output_len_median": 2000}


async def get(session, path, status=None, **kw):
    async with session.get(path, **kw) as resp:
        body = await resp.json(content_type=None)
        assert status is None or resp.status == status, (path, resp.status, body)
        return resp.status, body


async def abort(session, **body) -> None:
    async with session.post("/abort_request", json=body) as resp:
        assert resp.status == 200 and await resp.read() == b""  # SGLang's answer, whatever happened


async def server_info(session) -> dict:
    return (await get(session, "/server_info", 200))[1]


def save_weights(directory, named) -> str:
    import torch

    directory.mkdir()
    torch.save(named, directory / "weights.pt")
    return str(directory)


async def wait_live(session, rid):
    """Until the engine holds ``rid`` (at the pause gate, queued or running): a reuse of it is a duplicate."""

    async def live():
        probe = {"text": "probe", "rid": rid, "sampling_params": {"max_new_tokens": 10**9}}
        _, err = await post(session, "/generate", probe, 400)
        return "Duplicate request ID detected" in err["error"]["message"]

    await wait_for_async(live, 10, f"request {rid!r} live in the engine")


async def wait_running(session, running):
    async def ok():
        _, body = await get(session, "/v1/loads", 200)
        return body["loads"][0]["num_running_reqs"] == running

    await wait_for_async(ok, 10, f"{running} running requests")


# --------------------------------------------------------------------------- 1. weight-update sessions


async def test_weight_update_sessions_0523(tmp_path):
    torch = pytest.importorskip("torch")
    async with serve() as (engine, s):
        assert (await server_info(s))["rollfleet_weight_update_session"] is False
        await post(s, "/end_weight_update", {}, 400)
        _, out = await post(s, "/end_weight_update", {})
        assert out == {
            "success": False,
            "message": "no weight-update session is open; call begin_weight_update() first",
        }
        _, out = await post(s, "/begin_weight_update", {"selector": "nonsense"}, 400)
        assert out["type"] == "Bad Request"  # a value the request schema refuses
        assert (await post(s, "/begin_weight_update", {}, 200))[1] == {"success": True, "message": "Success"}
        assert (await server_info(s))["rollfleet_weight_update_session"] is True
        _, out = await post(s, "/begin_weight_update", {"selector": "all"}, 400)
        assert out == {
            "success": False,
            "message": "a weight-update session is already open; call end_weight_update() first",
        }
        assert (await post(s, "/end_weight_update", {}, 200))[1] == {"success": True, "message": "Success"}
        assert (await server_info(s))["rollfleet_weight_update_session"] is False

        # Outside a session a broadcast is refused before anything is received: the group stays in step.
        async with formed_group([s]) as pg:  # opens a session; close it to call outside one
            await post(s, "/end_weight_update", {}, 200)
            _, out = await post(s, "/update_weights_from_distributed", bucket_body({"w": torch.zeros(2)}), 400)
            assert out == {
                "success": False,
                "message": "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            }
            await post(s, "/begin_weight_update", {"selector": "target"}, 200)
            named = {"w": torch.arange(2.0)}
            [(status, out)] = await send_bucket(pg, [s], named, weight_version="1")
            assert status == 200, out
            assert torch.equal(engine.weights.get("w"), named["w"])
        # A disk update needs no session; a session does not outlive its engine.
        assert (await server_info(s))["rollfleet_weight_update_session"] is False
        await post(s, "/update_weights_from_disk", {"model_path": save_weights(tmp_path / "c", named)}, 200)
    async with serve() as (engine, s):
        assert (await server_info(s))["rollfleet_weight_update_session"] is False


async def test_weight_update_sessions_0515_do_not_exist():
    torch = pytest.importorskip("torch")
    async with serve(sglang_version="0.5.15") as (engine, s):
        for path in ("/begin_weight_update", "/end_weight_update"):
            assert await post(s, path, {}) == (404, NOT_FOUND)
        assert await get(s, "/ready") == (404, NOT_FOUND)  # 0.5.23's route
        assert (await server_info(s))["rollfleet_weight_update_session"] is False
        async with formed_group([s]) as pg:  # its begin got 404: no session, and none is needed
            [(status, out)] = await send_bucket(pg, [s], {"w": torch.ones(3)})
            assert status == 200, out


async def test_session_calls_wait_for_a_paused_broadcast_and_continue_waits_for_them():
    torch = pytest.importorskip("torch")
    async with serve() as (engine, s):
        async with formed_group([s]) as pg:
            await post(s, "/pause_generation", {}, 200)
            bucket = asyncio.ensure_future(
                post(s, "/update_weights_from_distributed", bucket_body({"w": torch.ones(2)}))
            )
            await wait_for_async(
                lambda: engine.scheduler.pause_lock.locked(), 10, "the paused broadcast holds the lock"
            )
            resumed = asyncio.ensure_future(post(s, "/continue_generation", {}))
            end = asyncio.ensure_future(post(s, "/end_weight_update", {}))
            lock = engine.scheduler.pause_lock
            await wait_for_async(lambda: len(lock._waiters or ()) == 2, 10, "continue and end behind the broadcast")
            assert not resumed.done() and not end.done()
            await asyncio.to_thread(broadcast_all, pg, [torch.ones(2)])
            assert (await bucket)[0] == 200
            assert (await resumed)[0] == 200 and (await end)[0] == 200
            assert (await server_info(s))["internal_states"][0]["paused"] is False
            await post(s, "/begin_weight_update", {}, 200)  # formed_group closes it


# --------------------------------------------------------------------------- 2. /weights_checker


async def test_weights_checker_0523(tmp_path):
    torch = pytest.importorskip("torch")
    async with serve(tp_size=2) as (engine, s):
        named = {
            "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b.weight": torch.ones(4, dtype=torch.bfloat16),
            "rotary.inv_freq": torch.ones(2),  # a non-persistent buffer's name: never checked
        }
        await post(s, "/update_weights_from_disk", {"model_path": save_weights(tmp_path / "c1", named)}, 200)
        status, out = await get(s, "/weights_checker")  # GET, no body: a checksum
        assert status == 200 and (out["success"], out["message"]) == (True, "Success.")
        sums = {"a.weight": tensor_checksum(named["a.weight"]), "b.weight": tensor_checksum(named["b.weight"])}
        raw = hashlib.sha256(named["b.weight"].view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        assert sums["b.weight"] == raw  # SGLang's CPU convention: sha256 of the raw bytes, 16 hex digits
        per_gpu = hashlib.sha256(b"a.weight" + sums["a.weight"].encode() + b"b.weight" + sums["b.weight"].encode())
        assert [r["checksums"] for r in out["ranks"]] == [sums, sums]
        assert [r["per_gpu_checksum"] for r in out["ranks"]] == [per_gpu.hexdigest()] * 2
        assert out["per_engine_checksum"] == hashlib.sha256(per_gpu.hexdigest().encode() * 2).hexdigest()
        place = {"tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "size": 2}
        assert [r["parallelism_info"] for r in out["ranks"]] == [
            [{"role": "target", "tp_rank": i, **place, "rank": i}] for i in (0, 1)
        ]
        _, out = await post(s, "/weights_checker", {"action": "checksum", "skip_tensor_list": ["b."]}, 200)
        assert out["ranks"][0]["checksums"] == {"a.weight": sums["a.weight"]}
        _, out = await post(s, "/weights_checker", {"selector": "draft"}, 200)  # no draft model: nothing to do
        assert out == {"success": True, "message": "Success."}

        assert await post(s, "/weights_checker", {"action": "compare"}) == (400, {"success": False, "message": ""})
        assert (await post(s, "/weights_checker", {"action": "snapshot"}, 200))[1] == {
            "success": True,
            "message": "Success.",
        }
        await post(s, "/weights_checker", {"action": "compare"}, 200)
        await post(s, "/weights_checker", {"action": "compare"}, 400)  # 0.5.23: a passing compare used it up
        await post(s, "/weights_checker", {"action": "snapshot"}, 200)
        changed = {**named, "b.weight": torch.zeros(4, dtype=torch.bfloat16)}
        await post(s, "/update_weights_from_disk", {"model_path": save_weights(tmp_path / "c2", changed)}, 200)
        _, out = await post(s, "/weights_checker", {"action": "compare"}, 400)
        assert out["message"].startswith("check tensor equality failed:\nname=b.weight max_abs_err=1.0 ")
        assert "a.weight" not in out["message"]
        await post(s, "/weights_checker", {"action": "compare", "skip_tensor_list": ["b.weight"]}, 200)

        await post(s, "/weights_checker", {"action": "reset_tensors", "skip_tensor_list": ["a."]}, 200)
        assert torch.equal(engine.weights.get("a.weight"), named["a.weight"])
        assert not torch.equal(engine.weights.get("b.weight"), changed["b.weight"])
        assert await post(s, "/weights_checker", {"action": "nonsense"}) == (
            400,
            {"success": False, "message": "Unsupported action='nonsense'"},
        )


async def test_weights_checker_0515(tmp_path):
    torch = pytest.importorskip("torch")
    async with serve(sglang_version="0.5.15") as (engine, s):
        named = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}
        await post(s, "/update_weights_from_disk", {"model_path": save_weights(tmp_path / "c1", named)}, 200)
        _, out = await post(s, "/weights_checker", {"skip_tensor_list": ["b."]}, 200)  # no such field: ignored
        [rank] = out["ranks"]
        assert rank["checksums"] == {n: tensor_checksum(t) for n, t in named.items()}
        assert rank["parallelism_info"] == {  # one object, no role
            "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1
        }  # fmt: skip
        await post(s, "/weights_checker", {"action": "snapshot"}, 200)
        for _ in range(2):  # 0.5.15 keeps its snapshot
            await post(s, "/weights_checker", {"action": "compare"}, 200)


# --------------------------------------------------------------------------- 3. /get_weights_by_name


@pytest.mark.parametrize("version", ["0.5.23", "0.5.15"])
async def test_get_weights_by_name_only_for_model_classes_that_implement_it(tmp_path, version):
    torch = pytest.importorskip("torch")
    named = {"w": torch.arange(6.0).reshape(3, 2)}
    path = save_weights(tmp_path / "ckpt", named)
    async with serve(sglang_version=version) as (engine, s):
        assert (await get(s, "/model_info", 200))[1]["architectures"] == ["Qwen2ForCausalLM"]
        await post(s, "/update_weights_from_disk", {"model_path": path}, 200)
        # Qwen2 defines no get_weights_by_name in either release's wheel.
        assert await post(s, "/get_weights_by_name", {"name": "w", "truncate_size": 2}) == (400, GET_FAILED)
    async with serve(sglang_version=version, architecture="MistralForCausalLM") as (engine, s):  # a Llama subclass
        assert (await get(s, "/model_info", 200))[1]["architectures"] == ["MistralForCausalLM"]
        await post(s, "/update_weights_from_disk", {"model_path": path}, 200)
        assert await post(s, "/get_weights_by_name", {"name": "w", "truncate_size": 2}) == (
            200,
            [[0.0, 1.0], [2.0, 3.0]],
        )
        assert await get(s, "/get_weights_by_name?name=w&truncate_size=1") == (200, [[0.0, 1.0]])
        assert await post(s, "/get_weights_by_name", {"name": "no.such"}) == (400, GET_FAILED)


# --------------------------------------------------------------------------- 4. pause and continue


async def test_pause_outlives_a_client_that_gives_up_and_continue_waits_for_it():
    async with serve(**SLOW) as (engine, s):
        body = {"text": "a", "sampling_params": {"max_new_tokens": 1000}}
        for then_continue in (False, True):
            running = asyncio.ensure_future(post(s, "/generate", body))
            await wait_running(s, 1)
            pauses = engine.scheduler.pauses
            # The abort-mode pause re-checks after 1.0 s: this client gives up long before.
            with pytest.raises(TimeoutError):
                async with s.post("/pause_generation", json={}, timeout=aiohttp.ClientTimeout(total=0.2)) as r:
                    await r.read()
            if then_continue:
                # Sent while the pause runs: it waits for the pause, then unpauses.
                assert (await post(s, "/continue_generation", {}, 200))[1]["status"] == "ok"
                assert not engine.scheduler.pause_lock.locked()  # the pause was over before continue answered
                assert engine.scheduler.pauses == pauses + 1 and not engine.scheduler.paused
            else:
                await wait_for_async(lambda: engine.scheduler.pauses == pauses + 1, 10, "the pause begun")
                await wait_for_async(lambda: not engine.scheduler.pause_lock.locked(), 10, "the pause done")
                assert engine.scheduler.paused  # the handler was not cancelled with its client
                await post(s, "/continue_generation", {}, 200)
            status, out = await running
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await server_info(s))["internal_states"][0]["paused"] is False


# --------------------------------------------------------------------------- 5. abort_sent


@pytest.mark.parametrize("version", ["0.5.23", "0.5.15"])
async def test_an_abort_lost_at_the_pause_gate_and_the_aborts_after_it(version):
    async with serve(sglang_version=version, **SLOW) as (engine, s):
        body = {"text": "a", "sampling_params": {"max_new_tokens": 500}}
        await abort(s, rid="nobody")  # a rid the tokenizer lacks: ignored
        prefixed = asyncio.ensure_future(post(s, "/generate", {**body, "rid": "req-10"}))
        await wait_running(s, 1)
        await post(s, "/pause_generation", {"mode": "in_place"}, 200)
        gated = asyncio.ensure_future(post(s, "/generate", {**body, "rid": "req-1"}))
        await wait_live(s, "req-1")
        # The tokenizer holds req-1 and sends its abort to the scheduler, which lacks it (lost) but
        # aborts every rid it holds that starts with "req-1".
        await abort(s, rid="req-1")
        status, out = await prefixed
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        await post(s, "/continue_generation", {}, 200)
        await wait_running(s, 1)
        await abort(s, rid="req-1")  # 0.5.23: abort_sent, dropped
        status, out = await gated
        assert status == 200
        if version == "0.5.23":
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 500}
        else:
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert out["meta_info"]["completion_tokens"] < 500


# --------------------------------------------------------------------------- 6. API keys


@pytest.mark.parametrize("version", ["0.5.23", "0.5.15"])
async def test_api_key_and_admin_api_key(version):
    key = {"Authorization": "Bearer K"}
    async with serve(sglang_version=version, api_key="K") as (engine, s):
        for path in ("/health", "/health_generate"):
            async with s.get(path) as r:
                assert r.status == 200
        async with s.get("/ready") as r:  # open in 0.5.23; a route 0.5.15 lacks, behind the key there
            assert r.status == (200 if version == "0.5.23" else 401)
        assert await get(s, "/model_info") == (401, UNAUTHORIZED)
        assert await post(s, "/pause_generation", {}) == (401, UNAUTHORIZED)
        assert await get(s, "/no/such/route") == (401, UNAUTHORIZED)
        await get(s, "/model_info", 200, headers=key)
        await get(s, "/no/such/route", 404, headers=key)
        async with s.get("/server_info", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}, headers=key) as r:
            assert r.status == 200
    async with serve(sglang_version=version, api_key="K", admin_api_key="A") as (engine, s):
        admin = {"Authorization": "Bearer A"}
        async with s.post("/pause_generation", json={}, headers=key) as r:
            assert r.status == 401  # control routes take the admin key only
        async with s.post("/pause_generation", json={}, headers=admin) as r:
            assert r.status == 200
        async with s.post("/continue_generation", json={}, headers=admin) as r:
            assert r.status == 200
        await get(s, "/server_info", 401, headers=admin)  # the others, the plain key only
        await get(s, "/server_info", 200, headers=key)


# --------------------------------------------------------------------------- 7. --load-format dummy


@pytest.mark.parametrize("version", ["0.5.23", "0.5.15"])
async def test_a_dummy_launched_engine_refuses_disk_loads_that_name_no_format(tmp_path, version):
    torch = pytest.importorskip("torch")
    path = save_weights(tmp_path / "ckpt", {"w": torch.ones(2)})
    async with serve(sglang_version=version, load_format="dummy", weight_version="0") as (engine, s):
        status, out = await post(s, "/update_weights_from_disk", {"model_path": path, "weight_version": "1"})
        assert status == 400 and out["success"] is False and out["num_paused_requests"] == 0
        assert out["message"].startswith("Failed to get model loader: <sglang.srt.model_loader.loader.DummyModelLoader")
        assert engine.weights.get("w") is None
        _, info = await get(s, "/model_info", 200)
        assert info["weight_version"] == "0" and info["model_path"] == "rollfleet-sim"
        assert info.get("load_format") == ("dummy" if version == "0.5.23" else None)  # 0.5.23's field

        _, out = await post(s, "/update_weights_from_disk", {"model_path": path, "load_format": "pt"}, 200)
        assert out["message"] == "Succeeded to update model weights."
        assert torch.equal(engine.weights.get("w"), torch.ones(2))
        assert (await server_info(s))["load_format"] == "pt"
        if version == "0.5.23":
            _, info = await get(s, "/model_info", 200)
            assert (info["load_format"], info["served_model_name"], info["model_path"]) == ("pt", path, path)
        # The engine's format is pt now: a load naming none reads weights.pt, and safetensors is not there.
        await post(s, "/update_weights_from_disk", {"model_path": path}, 200)
        _, out = await post(s, "/update_weights_from_disk", {"model_path": path, "load_format": "safetensors"}, 400)
        assert "no model.safetensors" in out["message"]


# --------------------------------------------------------------------------- 8. keep-alive


async def test_idle_keep_alive_connections_are_closed():
    assert RUNNER_OPTIONS["keepalive_timeout"] == 5.0  # SGLang's SGLANG_TIMEOUT_KEEP_ALIVE, as served
    engine = SimEngine()
    # The same options with a short keep-alive, so the close comes quickly.
    runner = web.AppRunner(make_app(engine), **{**RUNNER_OPTIONS, "keepalive_timeout": 0.3})
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        for _ in range(2):  # used again within the keep-alive: the same connection serves both
            writer.write(b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n")
            await writer.drain()
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then idle: the server closes it
        writer.close()
    finally:
        engine.shutdown()
        await runner.cleanup()


# --------------------------------------------------------------------------- 9. /tokenize and --chat-template


@pytest.mark.parametrize("version", ["0.5.23", "0.5.15"])
async def test_tokenize_with_add_generation_prompt_needs_a_jinja_template(tmp_path, version):
    messages = [{"role": "user", "content": "hi"}]
    async with serve(sglang_version=version, chat_template="chatml") as (engine, s):  # a built-in name
        status, out = await post(s, "/tokenize", {"messages": messages, "add_generation_prompt": False})
        if version == "0.5.23":
            assert (status, out) == (
                400,
                {
                    "object": "error",
                    "message": "add_generation_prompt is supported only with a Jinja chat template.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
        else:
            assert status == 200
        await post(s, "/tokenize", {"messages": messages}, 200)  # rendered as for a chat completion
        await post(s, "/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 200)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for template in (str(jinja), None):  # a Jinja file, or none: today's behaviour
        async with serve(sglang_version=version, chat_template=template) as (engine, s):
            await post(s, "/tokenize", {"messages": messages, "add_generation_prompt": True}, 200)
    with pytest.raises(ConfigError, match="is not a built-in template name or a valid chat template file path"):
        SimEngine(chat_template=str(tmp_path / "missing.jinja"))


# --------------------------------------------------------------------------- 10. --corrupt-tensors


async def test_corrupt_tensors_changes_only_the_named_tensors_of_a_broadcast():
    torch = pytest.importorskip("torch")
    async with serve(corrupt_tensors=["b"]) as (engine, s):
        named = {"a": torch.zeros(3), "b": torch.zeros(3), "c": torch.zeros(2)}
        async with formed_group([s]) as pg:
            [(status, out)] = await send_bucket(pg, [s], named)
            assert status == 200, out
        _, out = await post(s, "/weights_checker", {"action": "checksum"}, 200)
        held = out["ranks"][0]["checksums"]
        assert held["a"] == tensor_checksum(named["a"]) and held["c"] == tensor_checksum(named["c"])
        assert held["b"] != tensor_checksum(named["b"])
        assert engine.weights.get("b").tolist() == [1.0, 0.0, 0.0]
