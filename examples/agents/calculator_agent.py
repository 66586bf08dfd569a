"""An agent written only against the OpenAI client: the calculator task's tool loop, as agent code.

    gspo train --task calculator --env examples/agents/calculator_agent.py:rollout

The model gets the problem and a `calculator` tool; while it calls the tool, the agent runs the
call and sends the result back; its last answer is what the task's reward (`exact_integer`)
scores. Nothing here imports gspo's training code: the same function runs against any
OpenAI-compatible server (docs/agents.md).
"""

import json

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers with +, -, * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]


def calculator(expression: str) -> str:
    """The tool: integers, + - * and parentheses only.

    >>> calculator("37*48+12")
    '1788'
    """
    if not expression or set(expression) - set("0123456789+-*() "):
        raise ValueError(f"not an integer expression: {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # only digits, operators and parentheses reach here


async def rollout(client, example, turns: int = 3) -> float:
    messages = list(example.prompt)  # the task's chat prompt: [{"role": "user", "content": "37*48+12="}]
    for _ in range(turns):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break  # an answer
        for call in msg.tool_calls:
            try:
                out = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # a malformed call is the model's to read, as a tool error
                out = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    return 0.0  # the task's reward scores the last answer; this function adds nothing to it
