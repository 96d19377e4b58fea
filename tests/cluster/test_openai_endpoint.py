"""Generate functions written against the ``openai`` package, on a real fleet (agent/openai_server.py).

The harnesses (harness/generate_fns.py ``openai_*``) run a tool loop with ``openai.AsyncOpenAI`` /
``openai.OpenAI``, streaming and not, against ``engine.openai_base_url``, and return None or only
metadata: the endpoint's recording is the sample. Each recorded sample is checked token by token
against the conversation the harness saw, rendered independently in the sim's byte chat format:
the model's tokens under loss mask 1 with the logprobs the client was given, everything else under
0. The usual guarantees hold through the endpoint: weight updates continue a call (two spans), a
killed engine or a pause with abort starts the sample over (the harness is cancelled), nothing is
delivered twice, and a sample's endpoint refuses a wrong key and anything after its lease.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import openai
import pytest

from agent.chat_render import render_bytes
from agent.openai_session import normalize
from common.tokenizer import ByteTokenizer
from harness.generate_fns import CALC_TOOLS, FOLLOW_UP
from harness.polling import wait_for
from tests.cluster.test_faults_agent import engines_of, running_requests
from tests.cluster.test_generate_fns import _versions_of_generated_tokens
from tests.cluster.test_weights import running

EOS = ByteTokenizer.EOS
BUDGET = 400
FAILED = re.compile(r"lease \w+ \(index \d+\) failed|generate_error")  # the agent's line for a failed prompt
SHORT = "--output-len-median 40 --output-len-sigma 0.2"  # answers well inside the budget: turns end at EOS


def openai_cluster(make_cluster, fn: str, *, sim_args: str = SHORT, coordinator=(), **config):
    cluster = make_cluster(generate=f"harness.generate_fns:{fn}", dynamic_filter="none", max_new_tokens=BUDGET,
                           **config)  # fmt: skip
    cluster.start_coordinator(*coordinator)
    cluster.start_agent("a0", concurrency=16, sim_args=sim_args)
    return cluster


def check_recorded(sample) -> int:
    """The sample is the harness's conversation, token for token; returns its tool calls."""
    messages, tools = normalize(sample.metadata["messages"]), CALC_TOOLS
    tokens = sample.prompt_tokens.tolist() + sample.response_tokens.tolist()
    mask, logprobs = sample.loss_mask.tolist(), list(sample.response_logprobs)
    assert len(mask) == len(logprobs) == len(sample.response_tokens)
    # The prompt is the first call's, rendered: the row's question as the harness's first message, with the tools.
    p = len(sample.prompt_tokens)
    assert sample.prompt_tokens.tolist() == render_bytes(messages[:1], tools, True)
    # The recording is the conversation as the template renders it (the sim writes its turns as the template
    # would), up to the end of the last turn, and the model's tokens are exactly the assistant turns.
    rendered = render_bytes(messages, tools, False)
    expected_mask = [0] * len(rendered)
    turns = list(sample.metadata["client_logprobs"])
    assert len(turns) == sum(m["role"] == "assistant" for m in messages)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render_bytes(messages[:i], tools, True))
        end = len(render_bytes(messages[: i + 1], tools, False)) - 2  # the EOS of the turn
        n = len(turns.pop(0))
        assert n in (end - start, end - start + 1)  # the model's EOS is its own token unless cut
        expected_mask[start : start + n] = [1] * n
    last = len(tokens)
    assert tokens == rendered[:last] and last in (len(rendered) - 1, len(rendered) - 2)
    assert mask == expected_mask[p:last]
    # The logprobs under mask 1 are the ones the client was given, in order; the others are 0.0.
    assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == [
        lp for turn in sample.metadata["client_logprobs"] for lp in turn
    ]
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    assert all(-3.0 <= lp < 0 for lp, m in zip(logprobs, mask, strict=True) if m)
    assert sample.metadata["openai_calls"] == len(sample.metadata["client_logprobs"])
    return sum(m["role"] == "tool" for m in messages)


def check_batches(batches, seen: set) -> int:
    tool_calls = 0
    for batch in batches:
        assert len(batch.groups) == 8
        for group in batch.groups:
            assert (group.data_epoch, group.index) not in seen, "a prompt delivered twice"
            seen.add((group.data_epoch, group.index))
            assert len(group.samples) == 4
            for sample in group.samples:
                tool_calls += check_recorded(sample)
    return tool_calls


