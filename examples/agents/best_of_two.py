"""An agent whose calls run at once: an answer, then a critique and a retry of it side by side
(`asyncio.gather`), each continued once more.

    gspo train --task arithmetic --env examples/agents/best_of_two.py:rollout

Each branch is a sequence of its own, trained with the episode's reward (docs/agents.md, "Call
graphs"); the task's rewards score the last call to begin.
"""

import asyncio


def _said(response) -> dict:
    return response.choices[0].message.model_dump(exclude_none=True)


async def rollout(client, example) -> float:
    messages = list(example.prompt) if isinstance(example.prompt, list) else [
        {"role": "user", "content": example.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    base = messages + [_said(first)]

    async def branch(ask: str):
        m = base + [{"role": "user", "content": ask}]
        r = await client.chat.completions.create(model="policy", messages=m)
        m += [_said(r), {"role": "user", "content": "The answer, as a number only."}]
        await client.chat.completions.create(model="policy", messages=m)

    await asyncio.gather(branch("Check it step by step."), branch("Try again."))
    return 0.0
