"""verifiers multi-turn environments as heterorl environments (task ``verifiers_multiturn``).

verifiers 0.4 (``verifiers.v1``) has no ``MultiTurnEnv``, ``env_response`` or ``is_completed`` (the 0.1-0.3 API,
gone with ``verifiers.legacy``). A multi-turn environment is a ``vf.Env`` subclass: its config (a
``vf.EnvConfig``) declares each agent seat as a ``vf.AgentConfig`` field, and its ``run(task, agents)`` is the
control flow between them: ``async with agents.<seat>.interaction(task) as chat``, then ``segment = await
chat.turn(message)`` sends one user turn and returns the seat's reply (``segment.last_reply``;
``segment.terminated`` once a limit or a ``@vf.stop`` ended the exchange); the env records rewards on
``chat.trace``, the task's ``@vf.reward``s score the finished trace, and the env's ``finalize`` judges the
episode. The library plays a seat with a harness program (``bash``, ``null``, ...) in a runtime, whose model
calls go through its interception server to a model endpoint; here heterorl's policy plays it, in process, with
no program, server or network: ``agents.<seat>`` is a `_Seat` whose ``turn`` hands the turn's text to the runner
and returns the policy's next action as the reply.

- **Loading.** The option ``env`` is the library's env block (``{"taskset": {"id": ...}, "id": ..., "<seat>":
  {...}}``), resolved and built as the library does (``vf.resolve_env_config``, ``vf.load_environment``): a
  taskset id names an installed package (or a module on ``sys.path``) that exports its ``Taskset`` (and its
  ``Env``) in ``__all__``. ``seat`` names the seat the policy plays (default: the env's only one).
- **What is refused** when the task is built (`unsupported`): other seats (they need a model), judges, tool
  servers, ``@vf.intercept`` hooks and ``@vf.stop`` hooks on model requests or responses, token caps on the seat,
  tasks with ``setup``/``finalize``/``stage_verifier`` hooks and envs with ``start``/``stop`` (they need a runtime
  or serving resources). **Honoured:** the seat's ``max_turns`` and the task's ``@vf.stop`` hooks on the trace,
  checked before each turn as the library does; a refused turn comes back ``terminated``, unanswered.
- **Rendering** (`render_turn`): the first observation is the task's system prompt, its prompt messages and the
  env's opening turn (a prompt-less task's), each message's text, separated by blank lines (what task
  ``verifiers`` renders for the same prompt); each later observation is the env's next turn between newlines:
  ``"\\nlower\\n"``. The policy's action text is the seat's reply (an ``AssistantMessage``).
- **Rewards.** When the env's ``run`` returns, the trace is scored: the task's rewards (those that need a runtime
  are skipped, as the library skips them offline), then the env's ``finalize`` over the one-trace episode; the
  last step's reward is ``trace.reward``, the weighted sum with the rewards ``run`` recorded, kept as the library
  gives it (not clipped). The scoring is bounded and counted (`GuardedScore`): a reward that raises or overruns
  ``task.reward_timeout_s`` scores 0, counted in ``stats``. The library scores when the interaction closes,
  inside ``run``; here after it, so ``run`` does not see the task's rewards on the trace.
- **Errors.** An exception raised by the env's ``setup`` or ``run`` propagates as it is (the runner counts
  ``episode:error:ValueError``, say); a ``run`` that ends without asking for a turn, opens a second
  conversation, or sends a non-text message is an `EnvContractError`. Either ends the episode with reward 0.
- **Event loop.** ``run`` is one coroutine, suspended between the policy's turns, on the task's `LoopThread` (one
  loop for all its episodes and their scoring, as the library runs every episode of a run on one loop); an
  episode the runner leaves unfinished (its ``max_turns``, its token budget, a timeout) has its ``run``
  cancelled when the runner closes the environment (or, failing that, when it is garbage-collected).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import logging
import weakref
from collections import Counter
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.loop_thread import LoopThread
from heterorl.tasks.base import FixedRows, Problem, check_split_options, held_out_split
from heterorl.tasks.environment import EnvContractError, Environment, StepResult
from heterorl.tasks.guarded import GuardedScore
from heterorl.tasks.verifiers_env import _needs_runtime, import_verifiers

log = logging.getLogger("heterorl.tasks.verifiers_multiturn")
TOKEN_CAPS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")


@dataclass(frozen=True)
class VerifiersMultiTurnConfig:
    """Which env, which seat the policy plays, and how to split the tasks.

    ``env`` is the library's env block (see the module's docstring). The eval set is the tasks of the taskset
    block ``eval_taskset`` when given (a test split; its first ``eval_size`` when that is given too); else
    ``eval_size`` tasks, or ``max(1, int(eval_fraction * tasks))``, held out by shuffling with
    ``random.Random(split_seed)``. Tasks are told apart by the library's ``task.key``; training never draws an
    eval task's. ``max_tasks`` bounds how many tasks are read (required for an infinite taskset).
    """

    env: dict
    seat: str | None = None
    eval_taskset: dict | None = None
    eval_size: int | None = None
    eval_fraction: float = 0.1
    split_seed: int = 0
    max_tasks: int | None = None

    def __post_init__(self) -> None:
        for key in ("env", "eval_taskset"):
            value = getattr(self, key)
            if (value is not None or key == "env") and not isinstance(value, Mapping):
                raise TaskError(f"verifiers_multiturn option {key}={value!r} must be a mapping: the library's env "
                                "block, e.g. {taskset: {id: my-taskset}}")
        if not isinstance(self.env.get("taskset"), Mapping) or not self.env["taskset"].get("id"):
            raise TaskError(f"verifiers_multiturn option env={dict(self.env)!r} needs taskset.id, the installed "
                            "taskset the episodes start from")
        if self.seat is not None and (not isinstance(self.seat, str) or not self.seat):
            raise TaskError(f"verifiers_multiturn option seat={self.seat!r} must be the name of one of the env's "
                            "agent seats, or null for its only one")
        check_split_options("verifiers_multiturn", self, ("eval_size", "max_tasks"))


def _text(message) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    kinds = {getattr(part, "type", type(part).__name__) for part in content} - {"text"}
    if kinds:
        raise EnvContractError(f"the env sent a {message.role} message with {', '.join(sorted(kinds))} content; "
                               "heterorl observations are text")
    return "\n".join(part.text for part in content)


def render_turn(messages, opening: bool) -> str:
    """The text the policy sees for ``messages``: each message's text, separated by blank lines; an opening turn
    (the episode's first observation: system prompt, prompt messages, the env's first message) as it is, a later
    one (the env's answer to the policy) between newlines, ``"\\nlower\\n"``."""
    text = "\n\n".join(_text(m) for m in messages)
    return text if opening else f"\n{text}\n"


def opening_messages(vf, data) -> list:
    """The messages before the env's first turn: the task's system prompt and prompt (none for a prompt-less
    task, which the env opens)."""
    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if data.prompt is None:
        return system
    return system + ([vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt))


class _Chat:
    """The seat's conversation, as ``vf.Interaction`` offers it to an env's ``run``: ``turn`` and ``trace``."""

    def __init__(self, handoff: _Handoff, task, trace, limits, stops: list) -> None:
        self._handoff, self._task, self.trace = handoff, task, trace
        self._limits, self._stops = limits, stops
        self._lock = asyncio.Lock()
        self._started = False
        self._over = False

    async def turn(self, message=None):
        """One user turn (text, messages, or None for a prompted task's opening), answered by the policy; a
        terminated ``vf.Segment`` when the seat's ``max_turns`` or a ``@vf.stop`` ends the exchange."""
        async with self._lock:
            return await self._turn(message)

    async def _turn(self, message):
        vf, data = self._handoff.vf, self._task.data
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self._started and data.prompt is not None
        if (message is None) == (not prompted):
            raise ValueError("a prompted task opens with a bare turn(); every other turn takes a message")
        if await self._refused():
            self._over = True
            return vf.Segment(messages=[], terminated=True)
        messages = self._messages(message)
        opening = not self._started
        if opening:
            messages = opening_messages(vf, data) + messages
            self._started = True
        observation = render_turn(messages, opening)
        for m in messages:
            self._add(m, sampled=False)
        reply = vf.AssistantMessage(content=await self._handoff.ask(observation))
        self._add(reply, sampled=True)
        return vf.Segment(messages=[reply])

    def _messages(self, message) -> list:
        from verifiers.v1.dialects.chat import parse_message

        if message is None:
            return []
        if isinstance(message, str):
            return [self._handoff.vf.UserMessage(content=message)]
        return [parse_message(m) if isinstance(m, dict) else m for m in message]

    async def _refused(self) -> bool:
        """The library's check before a turn (``RolloutSession.refused``): the seat's limits, then the trace's
        ``@vf.stop`` hooks; the first that fires stops the trace under its name."""
        from verifiers.v1.session import call_hook

        trace = self.trace
        if (limit := self._limits.reached(trace)) is not None:
            trace.stop(limit)
            return True
        for stop in self._stops:
            result = await call_hook(stop, {self._handoff.vf.Trace: trace})
            if not isinstance(result, bool):
                raise EnvContractError(f"@vf.stop {stop.__name__} returned {type(result).__name__}; bool expected")
            if result:
                trace.stop(stop.__name__)
                return True
        return False

    def _add(self, message, sampled: bool) -> None:
        nodes = self.trace.nodes
        nodes.append(self._handoff.vf.MessageNode(parent=len(nodes) - 1 if nodes else None, message=message,
                                                  sampled=sampled))

    async def send(self, *args, **kwargs):
        raise NotImplementedError("heterorl's seat takes whole turns (turn()); it cannot be sent or steered into")

    steer = send


class _Handoff:
    """What an episode's ``run`` (on the task's loop) and the runner's calls (in the runner's threads) share: the
    seat's conversation, and the turn in flight: ``ask`` gives the runner an observation (``observation``, a
    future the runner waits on) and awaits the action that `answer` gives it."""

    def __init__(self, vf) -> None:
        self.vf = vf
        self.chat: _Chat | None = None
        self.observation: concurrent.futures.Future = concurrent.futures.Future()
        self._action: asyncio.Future | None = None

    async def ask(self, observation: str) -> str:
        self._action = asyncio.get_running_loop().create_future()
        self.observation.set_result(observation)
        return await self._action

    def answer(self, action: str) -> None:
        """The policy's action for the turn in flight, from a runner's thread."""
        self.observation = concurrent.futures.Future()
        self._action.get_loop().call_soon_threadsafe(self._action.set_result, action)


class _Seat:
    """``agents.<seat>`` for the env's ``run``: one conversation (``interaction``, or ``run`` for one turn)."""

    def __init__(self, handoff: _Handoff, name: str, config) -> None:
        self._handoff, self.name, self.config = handoff, name, config
        self.trainable = True

    @asynccontextmanager
    async def interaction(self, task, *, runtime=None, tools=None, on_trace=None):
        if runtime is not None or tools:
            raise EnvContractError(f"the env gave seat {self.name!r} a runtime or tools; heterorl's seat takes none")
        chat = self._open(task)
        if on_trace is not None:
            on_trace(chat.trace)
        yield chat
        chat.trace.stop("user_closed")  # as the library closes an exchange its user leaves
        chat.trace.ok = True

    async def run(self, task, **kwargs):
        """One segment on the task's prompt: the policy's one reply."""
        async with self.interaction(task, **kwargs) as chat:
            await chat.turn()
        return chat.trace

    def _open(self, task) -> _Chat:
        """The seat's conversation and its trace, as the library's rollout makes them (one an episode)."""
        if self._handoff.chat is not None:
            raise EnvContractError(f"the env opened a second conversation of seat {self.name!r}; heterorl plays one "
                                   "conversation an episode")
        from verifiers.v1.session import RolloutLimits
        from verifiers.v1.state import state_cls

        vf = self._handoff.vf
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=vf.AgentInfo(config=self.config, name=self.name), state=state_cls(type(task))())
        limits = RolloutLimits(max_turns=self.config.max_turns)
        self._handoff.chat = _Chat(self._handoff, task, trace, limits, task.hooks("stop"))
        return self._handoff.chat


