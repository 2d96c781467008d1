"""A `verifiers` taskset as a task: its tasks give the prompts, their rewards score our completions.

``verifiers`` (0.4 onwards, its ``verifiers.v1`` API; the ``[verifiers]`` extra) splits an environment into a
*taskset* (``vf.Taskset``: loads ``vf.Task`` objects, each a ``TaskData`` row with its ``prompt`` and
``system_prompt``) and the agents that play it. The scoring lives on the task: its ``@vf.reward`` methods (and
rewards plugged by its config), run by ``Task.score(trace)`` over a finished ``vf.Trace``; the reward is
``trace.reward``, the weighted sum. heterorl's workers sample the completion; here it becomes the trace's one
assistant message, after the prompt messages the library's plain chat harness would have sent, and the task's
own ``score`` runs locally, on an event loop this task keeps per calling thread. No model call, no runtime
(sandbox): a reward that needs one is skipped, as the library skips it when scoring offline.

A prompt is rendered to text: the system prompt, then each prompt message's text, separated by blank lines
(``task.chat_template=true`` then sends that text as one user message with the tokenizer's template).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.import_paths import import_object, split_import_path
from heterorl.tasks.base import FixedRows, Problem, check_split_options, held_out_split
from heterorl.tasks.guarded import GuardedScore

log = logging.getLogger("heterorl.tasks.verifiers_env")
INSTALL_HINT = "pip install 'heterorl[verifiers]'"
ENV_NAMES = "a function that returns a verifiers Taskset (or Env), or a Taskset class"  # what `env` must name


@dataclass(frozen=True)
class VerifiersConfig:
    """Which taskset, and how to split it.

    ``env`` is ``"package.module:name"``: a ``vf.Taskset`` subclass, built with its config type from
    ``env_args``; or a function called as ``name(**env_args)`` that returns a ``vf.Taskset`` or a ``vf.Env``
    (its taskset is used). The eval set is the tasks of the same ``env`` built with ``eval_env_args`` when given
    (a test split, say; its first ``eval_size`` when that is given too); else ``eval_size`` tasks, or
    ``max(1, int(eval_fraction * tasks))``, held out by shuffling with ``random.Random(split_seed)``. Training
    never draws an eval prompt. ``max_tasks`` bounds how many tasks are read (required for an infinite
    taskset). ``answer_field`` names the ``TaskData`` field that holds the reference answer (SFT's
    demonstration); a taskset without it has no demonstrations.
    """

    env: str
    env_args: dict = field(default_factory=dict)
    eval_env_args: dict | None = None
    eval_size: int | None = None
    eval_fraction: float = 0.1
    split_seed: int = 0
    max_tasks: int | None = None
    answer_field: str = "answer"

    def __post_init__(self) -> None:
        split_import_path(self.env, "verifiers option env", ENV_NAMES)
        for key in ("env_args", "eval_env_args"):
            value = getattr(self, key)
            if value is None and key == "eval_env_args":
                continue
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise TaskError(f"verifiers option {key}={value!r} must be a mapping of argument names to values")
        check_split_options("verifiers", self, ("eval_size", "max_tasks"))
        if not isinstance(self.answer_field, str) or not self.answer_field:
            raise TaskError(f"verifiers option answer_field={self.answer_field!r} must be a non-empty string")


def import_verifiers():
    """``verifiers.v1``, or a TaskError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise TaskError(f"task verifiers needs the verifiers library (0.4 or later): {INSTALL_HINT} ({err})") from err
    return vf


