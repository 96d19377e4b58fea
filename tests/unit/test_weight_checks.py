"""Verification by checksums (agent/weight_checks.py), with no engine: each engine's ``/weights_checker``
answer against the trainer's checksums, and engines of one layout against each other."""

from __future__ import annotations

import asyncio

import pytest

from agent.weight_checks import PausedEngines, compare_checksums, lacks_read_back, reading
from common.errors import EngineError, EngineRejected
from common.weight_rows import tensor_checksum

CPU = {"device": "cpu", "quantization": None}
GPU = {"device": "cuda", "quantization": None}


def answer(checksums: dict[str, str], tp: int = 1) -> dict:
    return {
        "success": True,
        "ranks": [
            {"checksums": dict(checksums), "per_gpu_checksum": "x", "parallelism_info": {"tp_rank": r, "tp_size": tp}}
            for r in range(tp)
        ],
    }


def test_a_cpu_engine_is_compared_with_the_trainer_and_named_with_the_tensor():
    sent = {"a": "1" * 16, "b": "2" * 16}
    good = reading("http://e0", answer(sent), CPU)
    bad = reading("http://e1", answer({"a": "1" * 16, "b": "f" * 16}), CPU)
    errors, unchecked = compare_checksums({"e0": good}, sent)
    assert errors == {} and unchecked == {}
    errors, _ = compare_checksums({"e1": bad}, sent)
    assert set(errors) == {"e1"}
    assert "'b'" in errors["e1"] and "http://e1" in errors["e1"] and "differ from what the trainer sent" in errors["e1"]


def test_engines_that_cannot_be_compared_with_the_trainer_are_compared_with_each_other():
    sent = {"a": "1" * 16}
    same = {"model.a": "9" * 16, "model.b": "8" * 16}
    torn = {"model.a": "9" * 16, "model.b": "0" * 16}
    readings = {n: reading(f"http://{n}", answer(same), GPU) for n in ("e0", "e1")}
    readings["e2"] = reading("http://e2", answer(torn), GPU)
    errors, unchecked = compare_checksums(readings, sent)
    assert set(errors) == {"e2"}, errors
    assert "'model.b'" in errors["e2"] and "other engines of its layout" in errors["e2"]
    assert unchecked == {}


def test_two_engines_that_disagree_with_no_majority_both_fail():
    readings = {
        "e0": reading("http://e0", answer({"w": "1" * 16}), GPU),
        "e1": reading("http://e1", answer({"w": "2" * 16}), GPU),
    }
    errors, _ = compare_checksums(readings, {"w": "3" * 16})
    assert set(errors) == {"e0", "e1"}
    assert "'w'" in errors["e0"] and "engine e1" in errors["e0"]


def test_an_engine_checked_neither_way_is_reported_with_why():
    for info, tp, why in ((GPU, 1, "device 'cuda'"), ({**CPU, "quantization": "fp8"}, 1, "fp8"), (CPU, 2, "shard")):
        one = {"e0": reading("http://e0", answer({"w": "1" * 16}, tp=tp), info)}
        errors, unchecked = compare_checksums(one, {"w": "2" * 16})
        assert errors == {} and set(unchecked) == {"e0"}
        assert why in unchecked["e0"], unchecked


def test_a_tensor_held_under_another_name_is_not_a_failure_but_not_a_check_either():
    one = {"e0": reading("http://e0", answer({"fused.qkv": "1" * 16}), CPU)}
    errors, unchecked = compare_checksums(one, {"q": "2" * 16})
    assert errors == {} and set(unchecked) == {"e0"}


def test_a_malformed_answer_is_a_clear_error():
    with pytest.raises(EngineError, match="weights_checker: unexpected answer"):
        reading("http://e0", {"success": True}, CPU)


def test_the_trainer_checksum_is_sglangs_cpu_convention():
    torch = pytest.importorskip("torch")
    import hashlib

    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    # sglang.srt.managers.mm_utils.tensor_hash on the CPU, formatted as weight_checker._hash_tensor does
    expected = f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], byteorder='big', signed=False):016x}"
    assert tensor_checksum(t) == expected
    assert tensor_checksum(t.t()) != expected  # the bytes of the tensor as laid out, not its values' set


def test_a_missing_read_back_route_is_told_from_a_refused_read():
    assert lacks_read_back(EngineRejected("x: HTTP 400: Get parameter by name failed", status=400))
    assert lacks_read_back(EngineRejected("x: HTTP 404: Not Found", status=404))
    assert not lacks_read_back(EngineRejected("x: HTTP 400: truncate_size must be an integer", status=400))


def test_paused_engines_hold_aborts_until_continued():
    async def main():
        paused = PausedEngines()
        assert await paused.wait_released("http://e0", 0.01)  # never paused: at once
        paused.hold("http://e0")
        assert not await paused.wait_released("http://e0", 0.01)
        waiter = asyncio.ensure_future(paused.wait_released("http://e0", 5))
        await asyncio.sleep(0)
        paused.release("http://e0")
        assert await waiter
        assert not paused.paused("http://e0")

    asyncio.run(main())
