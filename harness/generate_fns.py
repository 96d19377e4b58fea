"""Generate functions the tests run on real agents (``--generate harness.generate_fns:NAME``).

``two_turns`` is the shape of a tool-using rollout on the sim engine: a first turn cut at a quarter of the
budget, a tool's output inserted (loss mask 0), and a second turn continuing after it with what is
left of the budget. ``two_turns_sync`` is the same as a plain function (it runs in a worker thread).
The others misbehave on purpose.

``openai_*`` are harnesses written against the ``openai`` package, run on the sample's OpenAI endpoint
(``engine.openai_base_url``): a calculator tool loop (async, sync, streamed or not), the same at temperature 0
checked against the engine's own logprobs, the refusals the endpoint must give (``openai_probes``), and
``openai_two_turns``, ``two_turns`` through the client. ``chaos_turns`` (the chaos run's) makes even samples
with ``two_turns`` and odd ones with ``openai_two_turns``.
"""

from __future__ import annotations

import asyncio
import logging

from common.generation import RolloutTask, Trajectory

log = logging.getLogger("rollfleet.harness")

TOOL_TEXT = " [tool: done] "  # no digits: the math reward reads the last number in the response


async def two_turns(task: RolloutTask, engine) -> Trajectory:
    budget = task.sampling["max_new_tokens"]
    first = await engine.generate(task.prompt_tokens, max_new_tokens=max(1, budget // 4))
    traj = Trajectory(metadata={"turns": 1}).add(first)
    if first.finish_reason != "length" or budget - traj.generated <= 0:
        return traj
    traj.insert(await engine.encode(TOOL_TEXT), TOOL_TEXT)
    second = await engine.generate(task.prompt_tokens + traj.tokens, max_new_tokens=budget - traj.generated)
    traj.add(second)
    traj.metadata["turns"] = 2
    return traj


def two_turns_sync(task: RolloutTask, engine) -> Trajectory:
    budget = task.sampling["max_new_tokens"]
    first = engine.generate(task.prompt_tokens, max_new_tokens=max(1, budget // 4))
    traj = Trajectory(metadata={"turns": 1, "sync": True}).add(first)
    if first.finish_reason != "length" or budget - traj.generated <= 0:
        return traj
    traj.insert(engine.encode(TOOL_TEXT), TOOL_TEXT)
    traj.add(engine.generate(task.prompt_tokens + traj.tokens, max_new_tokens=budget - traj.generated))
    traj.metadata["turns"] = 2
    return traj


async def scored(task: RolloutTask, engine) -> dict:
    """A dict instead of a Trajectory, with its own reward (the sample index): the coordinator's reward is not used."""
    out = await engine.generate(task.prompt_tokens)
    return {"tokens": out.tokens, "logprobs": out.logprobs, "reward": float(task.sample), "text": out.text}


async def raises(task: RolloutTask, engine):
    raise ValueError(f"no tool for row {task.index}")


async def mismatched(task: RolloutTask, engine) -> dict:
    out = await engine.generate(task.prompt_tokens)
    return {"tokens": out.tokens, "logprobs": out.logprobs[:-1]}


# ---------------------------------------------------------------------- through the OpenAI client
#
# Agent harnesses written for the OpenAI API, run unchanged on the sample's endpoint
# (engine.openai_base_url, agent/openai_server.py). They return None or {"metadata": ...}: the endpoint's
# recording is the sample. The metadata carries what the tests check the recording against.

CALC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
FOLLOW_UP = "Go on."  # no digits: the math reward reads the last number in the response


def _first_messages(task: RolloutTask) -> list[dict]:
    if isinstance(task.prompt, list):
        return [dict(m) for m in task.prompt]
    return [{"role": "user", "content": str(task.prompt)}]


def _tool_result(call) -> str:
    import json

    from examples.tools.calculator import calculate

    try:
        return calculate(str(json.loads(call.function.arguments).get("expression", "")))
    except ValueError:
        return "?"


def _stream_to_message(chunks) -> tuple[dict, list[float], str]:
    """A streamed reply put back together: the message, its logprobs, its finish reason."""
    content, calls, logprobs, reason = "", {}, [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                slot = calls.setdefault(
                    call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] = call.id or slot["id"]
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
            reason = choice.finish_reason or reason
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, logprobs, reason


def _reply(response) -> tuple[dict, list[float], str]:
    choice = response.choices[0]
    logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else []
    return choice.message.model_dump(exclude_none=True), logprobs, choice.finish_reason


def _tool_loop_step(messages: list[dict], message: dict, reason: str) -> bool:
    """Append the reply and what answers it (tool results, or a follow-up); False when the loop is over."""
    messages.append(message)
    if reason == "tool_calls":
        from openai.types.chat import ChatCompletionMessageToolCall

        for call in message["tool_calls"]:
            call = ChatCompletionMessageToolCall.model_validate(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
        return True
    return False


async def openai_tools(task: RolloutTask, engine, *, stream: bool = False, temperature: float | None = None):
    """A tool loop in plain ``openai.AsyncOpenAI`` code: the model calls ``calc``, gets its result, answers."""
    import openai

    messages = _first_messages(task)
    seen: list[list[float]] = []  # per turn
    extra = {} if temperature is None else {"temperature": temperature}
    try:
        async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
            for _ in range(4):
                response = await client.chat.completions.create(
                    model="policy", messages=messages, tools=CALC_TOOLS, logprobs=True, stream=stream, **extra
                )
                message, logprobs, reason = (
                    _stream_to_message([c async for c in response]) if stream else _reply(response)
                )
                seen.append(logprobs)
                if not _tool_loop_step(messages, message, reason):
                    break
    except asyncio.CancelledError:
        log.warning("openai harness of row %d sample %d cancelled after %d call(s)", task.index, task.sample, len(seen))
        raise
    return {"metadata": {"messages": messages, "client_logprobs": seen, "stream": stream, "sync": False}}


async def openai_tools_stream(task: RolloutTask, engine):
    return await openai_tools(task, engine, stream=True)


def openai_tools_sync(task: RolloutTask, engine, *, stream: bool = False):
    """The same loop with the blocking ``openai.OpenAI`` client (a sync function: it runs in a worker thread)."""
    import openai

    messages = _first_messages(task)
    seen: list[list[float]] = []  # per turn
    with openai.OpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        for _ in range(4):
            response = client.chat.completions.create(
                model="policy", messages=messages, tools=CALC_TOOLS, logprobs=True, stream=stream
            )
            message, logprobs, reason = _stream_to_message(response) if stream else _reply(response)
            seen.append(logprobs)
            if not _tool_loop_step(messages, message, reason):
                break
    return {"metadata": {"messages": messages, "client_logprobs": seen, "stream": stream, "sync": True}}


def openai_tools_sync_stream(task: RolloutTask, engine):
    return openai_tools_sync(task, engine, stream=True)


async def openai_greedy_checked(task: RolloutTask, engine):
    """The tool loop at temperature 0, then each turn asked of the engine directly with the same tokens: the
    logprobs the OpenAI client saw must be the engine's (``metadata["engine_logprobs"]``, per turn, as long as
    the client's: the direct call's budget is the whole sample's)."""
    from agent.chat_render import render_bytes
    from agent.openai_session import normalize

    out = await openai_tools(task, engine, temperature=0.0)
    messages = out["metadata"]["messages"]
    direct: list[list[float]] = []
    turns = iter(out["metadata"]["client_logprobs"])
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            ids = render_bytes(normalize(messages[:i]), CALC_TOOLS, True)
            direct.append((await engine.generate(ids, temperature=0.0)).logprobs[: len(next(turns))])
    out["metadata"]["engine_logprobs"] = direct
    return out


async def openai_two_turns(task: RolloutTask, engine):
    """``two_turns`` through the OpenAI client: a first turn cut at a quarter of the budget, then a tool's
    result (if the model called one) or a user's follow-up, then a second turn with the rest of the budget."""
    import openai

    budget = task.sampling["max_new_tokens"]
    messages = _first_messages(task)
    async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        first = await client.chat.completions.create(
            model="policy", messages=messages, tools=CALC_TOOLS, max_tokens=max(1, budget // 4)
        )
        message, _, reason = _reply(first)
        if not _tool_loop_step(messages, message, reason):
            messages.append({"role": "user", "content": FOLLOW_UP})
        await client.chat.completions.create(model="policy", messages=messages, tools=CALC_TOOLS)
    return {"metadata": {"turns": 2, "openai": True}}


async def chaos_turns(task: RolloutTask, engine):
    """The chaos run's samples: even ones by ``two_turns`` (engine.generate), odd ones by ``openai_two_turns``."""
    if task.sample % 2:
        return await openai_two_turns(task, engine)
    return await two_turns(task, engine)


def _refusal(exc) -> list:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body) if isinstance(body.get("error", body), dict) else {}
    return [exc.status_code, type(exc).__name__, error.get("message", "")]


async def openai_probes(task: RolloutTask, engine):
    """Calls the endpoint must refuse (a wrong key, an unknown sample, ``n=2``, a rewritten history) around one
    real call; returns the refusals and the endpoint's credentials (the test tries them after the lease)."""
    import openai

    url, key = engine.openai_base_url, engine.openai_api_key
    probes: dict = {}
    messages = _first_messages(task)
    attempts = {
        "wrong_key": (url, "rf-wrong", {}),
        "unknown": (url.rsplit("/", 1)[0] + "/no-such-sample", key, {}),
        "n": (url, key, {"n": 2}),
    }
    for name, (base, api_key, extra) in attempts.items():
        async with openai.AsyncOpenAI(base_url=base, api_key=api_key, max_retries=0) as client:
            try:
                await client.chat.completions.create(model="policy", messages=messages, **extra)
            except openai.APIStatusError as exc:
                probes[name] = _refusal(exc)
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
        probes["models"] = [m.id async for m in client.models.list()]
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        rewritten = [{"role": "user", "content": "something else"}, reply.choices[0].message.model_dump(),
                     {"role": "user", "content": FOLLOW_UP}]  # fmt: skip
        try:
            await client.chat.completions.create(model="policy", messages=rewritten)
        except openai.BadRequestError as exc:
            probes["rewritten"] = _refusal(exc)
    return {"metadata": {"probes": probes, "base_url": url, "api_key": key}}


async def openai_completions(task: RolloutTask, engine):
    """Two ``/completions`` calls, the second streamed, its prompt the first's with the completion and a follow-up."""
    import openai

    prompt = str(task.prompt)
    async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        first = (await client.completions.create(model="policy", prompt=prompt, max_tokens=8, logprobs=0)).choices[0]
        stream = await client.completions.create(
            model="policy", prompt=prompt + first.text + FOLLOW_UP, max_tokens=16, logprobs=0, stream=True
        )
        chunks = [c.choices[0] async for c in stream if c.choices]
    logprobs = [first.logprobs.token_logprobs, [lp for c in chunks for lp in c.logprobs.token_logprobs]]
    return {"metadata": {"texts": [first.text, "".join(c.text for c in chunks)], "client_logprobs": logprobs}}
