"""The calculator as an agent loop in plain ``openai`` client code: tools schema, ``tool_calls``, ``tool`` messages.

Run it with ``coordinator serve --generate examples.tools.openai_calculator:rollout`` (the GRPO example's
``--task openai-calculator`` does). Nothing here is rollfleet's but the two names the engine handle gives:
the client talks to the sample's OpenAI-compatible endpoint (``engine.openai_base_url``), which renders each
call with the model's chat template, generates it on the group's engine and records it. The function
returns None: the recording is the sample, and ``--reward`` scores it::

    user:       23+48=
    assistant:  <tool_call>{"name": "calc", "arguments": {"expression": "23+48"}}</tool_call>   (trained)
    tool:       71                                                                              (mask 0)
    assistant:  \\boxed{71}                                                                      (trained)
"""

from __future__ import annotations

import json

from examples.tools.calculator import calculate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
MAX_CALLS = 2


async def rollout(task, engine) -> None:
    import openai

    messages = [{"role": "user", "content": task.prompt}]
    async with openai.AsyncOpenAI(base_url=engine.openai_base_url, api_key=engine.openai_api_key) as client:
        for _ in range(MAX_CALLS + 1):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or response.choices[0].finish_reason == "length":
                break
            for call in message.tool_calls:
                try:
                    expression = str(json.loads(call.function.arguments).get("expression", ""))
                except ValueError:
                    expression = ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return None
