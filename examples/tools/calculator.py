"""A multi-turn generate function with a tool: a calculator the model calls mid-generation.

Run it with ``coordinator serve --generate examples.tools.calculator:rollout`` (the GRPO example's
``--task calculator`` does). The model writes ``calc(23+48)``; generation stops at the ``)`` (a
stop token), the calculator's answer ``=71`` is appended as tokens the model did not generate
(loss mask 0), and generation continues after it, until EOS, the budget or ``MAX_CALLS`` calls::

    23+48=  ->  calc(23+48) =71 \\boxed{71}<eos>
               ^ model      ^ tool  ^ model

``max_new_tokens`` bounds the model's tokens over all turns; the tool's do not count. A call that
is not an expression of integers and ``+ - *`` gets ``=?``. Engine calls go through the agent's
pool (common/generation.py): a turn cut by a weight update is continued on the new weights.
"""

from __future__ import annotations

import re

from common.generation import RolloutTask, Trajectory

CALL_END = ord(")")
"""The byte token that ends a call (the byte-level tokenizer of ``agent make-model``: ids are bytes)."""
MAX_CALLS = 2
_CALL = re.compile(r"calc\(([^()]*)\)$")
_EXPR = re.compile(r"^\s*-?\d{1,6}(\s*[-+*]\s*-?\d{1,6}){0,3}\s*$")


def calculate(expression: str) -> str:
    """The tool: the value of ``expression`` (integers, ``+ - *``), or ``?``."""
    if not _EXPR.match(expression):
        return "?"
    return str(eval(expression, {"__builtins__": {}}, {}))  # checked above: digits, + - * and spaces only


def tool_output(text: str) -> str | None:
    """What the tool appends after a turn ending in a call (``=71``), or None when the turn made no call."""
    match = _CALL.search(text)
    return None if match is None else f"={calculate(match.group(1))}"


async def rollout(task: RolloutTask, engine) -> Trajectory:
    traj = Trajectory()
    budget = task.sampling["max_new_tokens"]
    calls = 0
    while traj.generated < budget:
        turn = await engine.generate(
            task.prompt_tokens + traj.tokens, max_new_tokens=budget - traj.generated, stop_token_ids=[CALL_END]
        )
        traj.add(turn)
        if turn.finish_reason != "stop" or not turn.tokens or turn.tokens[-1] != CALL_END or calls == MAX_CALLS:
            break  # EOS, the budget, or no more calls allowed
        result = tool_output(engine.decode(turn.tokens))
        if result is None:
            break
        calls += 1
        traj.insert(await engine.encode(result), result)
    traj.metadata["tool_calls"] = calls
    return traj
