"""Tests of agent.sim: the SGLang-compatible CPU engine, seen as a client sees it.

The engine-agnostic SGLang-contract tests take ``serve_engine`` (tests/integration/conftest.py) and run
against both the sim and the hf engine; requests meant to keep running say ``ignore_eos`` (a real
model may end them early). Tests of the sim's output model, latencies and flags use ``serve``.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from common.tokenizer import BYTE_TOKENIZER_NAME, ByteTokenizer
from harness.polling import wait_for_async
from harness.sim_server import serve

ROOT = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}

pytestmark = pytest.mark.timeout(60)


async def gen(session, payload, status=200):
    async with session.post("/generate", json=payload) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


async def loads(session):
    async with session.get("/v1/loads") as resp:
        assert resp.status == 200
        body = await resp.json()
    return body["loads"][0]


async def wait_running(session, running, waiting=0):
    async def ok():
        ld = await loads(session)
        return ld["num_running_reqs"] == running and ld["num_waiting_reqs"] == waiting

    await wait_for_async(ok, 10, f"{running} running and {waiting} waiting requests")


async def wait_live(session, rid):
    """Wait until the engine holds a live request ``rid``: at the pause gate, queued or running.

    The probe reuses the rid with an impossible token budget, so it is refused either way and never
    admitted: "Duplicate request ID" once ``rid`` is live, a context-length error before.
    """

    async def live():
        probe = {"text": "probe", "rid": rid, "sampling_params": {"max_new_tokens": 10**9}}
        err = await gen(session, probe, status=400)
        return "Duplicate request ID detected" in err["error"]["message"]

    await wait_for_async(live, 10, f"request {rid!r} live in the engine")


async def sse_chunks(resp):
    """The data chunks of an open SSE response, as they arrive; ends after ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield orjson.loads(data)
    raise AssertionError("stream did not end with [DONE]")


async def abort(session, **body):
    async with session.post("/abort_request", json=body) as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def stream_chunks(session, payload):
    chunks, done = [], False
    async with session.post("/generate", json={**payload, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            assert not done, "data after [DONE]"
            if data == "[DONE]":
                done = True
                continue
            chunks.append(orjson.loads(data))
    assert done, "stream did not end with [DONE]"
    return chunks


PROMPT = "Question: What is 12 + 7? Think step by step."


# --------------------------------------------------------------------------- generate


async def test_generate_response_shape_and_logprobs():
    async with serve(output_len_dist="fixed", output_len_median=40) as (engine, s):
        ids = TOK.encode(PROMPT)
        out = await gen(
            s,
            {
                "input_ids": ids,
                "rid": "shape-1",
                "sampling_params": {"max_new_tokens": 100, "temperature": 0.7, "top_p": 0.9},
                "return_logprob": True,
                "return_prompt_token_ids": True,
            },
        )
        assert set(out) == {"text", "output_ids", "meta_info", "prompt_token_ids"}
        meta = out["meta_info"]
        assert meta["id"] == "shape-1"
        assert meta["finish_reason"] == {"type": "stop", "matched": 257}
        assert out["output_ids"][-1] == ByteTokenizer.EOS
        assert len(out["output_ids"]) == meta["completion_tokens"] == 40
        assert meta["prompt_tokens"] == len(ids)
        assert out["prompt_token_ids"] == ids
        assert out["text"] == TOK.decode(out["output_ids"])
        lps = meta["output_token_logprobs"]
        assert len(lps) == meta["output_token_logprobs_length"] == len(out["output_ids"])
        assert [t for _, t, _ in lps] == out["output_ids"]
        assert all(-3.0 <= lp < 0.0 and text is None for lp, _, text in lps)
        assert meta["input_token_logprobs"] == []
        assert meta["weight_version"] == "default"
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 40}]
        assert meta["e2e_latency"] >= 0 and meta["cached_tokens"] == 0

        # Same prompt again: prefix-cache hit; no logprobs unless asked for.
        again = await gen(s, {"input_ids": ids, "sampling_params": {"max_new_tokens": 100}})
        assert again["meta_info"]["cached_tokens"] == len(ids) - 1
        assert "output_token_logprobs" not in again["meta_info"]

        # Text prompt, token texts and prompt logprobs.
        out = await gen(
            s,
            {
                "text": "hi",
                "sampling_params": {"max_new_tokens": 8},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": 0,
            },
        )
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == 2
        assert "".join(text for _, _, text in meta["output_token_logprobs"]) == out["text"]
        assert [t for _, t, _ in meta["input_token_logprobs"]] == TOK.encode("hi")
        assert meta["input_token_logprobs"][0][0] is None


