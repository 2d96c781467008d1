"""Problems from reasoning-gym (``pip install 'heterorl[reasoning-gym]'``): its ~100 procedural datasets
(arithmetic, countdown, mazes, logic, puzzles, ...), seeded and unlimited, scored by each dataset's own
``score_answer``.

One dataset (``dataset: chain_sum``, its options in ``config``) or a weighted mixture (``datasets: {chain_sum: 1,
countdown: 2}``, or ``{countdown: {weight: 2, config: {...}}}``). A training problem is item ``i`` of the dataset
built with ``seed`` and ``size``, ``i`` drawn uniformly; the held-out eval set is the first ``eval_size`` items of
each dataset built with ``eval_seed`` (a repeated question once), and training draws skip any item whose question
is in it. The prompt is the question and then ``instruction``; the completion's answer is what it puts inside
``<answer>...</answer>`` (``answer_format: answer_tag``, reasoning-gym's own convention) or the whole completion,
stripped (``plain``). Scoring is the library's: a call that raises or hangs past ``task.reward_timeout_s`` scores
0 and is counted (`GuardedScore`); in a mixture, evaluation reports success per dataset (`group_of`).
"""

from __future__ import annotations

import difflib
import random
import string
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.tasks.base import MAX_EVAL_REDRAWS, Problem
from heterorl.tasks.guarded import GuardedScore

ANSWER_FORMATS = ("answer_tag", "plain")
INSTRUCTIONS = {"answer_tag": "Give only your final answer, inside <answer></answer>.", "plain": "Answer: "}
MAX_CACHED_ENTRIES = 4096  # dataset items kept for scoring; an older problem's item is generated again
PRINTABLE = "".join(ch for ch in string.printable if ch not in "\r\x0b\x0c")
INSTALL_HINT = "pip install 'heterorl[reasoning-gym]'"