class _Agents:
    def __init__(self, seat: _Seat) -> None:
        self._seat = seat

    def __getattr__(self, name: str) -> _Seat:
        seat = self.__dict__.get("_seat")
        if seat is None or name != seat.name:
            raise AttributeError(f"no agent {name!r}; heterorl plays only seat {getattr(seat, 'name', None)!r}")
        return seat


async def _play(env, task, agents: _Agents) -> None:
    await env.setup(agents)
    await env.run(task, agents)


class VerifiersEpisode(Environment):
    """One episode of ``owner``'s env on ``task``: its ``run`` on the task's loop, suspended while the policy
    writes (see the module's docstring)."""

    def __init__(self, owner: VerifiersMultiTurnTask, task) -> None:
        self._owner, self._task = owner, task
        self._handoff = _Handoff(owner.vf)
        self._run: concurrent.futures.Future | None = None

    def close(self) -> None:
        """An unfinished episode's ``run`` cancelled, once the runner has ended it (a bound, a timeout)."""
        if self._run is not None and not self._run.done():
            self._cancel()

    def reset(self, problem: Problem) -> str:
        owner = self._owner
        agents = _Agents(_Seat(self._handoff, owner.seat, owner.seat_config))
        self._run = owner.loop.submit(_play(owner.env, self._task, agents))
        # an episode the runner leaves unfinished has its run cancelled when this environment is collected (the
        # run refers to the handoff, never to the episode, so that it can be)
        self._cancel = weakref.finalize(self, self._run.cancel)
        self._cancel.atexit = False
        observation = self._next()
        if observation is None:
            raise EnvContractError(f"{type(owner.env).__name__}.run() ended without a turn of seat {owner.seat!r}")
        return observation

    def step(self, action: str) -> StepResult:
        self._handoff.answer(action)
        observation = self._next()
        if observation is not None:
            return StepResult(observation)
        return StepResult("", self._owner.score(self._task, self._handoff.chat.trace), True)

    def _next(self) -> str | None:
        """The env's next observation, once ``run`` asks the policy for a turn; None once ``run`` has returned;
        the exception it raised, as it is."""
        observation = self._handoff.observation
        concurrent.futures.wait([observation, self._run], return_when=concurrent.futures.FIRST_COMPLETED)
        if observation.done():
            return observation.result()
        self._run.result()
        return None