async def test_finish_reason_length_vs_stop_and_stop_strings():
    async with serve(output_len_dist="fixed", output_len_median=30) as (engine, s):
        out = await gen(s, {"text": "x", "sampling_params": {"max_new_tokens": 10}})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert len(out["output_ids"]) == 10 and ByteTokenizer.EOS not in out["output_ids"]

        out = await gen(s, {"text": "x", "sampling_params": {"max_new_tokens": 64}})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ByteTokenizer.EOS}
        assert len(out["output_ids"]) == 30 and out["output_ids"][-1] == ByteTokenizer.EOS

        # ignore_eos runs to the budget.
        out = await gen(s, {"text": "x", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 64}
        assert len(out["output_ids"]) == 64

        # A stop string: output_ids keep it, text drops it unless no_stop_trim.
        sp = {"max_new_tokens": 64, "stop": ["answer"], "temperature": 0}
        out = await gen(s, {"text": PROMPT, "sampling_params": sp})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "answer"}
        assert TOK.decode(out["output_ids"]).endswith("answer")
        assert out["text"].endswith("The ")
        out2 = await gen(s, {"text": PROMPT, "sampling_params": {**sp, "no_stop_trim": True}})
        assert out2["text"].endswith("The answer")

        # A stop token id (the space byte).
        out = await gen(s, {"text": "x", "sampling_params": {"max_new_tokens": 64, "stop_token_ids": [32]}})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 32}
        assert out["output_ids"][-1] == 32 and 32 not in out["output_ids"][:-1]


async def test_arithmetic_answers_and_determinism():
    async with serve(accuracy=1.0, output_len_dist="fixed", output_len_median=200) as (engine, s):
        out = await gen(s, {"text": PROMPT, "sampling_params": {"max_new_tokens": 512}})
        assert out["text"].endswith("The answer is \\boxed{19}.")
        out = await gen(s, {"text": "Compute 6 * 7 please", "sampling_params": {"max_new_tokens": 512}})
        assert out["text"].endswith("\\boxed{42}.")
        # Truncated samples lack the answer (it sits at the end).
        out = await gen(s, {"text": PROMPT, "sampling_params": {"max_new_tokens": 100}})
        assert "boxed" not in out["text"]
    async with serve(accuracy=0.0) as (engine, s):
        for _ in range(5):
            # Drawn lengths are capped at --output-len-max (8192), so this budget always ends in EOS.
            out = await gen(s, {"text": "What is 9 - 5?", "sampling_params": {"max_new_tokens": 8193}})
            assert re.search(r"\\boxed\{(-?\d+)\}\.$", out["text"])
            assert not out["text"].endswith("\\boxed{4}.")

        # Greedy: same prompt, same output. sampling_seed: reproducible. Otherwise random.
        async def sample(sp):
            out = await gen(
                s, {"text": PROMPT, "sampling_params": {"max_new_tokens": 8192, **sp}, "return_logprob": True}
            )
            return out["output_ids"], out["meta_info"]["output_token_logprobs"]

        assert await sample({"temperature": 0}) == await sample({"temperature": 0})
        assert await sample({"sampling_seed": 7}) == await sample({"sampling_seed": 7})
        assert len({str(await sample({})) for _ in range(4)}) > 1


async def test_batch_and_n_expand_into_lists(serve_engine):
    async with serve_engine(output_len_dist="fixed", output_len_median=5) as (engine, s):
        out = await gen(s, {"input_ids": [[1, 2, 3], [4]], "rid": "b", "sampling_params": {"max_new_tokens": 16}})
        assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
        assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 1]
        out = await gen(
            s,
            {
                "text": ["ab", "c"],
                "rid": ["x", "y"],
                "sampling_params": [{}, {"max_new_tokens": 2, "ignore_eos": True}],
            },
        )
        assert [o["meta_info"]["id"] for o in out] == ["x", "y"]
        assert out[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        out = await gen(s, {"input_ids": [[1, 2, 3], [4]], "rid": "n", "sampling_params": {"n": 2}})
        assert len(out) == 4
        assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 1, 1]
        assert len({o["meta_info"]["id"] for o in out}) == 4 and "n_0" not in {o["meta_info"]["id"] for o in out}
        out = await gen(s, {"text": "single", "sampling_params": {"n": 3}})
        assert isinstance(out, list) and len(out) == 3


# --------------------------------------------------------------------------- streaming


