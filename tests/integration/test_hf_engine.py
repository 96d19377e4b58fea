"""Tests of agent.hf: a real (tiny) model behind the SGLang API, seen as a client sees it.

The SGLang-contract tests shared with the sim engine run against both engines in
test_sim_engine.py (``serve_engine``); here are the hf engine's own guarantees: its logprobs are
the model's (a plain forward pass recomputes them) while requests join and leave one batch, also
after weight updates by broadcast and from disk; concurrent requests really are batched; its
finish rules; the process and its CLI.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from harness.polling import wait_for_async
from tests.integration.conftest import serve_hf
from tests.integration.test_sim_weights import GROUP, formed_group, send_bucket

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EOS = 257

pytestmark = pytest.mark.timeout(120)


async def gen(session, payload, status=200):
    async with session.post("/generate", json=payload) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


async def server_info(session) -> dict:
    async with session.get("/server_info") as resp:
        assert resp.status == 200
        return await resp.json()


async def leave_group(session) -> None:
    async with session.post("/destroy_weights_update_group", json={"group_name": GROUP}) as r:
        assert r.status == 200


def reference_model(path: str):
    from agent.hf.model import load_model

    model, _ = load_model(path)
    return model


def max_logprob_diff(model, pairs) -> float:
    """Max |engine logprob - recomputed logprob| over ``(prompt ids, response object)`` pairs."""
    worst = 0.0
    with torch.no_grad():
        for prompt, out in pairs:
            ids = out["output_ids"]
            engine = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
            assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == ids
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            worst = max(worst, float((ref - engine).abs().max()))
    return worst


async def sample_concurrently(session, engine, seed: int) -> list[tuple[list[int], dict]]:
    """Requests of different prompt lengths and budgets, a second wave joining while the first runs."""
    long_wave = [[(7 * i + j + seed) % 256 for j in range(5 + 9 * i)] for i in range(6)]
    short_wave = [[(3 * i + j + seed) % 256 for j in range(2 + 4 * i)] for i in range(10)]

    async def one(prompt, budget, n=1):
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": budget, "temperature": 1.0, "n": n, "ignore_eos": True},
            "return_logprob": True,
        }
        out = await gen(session, body)
        return [(prompt, o) for o in (out if n > 1 else [out])]

    first = [asyncio.create_task(one(p, 120, n=2 if i == 0 else 1)) for i, p in enumerate(long_wave)]
    await wait_for_async(lambda: engine.scheduler.steps >= 5, 30, "the first wave decoding")
    second = [asyncio.create_task(one(p, 5 + 3 * i)) for i, p in enumerate(short_wave)]
    pairs = []
    for task in first + second:
        pairs += await task
    return pairs


async def test_logprobs_match_a_recompute_while_requests_join_and_leave_the_batch(hf_model_dir):
    async with serve_hf(hf_model_dir) as (engine, s):
        pairs = await sample_concurrently(s, engine, seed=0)
        assert len(pairs) == 17
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for _, o in pairs)
        # Short requests joined the running long ones and left before them: one batch, not one per request.
        info = (await server_info(s))["hf"]
        assert info["max_batch"] >= 8
        assert info["decode_steps"] < sum(len(o["output_ids"]) for _, o in pairs) / 4
        assert max_logprob_diff(reference_model(hf_model_dir), pairs) < 1e-3


async def test_sixteen_concurrent_requests_run_as_one_batch(hf_model_dir):
    async with serve_hf(hf_model_dir) as (engine, s):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
        outs = await asyncio.gather(*(gen(s, body) for _ in range(16)))
        assert all(len(o["output_ids"]) == 30 for o in outs)
        assert (await server_info(s))["hf"]["max_batch"] > 1


async def test_weight_updates_by_broadcast_and_from_disk_change_the_model_and_keep_logprobs_exact(
    hf_model_dir, tmp_path
):
    reference = reference_model(hf_model_dir)
    async with serve_hf(hf_model_dir) as (engine, s):
        async with s.get("/model_info") as r:
            info = await r.json()
        assert info["tokenizer_path"] == str(Path(hf_model_dir).resolve())
        digest0 = info["weight_digest"]
        greedy = {
            "input_ids": [72, 105],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }
        before = (await gen(s, greedy))["output_ids"]

        # Broadcast: every parameter, perturbed, in two buckets over gloo.
        torch.manual_seed(1)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        named = {n: p.detach().clone() for n, p in reference.named_parameters()}
        names = list(named)
        async with formed_group([s]) as pg:
            for bucket in (names[: len(names) // 2], names[len(names) // 2 :]):
                [(status, body)] = await send_bucket(pg, [s], {n: named[n] for n in bucket}, weight_version="v1")
                assert (status, body["success"]) == (200, True), body
        await leave_group(s)
        async with s.get("/model_info") as r:
            info = await r.json()
        from common.weights_digest import weights_digest

        assert info["weight_version"] == "v1"
        assert info["weight_digest"] == weights_digest(named.items()) != digest0
        assert (await gen(s, greedy))["output_ids"] != before
        # What a verified update reads back: a parameter's first rows, exactly as sent.
        async with s.post("/get_weights_by_name", json={"name": names[-1], "truncate_size": 2}) as r:
            assert await r.json() == named[names[-1]][:2].float().tolist()
        async with s.post("/get_weights_by_name", json={"name": "no.such.weight"}) as r:
            assert (r.status, await r.json()) == (400, {"error": {"message": "Get parameter by name failed"}})
        # SGLang's /weights_checker: every parameter's CPU checksum, in the engine's dtype (fp32 here).
        from common.weight_rows import tensor_checksum

        async with s.post("/weights_checker", json={"action": "checksum"}) as r:
            [rank] = (await r.json())["ranks"]
        assert {n: rank["checksums"][n] for n in names} == {n: tensor_checksum(t) for n, t in named.items()}
        assert not any("inv_freq" in n for n in rank["checksums"])  # non-persistent buffers are skipped
        si = await server_info(s)
        assert (si["device"], si["quantization"], info["architectures"]) == ("cpu", None, ["LlamaForCausalLM"])
        pairs = await sample_concurrently(s, engine, seed=1)
        assert max_logprob_diff(reference, pairs) < 1e-3

        # A bucket naming no parameter, or a wrong shape: SGLang's failure, and the weights stay.
        async with formed_group([s]) as pg:
            for bad in ({"no.such.weight": torch.zeros(2)}, {names[0]: torch.zeros(3, 3)}):
                [(status, body)] = await send_bucket(pg, [s], bad)
                assert status == 400 and body["message"].startswith("Failed to update parameter online:"), body
        await leave_group(s)
        async with s.get("/model_info") as r:
            assert (await r.json())["weight_digest"] == info["weight_digest"]

        # From disk: another perturbation saved as a Hugging Face checkpoint (no lm_head: tied).
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.7)
        reference.save_pretrained(str(tmp_path / "step2"), safe_serialization=True)
        async with s.post(
            "/update_weights_from_disk", json={"model_path": str(tmp_path / "step2"), "weight_version": "v2"}
        ) as r:
            assert r.status == 200, await r.text()
        async with s.get("/model_info") as r:
            info2 = await r.json()
        assert info2["weight_version"] == "v2" and info2["weight_digest"] not in (digest0, info["weight_digest"])
        assert info2["tokenizer_path"] == info["tokenizer_path"]  # still the launch directory
        pairs = await sample_concurrently(s, engine, seed=2)
        assert all(o["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": len(o["output_ids"])}]
                   for _, o in pairs)  # fmt: skip
        assert max_logprob_diff(reference, pairs) < 1e-3

        # A checkpoint with a foreign tensor: 400, nothing changes.
        torch.save({"model.norm.weight": torch.zeros(192), "extra": torch.zeros(1)}, tmp_path / "weights.pt")
        async with s.post("/update_weights_from_disk", json={"model_path": str(tmp_path)}) as r:
            assert r.status == 400 and "not parameters of the model" in (await r.json())["message"]
        async with s.get("/model_info") as r:
            assert (await r.json())["weight_digest"] == info2["weight_digest"]


async def test_an_nccl_group_is_refused_on_a_cpu_engine_with_what_to_do_instead(hf_model_dir):
    from tests.integration.test_sim_weights import free_port, post

    async with serve_hf(hf_model_dir, device="cpu") as (engine, s):
        body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "nccl"}  # fmt: skip
        status, out = await post(s, "/init_weights_update_group", body)
        assert status == 400 and out["success"] is False, out
        assert "needs the model on a CUDA device" in out["message"] and "--device cuda" in out["message"], out
        assert (await server_info(s))["hf"]["weight_groups"] == []  # nothing was joined
        status, out = await post(s, "/init_weights_update_group", {**body, "backend": "mpi"})
        assert status == 400 and "'mpi' is not available in rollfleet-hf" in out["message"], out


async def test_sampling_and_finish_rules(hf_model_dir):
    async with serve_hf(hf_model_dir) as (engine, s):
        prompt = list(b"The answer is")

        async def tokens(sp, **extra):
            out = await gen(s, {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, **extra})
            return out

        greedy = await tokens({"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
        again = await tokens({"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
        assert greedy["output_ids"] == again["output_ids"]
        top1 = await tokens({"max_new_tokens": 20, "temperature": 1.5, "top_k": 1, "ignore_eos": True})
        assert top1["output_ids"] == greedy["output_ids"]
        seeded = [await tokens({"max_new_tokens": 20, "sampling_seed": 5, "ignore_eos": True}) for _ in range(2)]
        assert seeded[0]["output_ids"] == seeded[1]["output_ids"]

        # A stop token: the first output token of the greedy run ends it at once.
        first = greedy["output_ids"][0]
        out = await tokens({"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [first]})
        assert out["output_ids"] == [first] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        # ...unless min_new_tokens masks it, or ignore_eos ignores it.
        out = await tokens({"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 3})
        assert out["output_ids"][0] != first and len(out["output_ids"]) >= 3
        out = await tokens({"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [first], "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}

        # A stop string drawn from the greedy text: output_ids keep it, text stops before it.
        text = greedy["text"]
        stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].isprintable())
        out = await tokens({"max_new_tokens": 20, "temperature": 0, "stop": [stop], "ignore_eos": True})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in out["text"] and (out["text"] + stop) in text

        # A budget of 0 gives no token.
        out = await tokens({"max_new_tokens": 0})
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

        # Prompt logprobs and token texts.
        out = await tokens({"max_new_tokens": 4, "ignore_eos": True}, logprob_start_len=0, return_text_in_logprobs=True)
        lps = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in lps] == prompt and lps[0][0] is None and all(lp < 0 for lp, _, _ in lps[1:])
        texts = [(t, text) for _, t, text in out["meta_info"]["output_token_logprobs"] + lps]
        assert all(text == chr(t) for t, text in texts if t < 128) and all(isinstance(x, str) for _, x in texts)

        # Out of the model's vocabulary, or past its context length: 400.
        err = await gen(s, {"input_ids": [1, 300]}, status=400)
        assert "outside the vocabulary [0, 259)" in err["error"]["message"]
        await gen(s, {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, status=400)


# --------------------------------------------------------------------------- process and CLI


def test_process_serves_prints_its_line_and_crashes_on_request(hf_model_dir):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.hf",
            "--model-path",
            hf_model_dir,
            "--threads",
            "1",
            "--crash-after-requests",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        m = re.fullmatch(r"rollfleet-hf listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")

        async def two_requests():
            async with aiohttp.ClientSession(m.group(1)) as s:
                async with s.get("/health_generate") as r:
                    assert r.status == 200
                for _ in range(2):
                    await gen(s, {"text": "hi", "sampling_params": {"max_new_tokens": 3}})

        asyncio.run(two_requests())
        assert proc.wait(20) == 17
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()

    bad = subprocess.run(
        [sys.executable, "-m", "agent.hf", "--model-path", str(ROOT / "no-such-model")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no config.json" in bad.stderr


def test_make_model_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "make-model", str(tmp_path / "m"), "--layers", "1", "--hidden-size", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["layers"] == 1 and summary["hidden_size"] == 64
    assert (tmp_path / "m" / "config.json").is_file()
