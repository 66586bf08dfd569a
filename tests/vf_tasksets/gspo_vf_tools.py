"""A verifiers taskset with a tool for gspo's tests: the model may call `calc_add`; the reward is
1.0 when the last reply holds the sum."""

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config: AddTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class AddConfig(vf.TasksetConfig):
    task: AddTaskConfig = AddTaskConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        return [AddTask(AddData(idx=i, prompt=f"{i}+{i + 1}=", answer=str(2 * i + 1)), self.config.task)
                for i in range(4)]


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    AddToolset.run()