async def test_streaming_cumulative_chunks_then_done():
    async with serve(output_len_dist="fixed", output_len_median=10) as (engine, s):
        chunks = await stream_chunks(
            s, {"text": "x", "sampling_params": {"max_new_tokens": 64, "stream_interval": 4}, "return_logprob": True}
        )
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [4, 8, 10]
        for prev, cur in zip(chunks, chunks[1:], strict=False):
            assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
            assert cur["text"].startswith(prev["text"])
        assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None, None]
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": 257}
        assert len(last["meta_info"]["output_token_logprobs"]) == len(last["output_ids"]) == 10

    # Timed decode with the server's stream interval.
    async with serve(output_len_dist="fixed", output_len_median=10, token_latency_ms=2, stream_interval=3) as (e, s):
        chunks = await stream_chunks(s, {"text": "x", "sampling_params": {"max_new_tokens": 64}})
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [3, 6, 9, 10]
        # Batch streams tag chunks with their index.
        chunks = await stream_chunks(s, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4}})
        finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
        assert sorted(c["index"] for c in finals) == [0, 1]


async def test_client_disconnect_aborts_request(serve_engine):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=5000) as (engine, s):
        async with aiohttp.ClientSession(f"http://127.0.0.1:{engine.port}") as other:
            resp = await other.post(
                "/generate",
                json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}},
            )
            await resp.content.readline()
            await wait_running(s, 1)
            resp.close()
        await wait_running(s, 0)

        timeout = aiohttp.ClientTimeout(total=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                "/generate",
                json={"text": "x", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}},
                timeout=timeout,
            )
        await wait_running(s, 0)


# --------------------------------------------------------------------------- abort


async def test_abort_by_rid_returns_partial_output(serve_engine):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        sp = {"max_new_tokens": 4000, "ignore_eos": True}
        task = asyncio.create_task(
            gen(s, {"text": PROMPT, "rid": "abc-1", "sampling_params": sp, "return_logprob": True})
        )
        await wait_running(s, 1)
        await asyncio.sleep(0.1)
        await abort(s, rid="abc-1")
        out = await asyncio.wait_for(task, 2)
        meta = out["meta_info"]
        assert meta["finish_reason"] == ABORTED
        assert 0 < meta["completion_tokens"] == len(out["output_ids"]) < 2000
        assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
        assert meta["prompt_tokens"] == len(PROMPT)
        assert out["text"] == TOK.decode(out["output_ids"])
        await abort(s, rid="no-such-rid")  # unknown rids: still 200, empty body

        # Prefix matching: the exact live rid "req-1" also aborts "req-10"; a bare prefix does nothing.
        tasks = {
            rid: asyncio.create_task(gen(s, {"text": "x", "rid": rid, "sampling_params": sp}))
            for rid in ("req-1", "req-10", "req-2")
        }
        marker = asyncio.create_task(gen(s, {"text": "x", "rid": "marker", "sampling_params": sp}))
        await wait_running(s, 4)
        await abort(s, rid="req-")
        # Samples an abort reaches leave the scheduler in abort order, so once "marker" (aborted
        # after the bare prefix) is back, anything the prefix had aborted would be gone too.
        await abort(s, rid="marker")
        assert (await asyncio.wait_for(marker, 2))["meta_info"]["finish_reason"] == ABORTED
        assert (await loads(s))["num_running_reqs"] == 3
        assert not any(t.done() for t in tasks.values())
        await abort(s, rid="req-1")
        for rid in ("req-1", "req-10"):
            assert (await asyncio.wait_for(tasks[rid], 2))["meta_info"]["finish_reason"] == ABORTED
        assert not tasks["req-2"].done()
        await abort(s, abort_all=True)
        assert (await asyncio.wait_for(tasks["req-2"], 2))["meta_info"]["finish_reason"] == ABORTED


