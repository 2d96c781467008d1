"""User-supplied reward functions, named by an import path like ``"mypkg.scoring:reward"``.

A reward function is called as ``reward_fn(prompt, completion, answer)``
with three strings (the problem's prompt, the decoded completion without the
end-of-sequence token, the problem's reference answer) and returns a finite
real number (bool, int or float; the task contract expects [0, 1]). It may also take, by keyword, the facts a
text cannot carry (`REWARD_FACTS`): ``token_ids`` (the completion's token ids, its stop token included),
``stop_reason`` (``"eos"``, ``"stop"`` or ``"length"``) and ``row`` (the problem's prompt, answer and other
columns as a dict); it gets those its signature names, or all of them through ``**kwargs``. TRL-style batched
functions, ``(prompts, completions, **kwargs) -> list[float]``, are called as they are (`is_batched`). A call that
has not returned within ``task.reward_timeout_s`` seconds is an error (`TimedCall`): a thread cannot be killed, so
the call runs in a daemon helper thread that the caller stops waiting for, and the error ends the process without
it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import queue
import random
import threading
from collections import Counter
from typing import Callable, Sequence

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.import_paths import import_object
from heterorl.tasks.base import Problem, Task

RewardFn = Callable[..., float]
REWARD_FACTS = ("token_ids", "stop_reason", "row")


def accepted_facts(fn: Callable) -> tuple[str, ...]:
    """The `REWARD_FACTS` ``fn`` takes by keyword (all of them when it has ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the three strings only
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return REWARD_FACTS
    names = {p.name for p in parameters if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return tuple(f for f in REWARD_FACTS if f in names)


def score(task: Task, problem: Problem, sample) -> float:
    """The reward of one sampled completion (an engine's `SampleOutput`): ``task.reward(problem, text)``, or, for a
    task whose reward takes the sample's facts (a user's reward function), with its token ids and stop reason too.
    Every place that scores a sample (the workers, the synchronous loop, evaluation) calls this."""
    with_facts = getattr(task, "reward_with_facts", None)
    if with_facts is not None:
        return with_facts(problem, sample.text, token_ids=list(sample.tokens), stop_reason=sample.stop_reason)
    return task.reward(problem, sample.text)


def score_all(task: Task, problems: Sequence[Problem], samples: Sequence) -> list[float]:
    """`score` of each (problem, sample): through the task's ``reward_batch`` when it has one (a task whose
    rewards run programs runs them in parallel), else one by one. Episodes of a multi-turn task come scored by
    their environment (a sample's ``reward``)."""
    if samples and all(s.reward is not None for s in samples):
        return [float(s.reward) for s in samples]
    batch = getattr(task, "reward_batch", None)
    if batch is not None and getattr(task, "reward_with_facts", None) is None:
        return [float(r) for r in batch(list(problems), [s.text for s in samples])]
    return [float(score(task, p, s)) for p, s in zip(problems, samples)]


def outcome_counts(task: Task) -> Counter:
    """The programs ``task``'s reward has run so far, by outcome (the code task's `Sandbox.stats`: ok,
    wrong_answer, timeout, forbidden:socket, ...), and how a multi-turn task's episodes ended
    (``episode_outcomes``, counted by heterorl.rollout.episodes: done, max_turns, budget, timeout, error:TYPE,
    bad_observation); empty for a task that counts neither."""
    return Counter(getattr(task, "stats", None) or {}) + Counter(getattr(task, "episode_outcomes", None) or {})


def outcomes_kind(task: Task) -> str:
    """What ``task``'s `outcome_counts` count, the middle of their metric names (``rollout/KIND/OUTCOME``): a
    task's own ``outcomes_kind`` (the code task's "programs"), else "episodes" for a multi-turn task and
    "scoring" for the calls of a scoring library (math-verify, reasoning-gym)."""
    from heterorl.tasks.environment import is_multi_turn

    return getattr(task, "outcomes_kind", None) or ("episodes" if is_multi_turn(task) else "scoring")


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}:{qualname}" if module else qualname


def load_reward_fn(spec: str) -> RewardFn:
    """The function ``"package.module:function"`` names, imported (`import_object`: TaskError naming the path and
    the fix when it cannot be)."""
    return import_object(spec, "reward function", "a function (prompt, completion, answer) -> float")


class CallTimedOut(Exception):
    """A `TimedCall` gave up waiting (its own type: a TimeoutError raised inside ``fn`` is ``fn``'s failure)."""


class TimedCall:
    """``fn(*args)`` with a time limit: CallTimedOut when a call has not returned within ``timeout_s`` seconds
    (None: no limit, the call runs in the caller's thread).

    Calls run one at a time in a long-lived daemon thread (a thread per call costs ~10x more: ~250 µs). A call
    that times out leaves that thread stuck inside ``fn``; it is abandoned, with its queues, and the next call
    starts a fresh one.
    """

    def __init__(self, fn: Callable, timeout_s: float | None) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue | None = None  # the live thread's inbox (None: no live thread)
        self._results: queue.SimpleQueue | None = None

    def __call__(self, *args, **kwargs):
        if self.timeout_s is None:
            return self.fn(*args, **kwargs)
        with self._lock:
            if self._calls is None:
                self._calls, self._results = queue.SimpleQueue(), queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._calls, self._results), daemon=True,
                                 name=f"reward {_describe(self.fn)}").start()
            self._calls.put((args, kwargs))
            try:
                returned, value = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                self._calls = self._results = None
                raise CallTimedOut(f"{_describe(self.fn)} did not return within {self.timeout_s:g} s") from None
        if not returned:
            raise value
        return value

    def _serve(self, calls: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
        while True:
            args, kwargs = calls.get()
            try:
                results.put((True, self.fn(*args, **kwargs)))
            except BaseException as err:  # handed to the caller, which raises it
                results.put((False, err))


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` is a TRL-style batched reward function, ``(prompts, completions, **kwargs) -> list[float]``
    (its signature names ``prompts`` and ``completions``)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return {"prompts", "completions"} <= names


class _Scorer:
    """One reward function with its weight, the facts it takes, and its time limit."""

    def __init__(self, fn: Callable, weight: float, timeout_s: float | None) -> None:
        if not callable(fn):
            raise TaskError(f"reward_fn {fn!r} is not callable; pass a (prompt, completion, answer) -> float")
        self.fn, self.weight, self.name = fn, weight, _describe(fn)
        self.batched = is_batched(fn)
        self.facts = accepted_facts(fn)
        self.call = TimedCall(fn, timeout_s)

    def __call__(self, problem: Problem, completion: str, facts: dict, where: str) -> float:
        try:
            if self.batched:  # TRL's convention: lists, one entry per completion; the row's columns by keyword
                columns = {k: [v] for k, v in facts["row"].items() if k not in ("prompt", "completion")}
                if "token_ids" in facts:
                    columns["completion_ids"] = [facts["token_ids"]]
                values = self.call(prompts=[problem.prompt], completions=[completion], **columns)
                if not isinstance(values, (list, tuple)) or len(values) != 1:
                    raise TaskError(f"reward function {self.name} returned {values!r} for 1 completion: a batched "
                                    f"reward function returns a list with one float per completion ({where})")
                value = values[0]
            else:
                given = {f: facts[f] for f in self.facts if f in facts}  # scoring text alone has no token ids
                value = self.call(problem.prompt, completion, problem.answer, **given)
        except CallTimedOut:
            raise TaskError(
                f"reward function {self.name} did not return within {self.call.timeout_s:g} s "
                f"(task.reward_timeout_s, {where}); make it faster, or raise the limit with "
                "task.reward_timeout_s=SECONDS (null: no limit)"
            ) from None
        except TaskError:
            raise
        except Exception as err:
            raise TaskError(f"reward function {self.name} raised {type(err).__name__}: {err} ({where})") from err
        if not isinstance(value, numbers.Real):  # bool and int count
            raise TaskError(f"reward function {self.name} returned {value!r} ({type(value).__name__}) for "
                            f"{where}; return a float")
        value = float(value)
        if not math.isfinite(value):
            raise TaskError(f"reward function {self.name} returned {value} for {where}; return a finite float")
        return value


class CustomRewardTask:
    """``base`` with its reward replaced by one or more reward functions: the weighted sum of their scores.

    A function is ``reward_fn(prompt, completion, answer, **facts) -> float`` (the facts it names, see
    `REWARD_FACTS`) or TRL-style batched, ``reward_fn(prompts, completions, **kwargs) -> list[float]`` (called
    with one completion, its ``completion_ids`` and the row's columns as one-element lists). Everything else
    (problems, eval set, demonstrations, alphabet) is the base task's. A score must be a finite real number;
    anything else, an exception inside a function, or no result within ``timeout_s`` seconds (None: no limit)
    raises TaskError naming the function and the row.
    """

    def __init__(self, base: Task, reward_fn: RewardFn | Sequence[RewardFn],
                 timeout_s: float | None = TaskConfig.reward_timeout_s,
                 weights: Sequence[float] | None = None) -> None:
        fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        if not fns:
            raise TaskError("give at least one reward function")
        weights = [1.0] * len(fns) if weights is None else list(weights)
        if len(weights) != len(fns):
            raise TaskError(f"{len(weights)} reward weights (task.reward_weights) for {len(fns)} reward functions; "
                            "give one weight per function")
        if not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
            raise TaskError(f"reward weights {weights} must be finite numbers")
        self.base = base
        self.scorers = [_Scorer(fn, float(w), timeout_s) for fn, w in zip(fns, weights)]
        self.reward_fn = fns[0]
        self.name = base.name

    def alphabet(self) -> str:
        return self.base.alphabet()

    def sample_train(self, rng: random.Random) -> Problem:
        return self.base.sample_train(rng)

    def eval_problems(self) -> list[Problem]:
        return self.base.eval_problems()

    def demonstration(self, problem: Problem) -> str:
        return self.base.demonstration(problem)

    @property
    def stats(self) -> Counter:
        """The outcomes its reward functions count (a function with an ``outcomes()`` attribute, such as
        `heterorl.tasks.math_answers.math_verify_reward`), summed: what the run reports as reward_outcomes."""
        total = Counter()
        for scorer in self.scorers:
            outcomes = getattr(scorer.fn, "outcomes", None)
            if callable(outcomes):
                total.update(outcomes())
        return total

    def reward(self, problem: Problem, completion: str) -> float:
        """The functions' score of a text alone (no token ids or stop reason: see `reward_with_facts`)."""
        return self.reward_with_facts(problem, completion)

    def reward_with_facts(self, problem: Problem, completion: str, **facts) -> float:
        """The weighted sum of the functions' scores, each given the `REWARD_FACTS` it takes (``row`` is built here
        from the problem)."""
        where = f"problem {problem.problem_id!r}, prompt {problem.prompt[:60]!r}, completion {completion[:60]!r}"
        facts["row"] = {"prompt": problem.prompt, "answer": problem.answer, **problem.data}
        return sum(s.weight * s(problem, completion, facts, where) for s in self.scorers)
