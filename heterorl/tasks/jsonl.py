"""Problems from the user's JSONL file, one ``{"prompt": ..., "answer": ...}`` object a line.

The answer is given as ``#### <answer>`` (GSM8K style, extractor ``"hash"``)
or ``\\boxed{<answer>}`` (extractor ``"boxed"``) and scored with
:func:`heterorl.tasks.answers.answers_match`.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heterorl.errors import TaskError
from heterorl.tasks.answers import answers_match, extract_boxed_answer, extract_hash_answer
from heterorl.tasks.base import Problem

EXTRACTORS = {"hash": extract_hash_answer, "boxed": extract_boxed_answer}


@dataclass(frozen=True)
class JsonlConfig:
    """Where the rows are and how to split and score them.

    The eval set is ``eval_size`` rows when given, else
    ``max(1, int(eval_fraction * rows))``, chosen by shuffling with
    ``random.Random(split_seed)``; at least one row must remain for training.
    """

    path: str
    extractor: str = "hash"
    eval_fraction: float = 0.1
    eval_size: int | None = None
    split_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise TaskError(f"jsonl option path={self.path!r} must be the path of a .jsonl file")
        if self.extractor not in EXTRACTORS:
            raise TaskError(f"jsonl option extractor={self.extractor!r} must be one of {sorted(EXTRACTORS)}")
        fraction = self.eval_fraction
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction < 1:
            raise TaskError(f"jsonl option eval_fraction={fraction!r} must be a number in (0, 1)")
        size = self.eval_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise TaskError(f"jsonl option eval_size={size!r} must be an integer >= 1 or None")
        if not isinstance(self.split_seed, int) or isinstance(self.split_seed, bool):
            raise TaskError(f"jsonl option split_seed={self.split_seed!r} must be an integer")


def _parse_row(path: str, line_no: int, line: str) -> tuple[str, str, dict[str, Any]]:
    where = f"{path}, line {line_no}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskError(f"{where}: not valid JSON ({err.msg}); write one JSON object per line") from err
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        problem = "missing" if prompt is None else f"must be a non-empty string, got {prompt!r}"
        raise TaskError(f"{where}: 'prompt' {problem}")
    if "answer" not in row:
        raise TaskError(f"{where}: 'answer' is missing")
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TaskError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    answer = str(answer).strip()
    if not answer:
        raise TaskError(f"{where}: 'answer' is empty")
    extra = {key: value for key, value in row.items() if key not in ("prompt", "answer")}
    return prompt, answer, extra


class JsonlTask:
    """Question/answer rows read once from a JSONL file and split into train and eval."""

    name = "jsonl"

    def __init__(self, config: JsonlConfig) -> None:
        self.config = config
        self._extract = EXTRACTORS[config.extractor]
        problems = self._load(str(config.path))
        if len(problems) < 2:
            raise TaskError(f"{config.path} has {len(problems)} row(s); need at least 2 (one train, one eval)")
        order = list(range(len(problems)))
        random.Random(config.split_seed).shuffle(order)
        n_eval = config.eval_size or max(1, int(config.eval_fraction * len(problems)))
        if n_eval >= len(problems):
            raise TaskError(
                f"eval set of {n_eval} rows leaves no training rows in {config.path} ({len(problems)} rows); "
                "lower eval_size or eval_fraction"
            )
        self._eval = [problems[i] for i in order[:n_eval]]
        eval_prompts = {p.prompt for p in self._eval}
        self._train = [problems[i] for i in order[n_eval:] if problems[i].prompt not in eval_prompts]
        if not self._train:
            raise TaskError(f"every training row of {config.path} repeats an eval prompt; lower eval_size")
        chars = {ch for p in problems for ch in p.prompt + self.demonstration(p)}
        self._alphabet = "".join(sorted(chars))

    def _load(self, path: str) -> list[Problem]:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError as err:
            raise TaskError(f"jsonl task file {path} does not exist; check the path option") from err
        except (OSError, UnicodeDecodeError) as err:
            raise TaskError(f"cannot read jsonl task file {path}: {err}") from err
        problems = []
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            prompt, answer, extra = _parse_row(path, line_no, line)
            problem = Problem(
                problem_id="jsonl-" + hashlib.sha1(prompt.encode()).hexdigest()[:12],
                prompt=prompt,
                answer=answer,
                data=extra,
            )
            if self.reward(problem, self.demonstration(problem)) != 1.0:
                raise TaskError(
                    f"{path}, line {line_no}: answer {answer!r} cannot be read back by the "
                    f"{self.config.extractor!r} extractor from {self.demonstration(problem)!r}; "
                    "simplify the answer or use the other extractor"
                )
            problems.append(problem)
        if not problems:
            raise TaskError(f"jsonl task file {path} is empty; add rows like {{\"prompt\": ..., \"answer\": ...}}")
        return problems

    def alphabet(self) -> str:
        return self._alphabet

    def sample_train(self, rng: random.Random) -> Problem:
        """A uniformly drawn training row (rows whose prompt is also in the eval set are never drawn)."""
        return rng.choice(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def demonstration(self, problem: Problem) -> str:
        if self.config.extractor == "hash":
            return f"#### {problem.answer}"
        return f"\\boxed{{{problem.answer}}}"

    def reward(self, problem: Problem, completion: str) -> float:
        predicted = self._extract(completion)
        return 1.0 if predicted is not None and answers_match(predicted, problem.answer) else 0.0