@pytest.mark.parametrize("fn", ["openai_tools", "openai_tools_stream", "openai_tools_sync", "openai_tools_sync_stream"])
def test_a_tool_loop_through_the_openai_client_is_recorded_token_by_token(make_cluster, fn):
    cluster = openai_cluster(make_cluster, fn)
    with cluster.client() as client:
        batches = [client.generate(i) for i in range(2)]
    seen: set = set()
    assert check_batches(batches, seen) >= 48  # the sim calls the tool for every arithmetic question
    sample = batches[0].groups[0].samples[0]
    assert sample.metadata["sync"] is fn.startswith("openai_tools_sync") and sample.metadata["stream"] is (
        "stream" in fn
    )
    assert "The answer is" in sample.response_text and sample.reward in (0.0, 1.0)


def test_the_logprobs_the_client_gets_are_the_engines(make_cluster):
    cluster = openai_cluster(make_cluster, "openai_greedy_checked")
    with cluster.client() as client:
        batch = client.generate(0)
    check_batches([batch], set())
    for sample in batch.samples:
        client_lps, engine_lps = sample.metadata["client_logprobs"], sample.metadata["engine_logprobs"]
        assert client_lps == engine_lps and len(client_lps) >= 2 and all(client_lps)


@pytest.mark.timeout(240)
def test_a_weight_update_mid_call_continues_it_with_two_spans(make_cluster, tmp_path):
    cluster = openai_cluster(make_cluster, "openai_tools", sim_args=f"{SHORT} --token-latency-ms 25",
                             rollout_batch_size=4)  # fmt: skip
    with cluster.client() as client:
        batches, failures = [], []

        def generate():
            try:
                batches.extend(client.generate(i) for i in range(5))
            except Exception as exc:  # reported by the main thread
                failures.append(exc)

        thread = threading.Thread(target=generate)
        thread.start()
        for version in (1, 2, 3, 4):
            wait_for(lambda: len(batches) >= version and running(cluster) > 0, 60, "samples generating")
            ckpt = tmp_path / f"ckpt{version}"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), version)
        thread.join(180)
        assert not failures, failures
    mixed = 0
    for batch in batches:
        for sample in batch.samples:
            check_recorded(sample)
            versions = _versions_of_generated_tokens(sample)
            mask = sample.loss_mask.tolist()
            assert all((v is not None) == (m == 1) for v, m in zip(versions, mask, strict=True))
            turns, current = [], set()
            for v in [*versions, None]:
                if v is None and current:
                    turns.append(current)
                    current = set()
                elif v is not None:
                    current.add(v)
            mixed += any(len(t) > 1 for t in turns)
    assert mixed > 0, "no call saw a weight update mid-generation: the test did not test it"


def test_a_killed_engine_mid_conversation_starts_the_samples_over(make_cluster):
    cluster = make_cluster(generate="harness.generate_fns:openai_tools", dynamic_filter="none", max_new_tokens=BUDGET)
    cluster.start_coordinator()
    agent = cluster.start_agent("a0", engines=2, concurrency=16, sim_args=f"{SHORT} --token-latency-ms 20")
    seen: set = set()
    with cluster.client() as client:
        check_batches([client.generate(0)], seen)
        url, pid = engines_of(agent)["sim-0"]
        pulling = []
        trainer = threading.Thread(target=lambda: pulling.extend(client.generate(i) for i in range(1, 4)))
        trainer.start()
        # Conversations that already made a call are on sim-0 when it dies (the tool's turn is short).
        wait_for(lambda: running_requests(url) > 0, 30, "calls running on sim-0")
        os.kill(pid, signal.SIGKILL)
        trainer.join(120)
        assert len(pulling) == 3
    check_batches(pulling, seen)
    log = agent.text()
    assert "retrying on another engine" in log
    assert "openai harness of row" in log, "no conversation was cut: the test did not test it"
    assert not FAILED.search(log), "a sample failed instead of starting over"


def test_a_pause_with_abort_cancels_the_harness_and_the_prompts_are_made_again_once(make_cluster):
    cluster = openai_cluster(make_cluster, "openai_tools", sim_args=f"{SHORT} --token-latency-ms 30")
    seen: set = set()
    with cluster.client(timeout=60) as client:
        check_batches([client.generate(0)], seen)
        wait_for(lambda: running(cluster) > 0 and cluster.status()["leased"] > 0, 30, "conversations running")
        client.pause(drain=True, abort=True)
        status = cluster.status()
        # Nothing is leased; a group that finished before the abort reached it is kept, ready for a batch.
        assert status["leased"] == 0, status
        assert running(cluster) == 0, "a cancelled harness's call still runs on the engine"
        client.resume()
        check_batches([client.generate(1), client.generate(2)], seen)
    assert cluster.status()["prompts"]["delivered"] == 24
    log = cluster.agents["a0"].text()
    assert "openai harness of row" in log and "cancelled after" in log  # the harness itself was cancelled
    assert not FAILED.search(log)