async def test_abort_in_waiting_queue_and_abort_all(serve_engine):
    async with serve_engine(slots=1, token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (
        engine,
        s,
    ):
        sp = {"max_new_tokens": 4000, "ignore_eos": True}
        a = asyncio.create_task(gen(s, {"text": "a", "rid": "A", "sampling_params": sp}))
        await wait_running(s, 1)
        b = asyncio.create_task(gen(s, {"text": "b", "rid": "B", "sampling_params": sp, "return_logprob": True}))
        await wait_running(s, 1, waiting=1)
        await abort(s, rid="B")
        out = await asyncio.wait_for(b, 2)
        assert out["meta_info"]["finish_reason"] == ABORT_WAITING
        assert "prompt_tokens" not in out["meta_info"]
        assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
        assert not a.done()

        c = asyncio.create_task(stream_chunks(s, {"text": "c", "rid": "C", "sampling_params": sp}))
        await wait_running(s, 1, waiting=1)
        await abort(s, abort_all=True)
        assert (await asyncio.wait_for(a, 2))["meta_info"]["finish_reason"] == ABORTED
        chunks = await asyncio.wait_for(c, 2)
        assert [ch["meta_info"]["finish_reason"] for ch in chunks] == [ABORT_WAITING]
        await wait_running(s, 0)


async def test_duplicate_rid_rejected_while_in_flight(serve_engine):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        first = asyncio.create_task(
            gen(s, {"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
        )
        await wait_running(s, 1)
        err = await gen(s, {"text": "y", "rid": "dup"}, status=400)
        assert "Duplicate request ID detected" in err["error"]["message"]
        await abort(s, rid="dup")
        await asyncio.wait_for(first, 2)
        out = await gen(s, {"text": "y", "rid": "dup", "sampling_params": {"max_new_tokens": 3}})
        assert out["meta_info"]["id"] == "dup"


async def test_bad_requests_are_400(serve_engine):
    async with serve_engine() as (engine, s):
        # Schema errors (0.5.23): {"error": "<message>"}.
        err = await gen(s, {"input_ids": [1, 2], "sampling_params": {"max_tokens": 5}}, status=400)
        assert isinstance(err["error"], str) and "max_tokens" in err["error"]
        for body in (
            {"input_ids": ["a"]},
            {"text": "a", "sampling_params": {"temperature": "hot"}},
            {"text": 5},
        ):
            err = await gen(s, body, status=400)
            assert isinstance(err["error"], str), body
        async with s.post("/generate", data=b"{not json") as resp:
            assert resp.status == 400
            assert isinstance((await resp.json())["error"], str)
        # Request errors (the tokenizer manager's ValueError): {"error": {"message": ...}}.
        for body in (
            {"input_ids": []},
            {"input_ids": [1, 259]},
            {"input_ids": [-1]},
            {"input_ids": [[1], []]},
            {},
            {"text": "a", "input_ids": [1]},
            {"text": "a", "sampling_params": {"top_p": 0}},
            {"text": "a", "sampling_params": {"max_new_tokens": 40000}},
        ):
            err = await gen(s, body, status=400)
            assert isinstance(err["error"]["message"], str), body
        # Request errors inside a stream: HTTP 200, one error chunk, then [DONE].
        async with s.post("/generate", json={"input_ids": [300], "stream": True}) as resp:
            assert resp.status == 200
            body = await resp.text()
        lines = [ln for ln in body.split("\n") if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        assert orjson.loads(lines[0][5:])["error"]["code"] == 400


# --------------------------------------------------------------------------- pause, weights, cache


async def test_pause_abort_mode_holds_new_requests_until_continue(serve_engine):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        running = asyncio.create_task(
            gen(s, {"text": "a", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
        )
        await wait_running(s, 1)
        async with s.post("/pause_generation", json={}) as resp:  # {} = abort mode
            assert resp.status == 200
            assert await resp.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert running.done() and running.result()["meta_info"]["finish_reason"] == ABORTED

        held = asyncio.create_task(
            gen(s, {"text": "b", "rid": "held", "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}})
        )
        await wait_live(s, "held")  # it reached the engine; past the gate it would now be running
        assert not held.done()
        ld = await loads(s)
        assert ld["num_running_reqs"] == ld["num_waiting_reqs"] == 0  # held at the gate, not queued
        await abort(s, abort_all=True)  # does not reach the gate
        async with s.post("/continue_generation", json={}) as resp:
            assert await resp.json() == {"message": "Generation continued successfully.", "status": "ok"}
        out = await asyncio.wait_for(held, 2)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def test_pause_in_place_freezes_and_tracks_weight_versions(serve_engine, tmp_path):
    timed = {"token_latency_ms": 5, "output_len_dist": "fixed", "output_len_median": 2000, "health_timeout": 0.2}
    async with serve_engine(**timed) as (engine, s):
        budget = 400
        body = {
            "text": "a",
            "stream": True,
            "sampling_params": {"max_new_tokens": budget, "stream_interval": 4, "ignore_eos": True},
        }
        async with s.post("/generate", json=body) as resp:
            assert resp.status == 200
            chunks = sse_chunks(resp)
            first = await anext(chunks)  # tokens were produced before the pause
            assert 0 < first["meta_info"]["completion_tokens"] < budget
            async with s.post("/pause_generation", json={"mode": "in_place"}) as r:
                assert r.status == 200
            frozen_at = (await loads(s))["num_used_tokens"] - first["meta_info"]["prompt_tokens"]
            assert first["meta_info"]["completion_tokens"] <= frozen_at < budget
            # The paused engine's health probe times out after 0.2 s: a running sample naps at most
            # 35 ms per step, so had it not been frozen its next tokens would be counted by now.
            async with s.get("/health") as r:
                assert r.status == 503
            assert (await loads(s))["num_used_tokens"] - first["meta_info"]["prompt_tokens"] == frozen_at
            # flush_cache false: an in_place pause with running requests cannot flush (test_sim_weights).
            async with s.post(
                "/update_weights_from_disk",
                json={"model_path": str(tmp_path), "weight_version": "v1", "flush_cache": False},
            ) as r:
                assert r.status == 200 and (await r.json())["success"] is True
            async with s.post("/continue_generation", json={}) as r:
                assert r.status == 200
            rest = [chunk async for chunk in chunks]
        meta = rest[-1]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": budget}
        assert meta["weight_version"] == "v1"
        # Frozen: not one token between the pause and the weight update, which paused samples do not wait for.
        assert meta["weight_versions"] == [
            {"version": "default", "start": 0, "end": frozen_at},
            {"version": "v1", "start": frozen_at, "end": budget},
        ]


async def test_update_weights_from_disk(serve_engine, tmp_path):
    async with serve_engine() as (engine, s):
        async with s.post(
            "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "step-3"}
        ) as r:
            assert r.status == 200
            body = await r.json()
        assert body["success"] is True and body["num_paused_requests"] == 0
        async with s.get("/model_info") as r:
            info = await r.json()
        assert info["model_path"] == str(tmp_path) and info["weight_version"] == "step-3"
        out = await gen(s, {"text": "x"})
        assert out["meta_info"]["weight_version"] == "step-3"

        async with s.post(
            "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing"), "weight_version": "bad"}
        ) as r:
            assert r.status == 400
            body = await r.json()
        assert body["success"] is False and body["message"]
        async with s.get("/get_model_info") as r:
            assert (await r.json())["weight_version"] == "step-3"

        async with s.post("/update_weight_version", json={"new_version": "v9"}) as r:
            assert (await r.json()) == {
                "success": True,
                "message": "Weight version updated to v9.",
                "new_version": "v9",
            }
        assert (await gen(s, {"text": "x"}))["meta_info"]["weight_version"] == "v9"


async def test_weight_update_waits_for_inflight_requests(serve_engine, tmp_path):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        first = asyncio.create_task(
            gen(s, {"text": "a", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}})
        )
        await wait_running(s, 1)

        async def update():
            async with s.post(
                "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "v2"}
            ) as r:
                assert r.status == 200
                return first.done()

        upd = asyncio.create_task(update())
        # Requests sent from now on queue behind the update.
        await wait_for_async(lambda: engine.scheduler.updating_weights or upd.done(), 10, "the weight update")
        later = asyncio.create_task(gen(s, {"text": "b", "sampling_params": {"max_new_tokens": 5}}))
        assert await asyncio.wait_for(upd, 3) is True  # the update waited for the in-flight request
        assert first.result()["meta_info"]["weight_version"] == "default"
        assert (await asyncio.wait_for(later, 2))["meta_info"]["weight_version"] == "v2"


async def test_flush_cache_only_when_idle(serve_engine):
    async with serve_engine(token_latency_ms=5, output_len_dist="fixed", output_len_median=2000) as (engine, s):
        task = asyncio.create_task(
            gen(s, {"text": "a", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
        )
        await wait_running(s, 1)
        async with s.get("/flush_cache") as r:
            assert r.status == 400
        async with s.post("/flush_cache", params={"timeout": "10"}) as r:
            assert r.status == 200 and (await r.text()).startswith("Cache flushed.")
        assert task.done()


# --------------------------------------------------------------------------- health and info


async def test_health_during_startup_delay_then_ok():
    async with serve(startup_delay=600) as (engine, s):
        for path in ("/health", "/health_generate"):
            async with s.get(path) as r:
                assert r.status == 503
        async with s.post("/generate", json={"text": "x"}) as r:
            assert r.status == 503
        async with s.get("/model_info") as r:
            assert r.status == 200 and (await r.json())["tokenizer_path"] == BYTE_TOKENIZER_NAME
        async with s.get("/server_info") as r:
            assert (await r.json())["status"] == "Starting"

    t0 = time.monotonic()
    async with serve(startup_delay=0.4) as (engine, s):

        async def healthy():
            async with s.get("/health_generate") as r:
                return r.status == 200 and await r.read() == b""

        await wait_for_async(healthy, 10, "healthy after the startup delay")
        assert time.monotonic() - t0 >= 0.4
        await gen(s, {"text": "x"})

    async with serve(unhealthy=True) as (engine, s):
        for path in ("/health", "/health", "/ready"):
            async with s.get(path) as r:
                assert r.status == 503
        async with s.get("/server_info") as r:
            assert (await r.json())["status"] == "UnHealthy"

    async with serve(health_timeout=0.2) as (engine, s):
        await s.post("/pause_generation", json={})
        t0 = time.monotonic()
        async with s.get("/health") as r:
            assert r.status == 503
        assert time.monotonic() - t0 >= 0.2
        await s.post("/continue_generation", json={})
        async with s.get("/health") as r:
            assert r.status == 200


async def test_info_endpoints():
    async with serve(slots=7, weight_version="w0", model_path="/models/x") as (engine, s):
        async with s.get("/model_info") as r:
            info = await r.json()
        assert info == {
            "model_path": "/models/x",
            "tokenizer_path": BYTE_TOKENIZER_NAME,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "w0",
            "weight_digest": "e3b0c44298fc1c14",  # no tensors held: the SHA-256 of nothing
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "rollfleet-sim",
            "architectures": ["Qwen2ForCausalLM"],  # --architecture's default
            # SGLang 0.5.23's additions (the default --sglang-version)
            "served_model_name": "/models/x",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
        }
        for path in ("/server_info", "/get_server_info"):
            async with s.get(path) as r:
                si = await r.json()
            assert si["max_running_requests"] == 7 and si["port"] == engine.port
            assert si["tp_size"] == si["dp_size"] == 1 and si["version"] == "rollfleet-sim"
            assert si["status"] == "Up" and isinstance(si["internal_states"], list)
            assert (si["device"], si["quantization"], si["rollfleet_sglang_version"]) == ("cpu", None, "0.5.23")
        async with s.get("/v1/loads") as r:
            body = await r.json()
        assert set(body) == {"timestamp", "version", "loads"}
        assert body["loads"][0]["dp_rank"] == 0 and body["loads"][0]["max_running_requests"] == 7


# --------------------------------------------------------------------------- process


class _Proc:
    """``python -m agent.sim`` as a child process; always terminated."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.sim", "--port", "0", *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def __enter__(self):
        line = self.proc.stdout.readline()  # printed once listening; EOF if it died
        m = re.fullmatch(r"rollfleet-sim listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert m, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = m.group(1)
        assert int(m.group(2)) > 0
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self.proc.stderr.close()


async def test_process_crash_endpoint_and_crash_after_requests():
    with _Proc() as p:
        async with aiohttp.ClientSession(p.url) as s:
            assert (await gen(s, {"text": "1 + 1"}))["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            async with s.post("/rollfleet/crash") as r:
                assert r.status == 200 and (await r.json())["exit_code"] == 17
        assert p.proc.wait(5) == 17

    with _Proc("--crash-after-requests", "2") as p:
        async with aiohttp.ClientSession(p.url) as s:
            await gen(s, {"text": "a"})
            await gen(s, {"text": "b"})
        assert p.proc.wait(5) == 17

    # An SGLang launch command line runs as is; SIGTERM stops it cleanly.
    sglang_flags = (
        "--model-path",
        "/nonexistent/model",
        "--tp-size",
        "2",
        "--base-gpu-id",
        "0",
        "--skip-server-warmup",
        "--max-running-requests",
        "5",
        "--mem-fraction-static",
        "0.7",
    )
    with _Proc(*sglang_flags) as p:
        async with aiohttp.ClientSession(p.url) as s:
            async with s.get("/health") as r:
                assert r.status == 200
            async with s.get("/server_info") as r:
                info = await r.json()
            assert (info["tp_size"], info["max_running_requests"], info["model_path"]) == (2, 5, "/nonexistent/model")
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(5) == 0

    # A mistyped flag is an error, not silently ignored.
    bad = subprocess.run(
        [sys.executable, "-m", "agent.sim", "--port", "0", "--token-latency", "5", "--bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert bad.returncode == 2 and "--bogus" in bad.stderr