def build_taskset(vf, spec: str, args: Mapping):
    """The ``vf.Taskset`` that ``spec`` names, built with ``args`` (see `VerifiersConfig`)."""
    target = import_object(spec, "verifiers option env", ENV_NAMES)
    try:
        if isinstance(target, type) and issubclass(target, vf.Taskset):
            from verifiers.v1.utils.generic import concrete_type  # how the library finds a taskset's config type

            config_type = concrete_type(target, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            built = target(config_type.model_validate(dict(args)))
        else:
            built = target(**args)
    except TaskError:
        raise
    except Exception as err:
        raise TaskError(f"verifiers env {spec!r} with arguments {dict(args)!r} raised {type(err).__name__}: "
                        f"{err}") from err
    if isinstance(built, vf.Env):
        built = built.taskset
    if not isinstance(built, vf.Taskset):
        raise TaskError(f"verifiers env {spec!r} returned a {type(built).__name__}, not a verifiers Taskset or Env "
                        "(verifiers.v1); return one, e.g. MyTaskset(MyConfig(...))")
    return built


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    kinds = {getattr(part, "type", type(part).__name__) for part in content} - {"text"}
    if kinds:
        raise TaskError(f"{where}: its prompt has {', '.join(sorted(kinds))} content; heterorl prompts are text")
    return "\n".join(part.text for part in content)


def render_prompt(data, where: str) -> str:
    """A ``TaskData``'s prompt as one text: its ``system_prompt``, then the text of each prompt message (system
    or user), separated by blank lines."""
    prompt = data.prompt
    if prompt is None:
        raise TaskError(f"{where} has no prompt (the env opens the conversation): a multi-turn taskset, which "
                        "heterorl does not run")
    texts = [data.system_prompt] if data.system_prompt else []
    for message in [prompt] if isinstance(prompt, str) else prompt:
        if isinstance(message, str):
            texts.append(message)
        elif message.role in ("system", "user"):
            texts.append(_text(message.content, where))
        else:
            raise TaskError(f"{where}: its prompt holds an {message.role!r} message; heterorl renders single-turn "
                            "prompts of system and user messages only")
    return "\n\n".join(texts)


def _needs_runtime(fn) -> bool:
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def check_scorable(task, spec: str) -> None:
    """TaskError unless ``task``'s rewards can run here (no model, no runtime); a warning names those skipped."""
    name = type(task).__name__
    if task.config.judges:
        raise TaskError(f"verifiers env {spec!r}: task {name} is scored by judges, which call a model; heterorl "
                        "scores completions locally, without one")
    rewards = task.hooks("reward")
    skipped = [fn.__name__ for fn in rewards if _needs_runtime(fn)]
    if len(skipped) == len(rewards):
        what = f"its rewards {skipped} need a runtime (a sandbox)" if skipped else "it declares no @vf.reward"
        raise TaskError(f"verifiers env {spec!r}: task {name} cannot be scored here: {what}; heterorl scores a "
                        "completion's text alone")
    if skipped:
        log.warning("verifiers env %r: rewards %s of task %s need a runtime and are skipped (scored as the library "
                    "scores without one)", spec, skipped, name)


class VerifiersTask(FixedRows):
    """The tasks of a ``verifiers`` taskset, split into train and eval, scored by their own rewards."""

    name = "verifiers"
    scored_by_library = True

    def __init__(self, config: VerifiersConfig, reward_timeout_s: float | None = TaskConfig.reward_timeout_s) -> None:
        self.config = config
        self._vf = vf = import_verifiers()
        from verifiers.v1.state import state_cls  # a task's State type, as the library's own offline scoring builds it

        self._state_cls = state_cls
        self._tasks: dict[str, object] = {}  # problem_id -> vf.Task
        problems = self._load(config.env_args)
        if config.eval_env_args is not None:
            self._eval = self._load(config.eval_env_args)[:config.eval_size]
            held_out = {p.prompt for p in self._eval}
            self._train = [p for p in problems if p.prompt not in held_out]
        else:
            self._train, self._eval = held_out_split(problems, config.eval_size, config.eval_fraction,
                                                     config.split_seed, f"verifiers env {config.env!r}",
                                                     "give eval_env_args")
        if not self._train:
            raise TaskError(f"verifiers env {config.env!r}: every training task repeats an eval prompt")
        self._alphabet = "".join(sorted({ch for p in problems + self._eval for ch in p.prompt + p.answer}))
        self._agent = vf.AgentInfo(config=vf.AgentConfig(), name="heterorl")  # the seat a trace records
        self._build = vf.Trace.model_fields["verifiers"].default_factory()  # the library's version, read once
        self._loops = threading.local()  # one event loop per thread that scores
        self._score = GuardedScore(self._score_once, reward_timeout_s, f"verifiers env {config.env}", clip=False)

    def _load(self, args: Mapping) -> list[Problem]:
        spec, limit = self.config.env, self.config.max_tasks
        taskset = build_taskset(self._vf, spec, args)
        if not taskset.bounded and limit is None:
            raise TaskError(f"verifiers env {spec!r} is an infinite taskset; bound it with task.options.max_tasks")
        problems: dict[str, Problem] = {}
        for task in itertools.islice(taskset, limit):
            where = f"verifiers env {spec!r}, task {task.data.idx}"
            if not problems:
                check_scorable(task, spec)
            problem_id = "verifiers-" + hashlib.sha1(task.key.encode()).hexdigest()[:12]
            answer = getattr(task.data, self.config.answer_field, None)
            problems.setdefault(problem_id, Problem(problem_id, render_prompt(task.data, where),
                                                    "" if answer is None else str(answer),
                                                    {"idx": task.data.idx, "key": task.key}))
            self._tasks.setdefault(problem_id, task)
        if not problems:
            raise TaskError(f"verifiers env {spec!r} with arguments {dict(args)!r} loaded no tasks")
        return list(problems.values())

    @property
    def stats(self) -> Counter:
        """The reward calls so far by outcome: ``ok``, ``timeout``, ``error:ValueError``, ... (`GuardedScore`)."""
        return self._score.stats

    def demonstration(self, problem: Problem) -> str:
        """The task's reference answer, as the completion."""
        task = self._tasks.get(problem.problem_id)
        if task is None or getattr(task.data, self.config.answer_field, None) is None:
            raise TaskError(f"verifiers env {self.config.env!r} has no demonstrations for SFT: its tasks have no "
                            f"{self.config.answer_field!r} field (task.options.answer_field names it)")
        return problem.answer

    def reward(self, problem: Problem, completion: str) -> float:
        """The task's rewards on ``completion`` (their weighted sum, as the library gives it: not clipped to
        [0, 1]); 0 for a reward that raises or runs past ``reward_timeout_s``, counted in `stats`."""
        if problem.problem_id not in self._tasks:
            raise TaskError(f"problem {problem.problem_id!r} is not a task of verifiers env {self.config.env!r}; "
                            "the worker's task options must match the learner's")
        where = f"problem {problem.problem_id!r}, completion {completion[:60]!r}"
        return self._score(self._tasks[problem.problem_id], completion, where=where)

    def _score_once(self, task, completion: str) -> float:
        loop = getattr(self._loops, "loop", None)
        if loop is None:  # a loop per thread, kept: asyncio.run per call costs 1.5-2x as much (measured)
            loop = self._loops.loop = asyncio.new_event_loop()
        trace = self._trace(task, completion)
        try:
            loop.run_until_complete(task.score(trace))
        except self._vf.RolloutError as err:  # the library wraps the reward's own exception: count that one
            raise (err.__cause__ or err) from None
        return trace.reward

    def _trace(self, task, completion: str):
        """The trace of one turn: the prompt messages the library's chat harness sends, then ``completion``."""
        vf, data = self._vf, task.data
        messages = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
        if data.system_prompt:
            messages.insert(0, vf.SystemMessage(content=data.system_prompt))
        nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
        nodes.append(vf.MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content=completion),
                                    sampled=True))
        return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
                        agent=self._agent, verifiers=self._build, nodes=nodes, state=self._state_cls(type(task))())