def _overrides(obj, base, names) -> list[str]:
    return [name for name in names if getattr(type(obj), name) is not getattr(base, name)]


def unsupported(vf, env, seat: str, task) -> list[str]:
    """What in ``env`` and its first ``task`` heterorl's seat cannot play (see the module's docstring)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    problems = []
    config = getattr(env.config, seat)
    if caps := [f"{cap}={getattr(config, cap)}" for cap in TOKEN_CAPS if getattr(config, cap) is not None]:
        problems.append(f"seat {seat!r} caps tokens ({', '.join(caps)}), which heterorl does not count on a trace: "
                        "bound episodes with rollout.max_tokens and rollout.max_episode_tokens")
    if task.config.judges:
        problems.append(f"task {type(task).__name__} is scored by judges, which call a model")
    if type(task).toolsets(task.config) or type(env.taskset).toolsets(env.taskset.config):
        problems.append("its tasks use tool servers (toolsets), which heterorl's text turns cannot call")
    if discover_decorated(task, "intercept"):
        problems.append(f"task {type(task).__name__} has @vf.intercept hooks, on model requests heterorl never makes")
    if [fn.__name__ for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is not vf.Trace]:
        problems.append(f"task {type(task).__name__} has @vf.stop hooks on model requests or responses")
    if hooks := _overrides(task, vf.Task, ("setup", "finalize", "stage_verifier")):
        problems.append(f"task {type(task).__name__} has {'/'.join(hooks)} hooks, which need a runtime")
    if hooks := _overrides(env, vf.Env, ("start", "stop")):
        problems.append(f"env {type(env).__name__} has {'/'.join(hooks)} hooks (serving resources)")
    return problems


class VerifiersMultiTurnTask(FixedRows):
    """The tasks of a verifiers env's taskset, each an episode of the env with heterorl's policy in one seat."""

    name = "verifiers_multiturn"
    scored_by_library = True

    def __init__(self, config: VerifiersMultiTurnConfig,
                 reward_timeout_s: float | None = TaskConfig.reward_timeout_s) -> None:
        self.config = config
        self.vf = import_verifiers()
        from verifiers.v1.configs.agent import agent_config_fields

        self.env = self._build_env(dict(config.env))
        seats = list(agent_config_fields(self.env.config))
        self.seat = config.seat or (seats[0] if len(seats) == 1 else None)
        if self.seat not in seats:
            raise TaskError(f"verifiers_multiturn env {self._name}: its agent seats are {seats}; name the one "
                            "heterorl's policy plays with task.options.seat")
        if len(seats) > 1:
            raise TaskError(f"verifiers_multiturn env {self._name}: its seats {[s for s in seats if s != self.seat]} "
                            "besides the policy's need a model (a harness and a client), which heterorl does not run")
        self.seat_config = getattr(self.env.config, self.seat)
        self._tasks: dict[str, object] = {}
        problems = self._load(self.env.taskset)
        if config.eval_taskset is not None:
            self._eval = self._load(self._build_taskset(dict(config.eval_taskset)))[:config.eval_size]
            held_out = {p.problem_id for p in self._eval}
            self._train = [p for p in problems if p.problem_id not in held_out]
        else:
            self._train, self._eval = held_out_split(problems, config.eval_size, config.eval_fraction,
                                                     config.split_seed, f"verifiers_multiturn env {self._name}",
                                                     "give eval_taskset", by_prompt=False)
        if not self._train:
            raise TaskError(f"verifiers_multiturn env {self._name}: every task is in the eval set")
        # the env's answers are known only as they come: a char-level policy's alphabet holds the prompts' characters
        self._alphabet = "".join(sorted({ch for p in problems + self._eval for ch in p.prompt} | {"\n"}))
        self.loop = LoopThread(f"heterorl-verifiers-{config.env['taskset']['id']}")
        self._score = GuardedScore(self._score_once, reward_timeout_s, f"verifiers_multiturn env {self._name}",
                                   clip=False)

    @property
    def _name(self) -> str:
        return repr(self.config.env["taskset"]["id"])

    def _build_env(self, block: dict):
        vf = self.vf
        try:
            return vf.load_environment(vf.resolve_env_config(block))
        except Exception as err:
            raise TaskError(f"verifiers_multiturn env {block!r}: the library could not build it: "
                            f"{type(err).__name__}: {err}") from err

    def _build_taskset(self, block: dict):
        vf = self.vf
        try:
            return vf.load_taskset(vf.taskset_config_type(block.get("id", "")).model_validate(block))
        except Exception as err:
            raise TaskError(f"verifiers_multiturn eval_taskset {block!r}: the library could not build it: "
                            f"{type(err).__name__}: {err}") from err

    def _load(self, taskset) -> list[Problem]:
        limit = self.config.max_tasks
        if not taskset.bounded and limit is None:
            raise TaskError(f"verifiers_multiturn env {self._name} is an infinite taskset; bound it with "
                            "task.options.max_tasks")
        problems: dict[str, Problem] = {}
        for task in itertools.islice(taskset, limit):
            if not self._tasks:
                self._check(task)
            problem_id = "vfmt-" + hashlib.sha1(task.key.encode()).hexdigest()[:12]
            prompt = render_turn(opening_messages(self.vf, task.data), opening=True)
            problems.setdefault(problem_id, Problem(problem_id, prompt, "", {"idx": task.data.idx, "key": task.key}))
            self._tasks.setdefault(problem_id, task)
        if not problems:
            raise TaskError(f"verifiers_multiturn env {self._name} loaded no tasks")
        return list(problems.values())

    def _check(self, task) -> None:
        """TaskError for what the seat cannot play (`unsupported`); a warning names the rewards skipped."""
        if why := unsupported(self.vf, self.env, self.seat, task):
            raise TaskError(f"verifiers_multiturn env {self._name}: " + "; ".join(why))
        skipped = [fn.__name__ for fn in task.hooks("reward") + task.hooks("metric") if _needs_runtime(fn)]
        if skipped:
            log.warning("verifiers_multiturn env %s: rewards and metrics %s need a runtime and are skipped (as the "
                        "library skips them offline)", self._name, skipped)

    @property
    def stats(self) -> Counter:
        """The scoring calls so far by outcome (`GuardedScore`)."""
        return self._score.stats

    def environment(self, problem: Problem) -> VerifiersEpisode:
        task = self._tasks.get(problem.problem_id)
        if task is None:
            raise TaskError(f"problem {problem.problem_id!r} is not a task of verifiers_multiturn env {self._name}; "
                            "the worker's task options must match the learner's")
        return VerifiersEpisode(self, task)

    def demonstration(self, problem: Problem) -> list[str]:
        raise TaskError("verifiers_multiturn has no demonstrations for SFT: a verifiers env gives no expert's turns")

    def reward(self, problem: Problem, completion: str) -> float:
        raise TaskError("verifiers_multiturn is scored by its env at the end of an episode (task.environment"
                        "(problem)); a single completion has no reward")

    def score(self, task, trace) -> float:
        """``trace`` scored by the task's rewards and the env's ``finalize``: ``trace.reward``, or 0 for a
        scoring call that raises or overruns (counted in `stats`)."""
        return self._score(task, trace, where=f"task {task.data.idx}, {trace.num_turns} turns")

    def _score_once(self, task, trace) -> float:
        try:
            self.loop.run(self._judge(task, trace))
        except self.vf.RolloutError as err:  # the library wraps the reward's own exception: count that one
            raise (err.__cause__ or err) from None
        return trace.reward

    async def _judge(self, task, trace) -> None:
        vf = self.vf
        await task.score(trace)
        episode = vf.Episode(env=vf.EnvInfo(id=self.env.config.env_id), traces=[trace], ok=True,
                             task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash))
        await self.env.finalize(task, episode)