def test_a_wrong_key_a_bad_request_and_an_ended_lease_are_refused(make_cluster):
    cluster = openai_cluster(make_cluster, "openai_probes")
    with cluster.client() as client:
        batch = client.generate(0)
    for sample in batch.samples:
        probes = sample.metadata["probes"]
        assert probes["wrong_key"] == [
            401,
            "AuthenticationError",
            "wrong API key for this sample's endpoint (use engine.openai_api_key)",
        ]
        assert probes["unknown"][:2] == [404, "NotFoundError"]
        assert probes["n"] == [400, "BadRequestError", "n must be 1 (one sample is one conversation), got 2"]
        assert (
            probes["rewritten"][:2] == [400, "BadRequestError"]
            and "messages[0] (user) differs" in probes["rewritten"][2]
        )
        assert probes["models"] == ["rollfleet"]
        assert sample.metadata["openai_calls"] == 1
    # After the function returned, its endpoint refuses everything, with the right key too.
    sample = batch.samples[0]
    with openai.OpenAI(base_url=sample.metadata["base_url"], api_key=sample.metadata["api_key"], max_retries=0) as c:
        with pytest.raises(openai.NotFoundError, match="this sample's endpoint has ended"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}])


def test_the_chaos_runs_function_makes_half_the_samples_through_the_openai_client_in_two_turns(make_cluster):
    """``chaos_turns`` with the chaos run's budget and sim: odd samples through the endpoint, two turns each (the
    first cut at a quarter of the budget, a follow-up or a tool's result, then the rest), within the budget."""
    from harness.chaos import SIM_ARGS

    cluster = make_cluster(generate="harness.generate_fns:chaos_turns", dynamic_filter="none", max_new_tokens=48)
    cluster.start_coordinator()
    cluster.start_agent("a0", concurrency=16, sim_args=SIM_ARGS)
    with cluster.client() as client:
        batches = [client.generate(i) for i in range(2)]
    for batch in batches:
        for group in batch.groups:
            for i, sample in enumerate(group.samples):
                mask = sample.loss_mask.tolist()
                assert len(mask) == len(sample.response_tokens) == len(sample.response_logprobs)
                assert sum(mask) <= 48 and mask[0] == 1 and (0 in mask) is (sample.metadata["turns"] == 2)
                assert sample.metadata.get("openai", False) is bool(i % 2)
                if i % 2:
                    assert sample.metadata["openai_calls"] == 2
                    # Two runs of the model's tokens (the turns), the template's and the follow-up's between them.
                    runs = [m for j, m in enumerate(mask) if j == 0 or mask[j - 1] != m]
                    assert runs in ([1, 0, 1], [1, 0])  # a second turn cut at 0 tokens left is empty


# ---------------------------------------------------------------------- usage
#
# Generate functions of the usage test below, here rather than in harness/generate_fns.py: only this test reads
# what they keep (the agent imports them by path, ``tests.cluster.test_openai_endpoint:openai_usage_chat``).


ACCENTED = "Réponds » "  # a prompt whose characters are fewer than its bytes (the sim's tokens)


async def openai_usage_chat(task, engine):
    """The tool loop, streamed with ``stream_options.include_usage`` on even samples and not streamed on odd ones,
    keeping each call's ``usage`` as the client got it and where in the conversation the call was made."""
    from harness.generate_fns import _first_messages, _reply, _stream_to_message, _tool_loop_step

    stream = task.sample % 2 == 0
    messages, calls, seen = _first_messages(task), [], []
    messages[0]["content"] = ACCENTED + messages[0]["content"]
    async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        for _ in range(4):
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=CALC_TOOLS, logprobs=True, stream=stream, **extra
            )
            if stream:
                chunks = [c async for c in response]
                usages = [c.usage.model_dump() for c in chunks if c.usage is not None]
                assert len(usages) == 1 and chunks[-1].usage is not None and not chunks[-1].choices, usages
                message, logprobs, reason = _stream_to_message(chunks)
            else:
                usages = [response.usage.model_dump()]
                message, logprobs, reason = _reply(response)
            calls.append({"at": len(messages), "usage": usages[0]})
            seen.append(logprobs)
            if not _tool_loop_step(messages, message, reason):
                break
    return {"metadata": {"messages": messages, "calls": calls, "client_logprobs": seen, "stream": stream}}


