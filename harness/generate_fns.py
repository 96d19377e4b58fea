"""Generate functions the tests run on real agents (``--generate harness.generate_fns:NAME``).

``two_turns`` is the shape of a tool-using rollout on the sim engine: a first turn cut at a quarter of the
budget, a tool's output inserted (loss mask 0), and a second turn continuing after it with what is
left of the budget. ``two_turns_sync`` is the same as a plain function (it runs in a worker thread).
The others misbehave on purpose.
"""

from __future__ import annotations

from common.generation import RolloutTask, Trajectory

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
