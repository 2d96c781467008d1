"""A small ``verifiers`` taskset for the verifiers task's tests, written the way the library's own tasksets are:
rows from a ``datasets.Dataset``, a ``TaskData`` with an ``answer`` field, and a ``@vf.reward`` that compares the
last reply's boxed answer (the library's ``extract_boxed_answer``; unboxed text counts whole) with it.

``ArithmeticTaskset`` is also importable as a taskset id (the library's plugin loader) when this folder is on
``sys.path``: its module exports it through ``__all__``.
"""

import asyncio
from typing import Literal

import verifiers.v1 as vf
from datasets import Dataset

SYSTEM_PROMPT = "Put the final answer in \\boxed{}."


class QA(vf.TaskData):
    answer: str


class ArithmeticTaskConfig(vf.TaskConfig):
    mode: Literal["exact", "raise", "hang"] = "exact"
    """``raise``: the reward raises ValueError; ``hang``: it sleeps 3 s before scoring."""


class ArithmeticTask(vf.Task[QA, vf.State, ArithmeticTaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.config.mode == "raise":
            raise ValueError("this reward cannot read the completion")
        if self.config.mode == "hang":
            await asyncio.sleep(3)
        return float(vf.extract_boxed_answer(trace.last_reply).strip() == self.data.answer)


class SandboxTask(ArithmeticTask):
    """A task whose only reward reads the sandbox the agent worked in: nothing to score without one."""

    @vf.reward
    async def correct(self, trace: vf.Trace, runtime) -> float:
        return 1.0


class ArithmeticConfig(vf.TasksetConfig):
    n: int = 20
    first: int = 0
    """Questions are ``{a} + 3`` for a in [first, first + n)."""
    messages: bool = False
    """The prompt as chat messages (a system and a user message) instead of ``system_prompt`` and a text."""
    assistant_in_prompt: bool = False
    sandbox: bool = False
    infinite: bool = False
    task: ArithmeticTaskConfig = ArithmeticTaskConfig()


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def __init__(self, config: ArithmeticConfig) -> None:
        super().__init__(config)
        self.INFINITE = config.infinite

    def load(self):
        c = self.config
        count = 10**6 if c.infinite else c.n
        rows = Dataset.from_list([{"question": f"What is {a} + 3?", "answer": str(a + 3)}
                                  for a in range(c.first, c.first + min(count, 1000))])
        task_cls = SandboxTask if c.sandbox else ArithmeticTask
        for i in range(count):
            row = rows[i % len(rows)]
            if c.messages or c.assistant_in_prompt:
                prompt = [vf.SystemMessage(content=SYSTEM_PROMPT), vf.UserMessage(content=row["question"])]
                if c.assistant_in_prompt:
                    prompt.append(vf.AssistantMessage(content="Let me think."))
                data = QA(prompt=prompt, answer=row["answer"], name=f"row-{i}")
            else:
                data = QA(prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=row["answer"],
                          name=f"row-{i}")
            yield task_cls(data, c.task)


def load_environment(n: int = 20, first: int = 0, mode: str = "exact", **options) -> vf.Taskset:
    """The taskset, as a factory function (the ``env`` option's usual form)."""
    return ArithmeticTaskset(ArithmeticConfig(n=n, first=first, task=ArithmeticTaskConfig(mode=mode), **options))


def load_single_agent_env(**options) -> vf.Env:
    """The library's single-agent env over this taskset (needs this folder on ``sys.path``: a taskset id is a
    top-level module)."""
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=ArithmeticConfig(id="verifiers_envs", **options)))


def not_a_taskset() -> dict:
    return {"question": "What is 1 + 3?", "answer": "4"}


__all__ = ["ArithmeticTaskset"]
