"""A single-turn verifiers taskset for gspo's tests: say the word; rewarded 1.0 for exactly that word."""

import verifiers.v1 as vf

WORDS = ["ok", "no", "yes", "on", "so", "to", "go", "do"]


class SayData(vf.TaskData):
    answer: str
    broken: bool = False


class SayTask(vf.Task[SayData]):
    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        if self.data.broken:
            raise ValueError("the rubric is broken")
        return float((trace.last_reply or "").strip() == self.data.answer)


class SayConfig(vf.TasksetConfig):
    count: int = 8
    broken: bool = False  # the reward raises: every episode fails


class SayTaskset(vf.Taskset[SayTask, SayConfig]):
    def load(self):
        return [SayTask(SayData(idx=i, prompt=f"say {w}", answer=w, broken=self.config.broken), self.config.task)
                for i, w in enumerate((WORDS * 4)[: self.config.count])]


__all__ = ["SayTaskset"]
