"""A multi-turn verifiers environment for gspo's tests: a scripted user asks twice; the reward is
1.0 when the last reply says the second word."""

import verifiers.v1 as vf


class ChatData(vf.TaskData):
    answer: str


class ChatTask(vf.Task[ChatData]):
    @vf.reward(weight=1.0)
    async def said(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class ChatEnv(vf.SingleAgentEnv):
    """Two user turns: the task's prompt, then 'now say <answer>'."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn([vf.UserMessage(content=f"now say {task.data.answer}")])


class ChatTaskset(vf.Taskset[ChatTask, vf.TasksetConfig]):
    def load(self):
        return [ChatTask(ChatData(idx=i, prompt=f"hello {i}", answer=w), self.config.task)
                for i, w in enumerate(["ok", "no", "yes", "go"])]


__all__ = ["ChatTaskset", "ChatEnv"]
