"""The calculator task through the OpenAI client (``--task openai-calculator``): two-digit sums, a ``calc`` tool.

The rows and the reward are ``tool_task``'s (``23+48=``, label 71, ``exact`` on the last ``\\boxed{}``); the
rollout is ``examples/tools/openai_calculator.py``, a plain ``openai`` agent loop. The model reads and
writes the chat format of its tokenizer's template (agent/hf/model.py ``CHAT_TEMPLATE``): the prompt is the
user's question after the tool list, and a correct response calls the tool, reads its result (a ``tool``
turn, loss mask 0) and copies it into ``\\boxed{}``. ``teacher`` is that response, for the warm-up.
"""

from __future__ import annotations

from agent.chat_render import render_bytes, tool_call_text
from common.tokenizer import ByteTokenizer
from examples.grpo import tool_task
from examples.grpo.task import reward  # noqa: F401  (the same exact reward)
from examples.grpo.tool_task import pairs, prompt, rows, write_dataset  # noqa: F401  (the same rows)
from examples.tools.calculator import calculate
from examples.tools.openai_calculator import TOOLS

GENERATE = "examples.tools.openai_calculator:rollout"
MAX_NEW_TOKENS = 96
FIRST_WARMUP = {"task": tool_task, "steps": 150, "batch_size": 32}
"""The warm-up begins on the plain calculator task (``tool_task``), where the operands and the tool's result are a
few tokens before the model copies them. Here the operands lie about 70 tokens before the call (the template's
turn change and the call's JSON prefix between) and the result about 25 before the answer. Trained on this
format alone, the tiny model learned to copy the operands into the call after 1,000 steps but the result into
``\\boxed{}`` for under 10% of prompts by step 1,600. After those 150 steps first, the same run had 34% of whole
answers right at step 1,000 and 86% at 1,100 (``scripts/bench/warmup_probe.py`` measures it; greedy decoding,
teacher-forced, 64 prompts, seed 0)."""
WARMUP_STEPS = 1000
"""Stopped while about a third of the greedy answers are right (fewer sampled): GRPO learns the rest."""
WARMUP_BATCH_SIZE = 8
BATCH_SIZE = 16
LR = 1e-4
"""GRPO's defaults for this task: 16 prompts a step (about 25-40 s on 2 cores), and a third of the other tasks'
learning rate: with 8 prompts at 3e-4 the reward fell from 0.19 to 0 in 11 steps."""


def prompt_tokens(a: int, b: int) -> list[int]:
    """The first call's prompt as the endpoint renders it: the tools, the question, the generation prompt."""
    return render_bytes([{"role": "user", "content": prompt(a, b)}], TOOLS, True)


def teacher(a: int, b: int) -> tuple[list[int], list[int]]:
    """The correct conversation after the prompt: tokens and loss mask (the tool's turn and the template's 0)."""
    expression = f"{a}+{b}"
    call = list(tool_call_text({"name": "calc", "arguments": {"expression": expression}}).encode())
    between = [10, *f"<|tool|>\n{calculate(expression)}".encode(), ByteTokenizer.EOS, 10, *b"<|assistant|>\n"]
    answer = list(f"\\boxed{{{a + b}}}".encode())
    tokens = call + [ByteTokenizer.EOS] + between + answer + [ByteTokenizer.EOS]
    mask = [1] * (len(call) + 1) + [0] * len(between) + [1] * (len(answer) + 1)
    return tokens, mask