async def openai_usage_completions(task, engine):
    """Two ``/completions`` calls cut at ``max_tokens`` (8, then 16), the second's prompt the first's with its text
    and a follow-up, streamed with ``include_usage`` on even samples; keeps the prompts and each call's ``usage``."""
    stream = task.sample % 2 == 0
    prompts, usages = [ACCENTED + str(task.prompt)], []
    async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        for max_tokens in (8, 16):
            if stream:
                extra = {"stream": True, "stream_options": {"include_usage": True}}
                chunks = [c async for c in await client.completions.create(
                    model="policy", prompt=prompts[-1], max_tokens=max_tokens, **extra)]  # fmt: skip
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                usages += [c.usage.model_dump(exclude_none=True) for c in chunks if c.usage is not None]
            else:
                reply = await client.completions.create(model="policy", prompt=prompts[-1], max_tokens=max_tokens)
                text = reply.choices[0].text
                usages.append(reply.usage.model_dump(exclude_none=True))
            prompts.append(prompts[-1] + text + FOLLOW_UP)
    return {"metadata": {"prompts": prompts[:2], "usages": usages, "stream": stream}}


def test_usage_of_every_call_is_that_calls_own_tokens_streamed_or_not(make_cluster):
    """``usage`` of each call of a conversation (chat, then /completions), compared with that call's tokens
    computed apart from the endpoint: ``prompt_tokens`` the conversation up to the call rendered in the sim's byte
    chat format (or the prompt's bytes: the sim's tokenizer is one token a byte; the prompts start with accented
    characters, so characters are not tokens), ``completion_tokens`` the model's
    tokens of that turn in the recorded sample (loss mask 1 between this call's prompt and the next), and
    ``total_tokens`` their sum. A usage of the first call's prompt, the whole recording or the sample's tokens so
    far, rather than the call's own, fails it."""
    where = "tests.cluster.test_openai_endpoint"
    cluster = make_cluster(generate=f"{where}:openai_usage_chat", dynamic_filter="none", max_new_tokens=BUDGET,
                           rollout_batch_size=2)  # fmt: skip
    cluster.start_coordinator()
    cluster.start_agent("a0", concurrency=16, sim_args=SHORT)
    with cluster.client() as client:
        batch = client.generate(0)
    calls_checked, streamed, later_calls = 0, 0, 0
    for sample in batch.samples:
        check_recorded(sample)
        messages, calls = normalize(sample.metadata["messages"]), sample.metadata["calls"]
        tokens = sample.prompt_tokens.tolist() + sample.response_tokens.tolist()
        mask = [0] * len(sample.prompt_tokens) + sample.loss_mask.tolist()
        starts = [len(render_bytes(messages[: c["at"]], CALC_TOOLS, True)) for c in calls] + [len(tokens)]
        for k, call in enumerate(calls):
            prompt, use = starts[k], call["usage"]
            assert tokens[:prompt] == render_bytes(messages[: call["at"]], CALC_TOOLS, True)[:prompt]
            completion = sum(mask[prompt : starts[k + 1]])
            assert completion == len(sample.metadata["client_logprobs"][k])  # the turn the client was given
            expected = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            assert {key: use[key] for key in expected} == expected, (k, sample.metadata["stream"], use)
            calls_checked += 1
            streamed += sample.metadata["stream"]
            later_calls += k > 0
    assert streamed and calls_checked - streamed, "both streamed and unstreamed calls"
    assert later_calls >= len(batch.samples), "every conversation made more than one call (a tool call)"

    cluster = make_cluster(generate=f"{where}:openai_usage_completions", dynamic_filter="none", max_new_tokens=BUDGET,
                           rollout_batch_size=2)  # fmt: skip
    cluster.start_coordinator()
    cluster.start_agent("a0", concurrency=16, sim_args=SHORT)
    with cluster.client() as client:
        batch = client.generate(0)
    for sample in batch.samples:
        first, second = (len(text.encode()) for text in sample.metadata["prompts"])
        assert second == first + 8 + len(FOLLOW_UP.encode())
        assert sample.metadata["usages"] == [
            {"prompt_tokens": first, "completion_tokens": 8, "total_tokens": first + 8},
            {"prompt_tokens": second, "completion_tokens": 16, "total_tokens": second + 16},
        ], sample.metadata["stream"]


def test_completions_extend_the_recorded_text(make_cluster):
    cluster = openai_cluster(make_cluster, "openai_completions")
    with cluster.client() as client:
        batch = client.generate(0)
    for sample in batch.samples:
        first, second = sample.metadata["texts"]
        assert len(first) == 8 and len(second) == 16  # the sim's answers are longer: both cut at max_tokens
        assert sample.prompt_tokens.tolist() == list(sample.metadata["prompt"].encode())
        assert sample.response_tokens.tolist() == list((first + FOLLOW_UP + second).encode())
        assert sample.loss_mask.tolist() == [1] * 8 + [0] * len(FOLLOW_UP) + [1] * 16
        lps = sample.metadata["client_logprobs"]
        assert list(sample.response_logprobs) == lps[0] + [0.0] * len(FOLLOW_UP) + lps[1]
        assert sample.status == "truncated"