def datasets_available() -> dict[str, tuple[type, type]]:
    """reasoning-gym's datasets by name: (dataset class, config class); TaskError when it is not installed."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise TaskError(f"task reasoning_gym needs the reasoning-gym library ({INSTALL_HINT}): {err}") from err
    return {name: pair for name, pair in DATASETS.items() if name != "composite"}  # mixtures are ours


def dataset_options(name: str) -> dict[str, Any]:
    """A dataset's options and their defaults (its config class's fields but ``seed`` and ``size``)."""
    import dataclasses

    _, config_cls = _lookup(name)
    return {f.name: (f.default if f.default is not dataclasses.MISSING else
                     f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")}


def _lookup(name: str) -> tuple[type, type]:
    known = datasets_available()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise TaskError(f"reasoning_gym has no dataset {name!r}; {hint}`heterorl tasks` lists all {len(known)}")
    return known[name]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ReasoningGymConfig:
    """Which datasets, how to split them and how a completion answers (see the module's docstring).

    ``dataset`` and ``config`` (its options, as `heterorl tasks --show NAME` lists them) name one dataset;
    ``datasets`` a mixture, each name mapped to a weight or to ``{weight: W, config: {...}}``. ``size``: the
    training items per dataset (draws are uniform over them; a dataset that precomputes its items may need
    fewer). ``instruction`` (None: the format's default, `INSTRUCTIONS`) follows the question on a new line."""

    dataset: str | None = None
    datasets: dict | None = None
    config: dict = field(default_factory=dict)
    seed: int = 0
    size: int = 100_000
    eval_size: int = 128
    eval_seed: int = 12345
    answer_format: str = "answer_tag"
    instruction: str | None = None

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.datasets is None):
            raise TaskError("reasoning_gym needs exactly one of the options dataset (one dataset) and datasets (a "
                            "mixture: {name: weight, ...}); `heterorl tasks` lists the datasets")
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise TaskError(f"reasoning_gym option dataset={self.dataset!r} must be a dataset's name")
        if not isinstance(self.config, dict):
            raise TaskError(f"reasoning_gym option config={self.config!r} must be a mapping of the dataset's options")
        if self.datasets is not None:
            if not isinstance(self.datasets, dict) or not self.datasets:
                raise TaskError(f"reasoning_gym option datasets={self.datasets!r} must map dataset names to weights")
            if self.config:
                raise TaskError("reasoning_gym option config is for a single dataset; in a mixture give each its "
                                "own: datasets: {NAME: {weight: 1, config: {...}}}")
        for key in ("seed", "eval_seed"):
            if not _is_int(getattr(self, key)):
                raise TaskError(f"reasoning_gym option {key}={getattr(self, key)!r} must be an integer")
        for key in ("size", "eval_size"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 1:
                raise TaskError(f"reasoning_gym option {key}={getattr(self, key)!r} must be an integer >= 1")
        if self.answer_format not in ANSWER_FORMATS:
            raise TaskError(f"reasoning_gym option answer_format={self.answer_format!r} must be one of "
                            f"{', '.join(ANSWER_FORMATS)}")
        if self.instruction is not None and not isinstance(self.instruction, str):
            raise TaskError(f"reasoning_gym option instruction={self.instruction!r} must be a string or null")

    def members(self) -> dict[str, tuple[float, dict]]:
        """Each dataset's (weight, options)."""
        if self.dataset is not None:
            return {self.dataset: (1.0, dict(self.config))}
        members = {}
        for name, spec in self.datasets.items():
            weight, options = spec, {}
            if isinstance(spec, dict):
                unknown = set(spec) - {"weight", "config"}
                if unknown:
                    raise TaskError(f"reasoning_gym datasets.{name}: unknown key(s) {sorted(unknown)}; give weight "
                                    "and config")
                weight, options = spec.get("weight", 1.0), spec.get("config") or {}
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise TaskError(f"reasoning_gym datasets.{name}: weight {weight!r} must be a number > 0")
            if not isinstance(options, dict):
                raise TaskError(f"reasoning_gym datasets.{name}.config={options!r} must be a mapping of options")
            members[str(name)] = (float(weight), dict(options))
        return members


def _build(name: str, options: dict, seed: int, size: int):
    """reasoning-gym's dataset ``name`` with ``options``; TaskError naming an unknown option or a refusal."""
    dataset_cls, config_cls = _lookup(name)
    valid = dataset_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TaskError(f"reasoning_gym dataset {name!r} has no option(s) {', '.join(unknown)}; its options: "
                        f"{', '.join(valid) or 'none'}")
    try:
        return dataset_cls(config_cls(**options, seed=seed, size=size))
    except Exception as err:  # its config's own validation (asserts, mostly)
        hint = "; lower task.options.size" if "size" in str(err).lower() else ""
        raise TaskError(f"reasoning_gym dataset {name!r} refused options {options} (seed {seed}, size {size}): "
                        f"{type(err).__name__}: {err or 'an assertion failed'}{hint}") from err


class ReasoningGymTask:
    """Problems of one reasoning-gym dataset or a weighted mixture, scored by the dataset's own score_answer (see
    the module's docstring)."""

    name = "reasoning_gym"
    scored_by_library = True

    def __init__(self, config: ReasoningGymConfig,
                 reward_timeout_s: float | None = TaskConfig.reward_timeout_s) -> None:
        self.config = config
        members = config.members()
        self.names = list(members)
        self.weights = [members[name][0] for name in self.names]
        self._train = {name: _build(name, opts, config.seed, config.size) for name, (_, opts) in members.items()}
        self._held = {name: _build(name, opts, config.eval_seed, config.eval_size)
                      for name, (_, opts) in members.items()}
        self._instruction = INSTRUCTIONS[config.answer_format] if config.instruction is None else config.instruction
        self._entries: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        held_out: dict[str, Problem] = {}  # (a repeated item is held out once)
        for name in self.names:
            for i in range(config.eval_size):
                problem = self._problem(name, "eval", i)
                held_out.setdefault(problem.prompt, problem)
        self._eval = list(held_out.values())
        self._eval_questions = set(held_out)
        self._scorer = GuardedScore(self._score, reward_timeout_s, "reasoning-gym's score_answer")

    @property
    def stats(self):
        """Scoring calls by outcome (ok, timeout, error:TYPE): the run's ``reward_outcomes``."""
        return self._scorer.stats

    def _entry(self, name: str, split: str, index: int) -> dict:
        """Item ``index`` of a dataset (cached: problems are drawn on one thread and scored on another)."""
        key = f"{name}/{split}/{index}"
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
        entry = (self._train if split == "train" else self._held)[name][index]
        with self._lock:
            self._entries[key] = entry
            if len(self._entries) > MAX_CACHED_ENTRIES:
                self._entries.popitem(last=False)
        return entry

    def _problem(self, name: str, split: str, index: int) -> Problem:
        entry = self._entry(name, split, index)
        prompt = str(entry["question"]).rstrip() + ("\n" + self._instruction if self._instruction else "")
        return Problem(problem_id=f"rg-{name}-{split}-{index}", prompt=prompt, answer=str(entry["answer"]),
                       data={"dataset": name, "split": split, "index": index})

    def group_of(self, problem: Problem) -> str:
        """The dataset ``problem`` comes from (evaluation reports success per dataset)."""
        return problem.data["dataset"]

    def alphabet(self) -> str:
        chars = set(PRINTABLE)
        for problem in self._eval:
            chars.update(problem.prompt + self.demonstration(problem))
        return "".join(sorted(chars))

    def sample_train(self, rng: random.Random) -> Problem:
        """A training item of a dataset drawn by weight, never one whose question is held out."""
        for _ in range(MAX_EVAL_REDRAWS):
            name = rng.choices(self.names, self.weights)[0] if len(self.names) > 1 else self.names[0]
            problem = self._problem(name, "train", rng.randrange(self.config.size))
            if problem.prompt not in self._eval_questions:
                return problem
        raise TaskError(f"{MAX_EVAL_REDRAWS} reasoning_gym draws in a row were all held out for evaluation; lower "
                        "eval_size or widen the dataset's options")

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def demonstration(self, problem: Problem) -> str:
        if self.config.answer_format == "answer_tag":
            return f"<answer>{problem.answer}</answer>"
        return problem.answer

    def extract(self, completion: str) -> str | None:
        """The completion's answer: the last ``<answer>...</answer>``'s content, stripped (None without one), or
        the whole completion, stripped."""
        if self.config.answer_format == "plain":
            return completion.strip()
        start = completion.rfind("<answer>")
        end = completion.find("</answer>", start) if start >= 0 else -1
        return None if end < 0 else completion[start + len("<answer>"):end].strip()

    def _score(self, name: str, answer: str | None, entry: dict) -> float:
        return self._train[name].score_answer(answer, entry)

    def reward(self, problem: Problem, completion: str) -> float:
        """The dataset's ``score_answer`` of the extracted answer (0 without one), in [0, 1]."""
        answer = self.extract(completion)
        if answer is None:
            self._scorer.count("no_answer")
            return 0.0
        name = problem.data["dataset"]
        entry = self._entry(name, problem.data["split"], problem.data["index"])
        return self._scorer(name, answer, entry, where=f"{problem.problem_id}, answer {answer[:60]!r}")
