"""Concurrent calls of one sample on a real (sim) engine: distinct rids, and aborts that reach them.

SGLang refuses a second live request with a rid already in flight (400 "Duplicate request ID
detected"), and its tokenizer manager drops an abort of a rid it does not hold exactly. A generate
function's calls therefore run as ``<base>-c<k>`` (agent/custom_rollout.py), and an abort of the
sample's base rid is sent for each live call rid the lease context's ``LiveRids`` lists.
"""

from __future__ import annotations

import asyncio

import pytest

from agent.custom_rollout import LiveRids
from agent.engine_client import EngineClient
from common.errors import EngineRejected
from harness.sim_server import serve

BASE = "rf-00000000000000a1-000-0000"
OTHER = "rf-00000000000000a1-000-0001"
SLOW = {"max_new_tokens": 400, "temperature": 1.0}  # 400 tokens at 10 ms: 4 s unless aborted


def _reason(out: dict) -> str:
    return out["meta_info"]["finish_reason"]["type"]


@pytest.mark.timeout(30)
async def test_calls_of_one_sample_run_side_by_side_and_an_abort_of_its_base_reaches_them_all():
    """Red if: two calls of one sample collide on the engine, or aborting the sample misses a call
    (it would run to max_new_tokens, holding the engine through a pause or a weight update)."""
    async with serve(token_latency_ms=10, output_len_dist="fixed", output_len_median=1000) as (engine, _):
        url = f"http://127.0.0.1:{engine.port}"
        client = EngineClient()
        live = LiveRids()

        async def call(base: str, k: int) -> dict:
            rid = f"{base}-c{k}"
            live.add(base, rid)
            try:
                return await client.generate(url, [1, 2, 3], SLOW, rid)
            finally:
                live.discard(base, rid)

        try:
            # One rid for two calls at once: what every call of a sample used to send.
            first = asyncio.ensure_future(client.generate(url, [1, 2, 3], SLOW, BASE))
            await asyncio.sleep(0.2)
            with pytest.raises(EngineRejected, match="Duplicate request ID"):
                await client.generate(url, [1, 2, 3], SLOW, BASE)
            await client.abort(url, BASE)  # the base rid itself is live here: aborted as before
            assert _reason(await first) == "abort"

            calls = [asyncio.ensure_future(call(BASE, k)) for k in (1, 2)]
            other = asyncio.ensure_future(call(OTHER, 1))
            await asyncio.sleep(0.3)
            assert live.expand(BASE) == [f"{BASE}-c1", f"{BASE}-c2"]
            await client.abort(url, BASE)  # not held exactly: SGLang (and the sim) ignore it
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls)
            for rid in live.expand(BASE):
                await client.abort(url, rid)
            done = await asyncio.wait_for(asyncio.gather(*calls), 5)
            assert [_reason(out) for out in done] == ["abort", "abort"]
            assert not other.done()  # the other sample's call is not touched
            assert live.expand(BASE) == [BASE]  # nothing left registered
            for rid in live.expand(OTHER):
                await client.abort(url, rid)
            assert _reason(await asyncio.wait_for(other, 5)) == "abort"
        finally:
            await client.close()
