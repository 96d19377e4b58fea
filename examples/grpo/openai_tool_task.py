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
from examples.grpo.task import reward  # noqa: F401  (the same exact reward)
from examples.grpo.tool_task import pairs, prompt, rows, write_dataset  # noqa: F401  (the same rows)
from examples.tools.calculator import calculate
from examples.tools.openai_calculator import TOOLS

GENERATE = "examples.tools.openai_calculator:rollout"
MAX_NEW_TOKENS = 96
WARMUP_STEPS = 800
"""The call's operands lie about 70 tokens before it (the template's turn change and the call's JSON prefix
between), and the tiny model learns to copy across that only after several hundred small steps: with batches
of 8 at lr 1e-3 greedy decoding wrote none of 64 calls right at step 600, 30% at 700, 45% at 800 and all at
1,000 (``scripts/bench/warmup_probe.py``). Batches of 32 learn it no sooner in steps and cost 4 times as much
each. The warm-up stops at 800, with the calls half right, and GRPO learns the rest."""
WARMUP_BATCH_SIZE = 8


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
