"""An agent written against the plain ``openai`` package, trained unchanged through the gateway.

The task: add two numbers with an ``add`` tool. The agent keeps its own history, as harnesses do: it
asks, runs every tool call the model makes and sends back the result, nudges once when the model
answers without the tool, and stops at an answer or after ``MAX_CALLS`` calls. The reward is 1.0 for
the right sum in the final answer, 0.5 for a correct ``add`` call alone.

    --custom-generate-function-path rollouts.agent.generate \
    --agent-function-path examples/openai_agent/agent.py:run_agent

Nothing here knows about training: ``base_url`` could be any OpenAI-compatible server.
"""

import json
import os
import re

from openai import AsyncOpenAI

MAX_CALLS = 3
SYSTEM = "You are a calculator. Use the add tool to add numbers, then answer with the number only."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers and return the sum.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(arguments: str) -> str:
    """The tool: the sum of ``a`` and ``b``, or what was wrong with the call."""
    try:
        values = json.loads(arguments)
        return str(int(values["a"]) + int(values["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {type(e).__name__}: {e}"


async def run_agent(base_url: str, sample, args) -> dict:
    api_key = getattr(args, "gateway_api_key", None) or os.environ.get("OPENAI_API_KEY", "EMPTY")
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = sample["prompt"] if isinstance(sample, dict) else sample.prompt
    label = int(sample["label"] if isinstance(sample, dict) else sample.label)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    good_call = False
    answer = ""
    async with client:
        for call in range(MAX_CALLS):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=48
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if message.tool_calls:
                for tool_call in message.tool_calls:
                    result = add(tool_call.function.arguments) if tool_call.function.name == "add" else "unknown tool"
                    good_call = good_call or result == str(label)
                    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
                continue
            answer = message.content or ""
            if call == 0:
                messages.append({"role": "user", "content": "Use the add tool first, then give the number."})
                continue
            break
    numbers = re.findall(r"-?\d+", answer)
    reward = 1.0 if numbers and int(numbers[-1]) == label else 0.5 if good_call else 0.0
    return {"reward": reward, "good_tool_call": float(good_call)}
