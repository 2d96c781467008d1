"""Guess-the-number as a verifiers 0.4 taskset and its multi-turn env (taskset id ``vf-guess-fixture``).

The library imports a taskset by id as a top-level module, so the tests put this folder on ``sys.path``. The env
opens with the task's prompt; each reply of the ``player`` seat is a guess, answered "higher" or "lower" until it
is right (reward ``solved`` 1.0, recorded by the env) or the seat's ``max_turns`` (4) is spent. A reply "quit" is
answered "sure?", and the task's ``@vf.stop`` ``gave_up`` then ends the exchange; any other reply that is not a
number makes the env raise ValueError. The task's own reward ``brevity`` (weight 0.5) is 1 / turns, or raises
ZeroDivisionError with the taskset option ``broken_reward``.
"""

from __future__ import annotations

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int


class GuessTaskConfig(vf.TaskConfig):
    broken_reward: bool = False


class GuessTask(vf.Task[GuessData, vf.State, GuessTaskConfig]):
    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 / (0 if self.config.broken_reward else trace.num_turns)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "quit"


class GuessTasksetConfig(vf.TasksetConfig):
    task: GuessTaskConfig = GuessTaskConfig()
    size: int = 6


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            data = GuessData(name=f"guess-{i}", prompt="Guess a number in 0..9.", secret=(3 * i + 4) % 10)
            yield GuessTask(data, self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            while not segment.terminated:
                reply = segment.last_reply
                if reply == "quit":
                    answer = "sure?"
                elif int(reply) == task.data.secret:
                    game.trace.record_reward("solved", 1.0)
                    break
                else:
                    answer = "higher" if int(reply) < task.data.secret else "lower"
                segment = await game.turn(answer)


__all__ = ["GuessEnv", "GuessTaskset"]
