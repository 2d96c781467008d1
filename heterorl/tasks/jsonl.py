"""Problems from the user's dataset: a JSONL file, one ``{"prompt": ..., "answer": ...}`` object a line, a Parquet
file or a folder written by ``datasets``' ``save_to_disk`` with the same columns (names configurable).

The answer is given as ``#### <answer>`` (GSM8K style, extractor ``"hash"``)
or ``\\boxed{<answer>}`` (extractor ``"boxed"``) and scored with
:func:`heterorl.tasks.answers.answers_match`, or given as ``\\boxed{<answer>}`` and checked by math-verify
(extractor ``"math_verify"``: `heterorl.tasks.math_answers`, each call bounded by ``task.reward_timeout_s``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.tasks.answers import answers_match, extract_boxed_answer, extract_hash_answer
from heterorl.tasks.base import FixedRows, Problem
from heterorl.tasks.math_answers import MathVerifyScorer

# what reads a completion's answer for `answers_match` (None: math-verify reads the answer and compares)
EXTRACTORS = {"hash": extract_hash_answer, "boxed": extract_boxed_answer, "math_verify": None}
log = logging.getLogger("heterorl.tasks.jsonl")


@dataclass(frozen=True)
class JsonlConfig:
    """Where the rows are and how to split and score them.

    The eval set is the rows of ``eval_path`` when given (its first ``eval_size`` when that is given too); else
    ``eval_size`` rows of ``path`` when given, or ``max(1, int(eval_fraction * rows))``, chosen by shuffling with
    ``random.Random(split_seed)`` (the run log names the lines it held out). Training draws never meet an eval
    prompt; at least one row must remain for training. ``prompt_column`` and ``answer_column`` name the keys
    that hold the prompt and the answer; every other key travels with the problem (a reward's ``row``).
    """

    path: str
    extractor: str = "hash"
    eval_fraction: float = 0.1
    eval_size: int | None = None
    split_seed: int = 0
    eval_path: str | None = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise TaskError(f"jsonl option path={self.path!r} must be the path of a .jsonl or .parquet file or of a "
                            "datasets folder")
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
        if self.eval_path is not None and (not isinstance(self.eval_path, (str, Path)) or not str(self.eval_path)):
            raise TaskError(f"jsonl option eval_path={self.eval_path!r} must be the path of a .jsonl file or null")
        for key in ("prompt_column", "answer_column"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise TaskError(f"jsonl option {key}={getattr(self, key)!r} must be a non-empty string")
        if self.prompt_column == self.answer_column:
            raise TaskError(f"jsonl options prompt_column and answer_column are both {self.prompt_column!r}")


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def read_rows(path: str) -> list[tuple[int, str, object]]:
    """(number, where, row) of every row of a dataset file: a JSONL file (row = the line's text, number = its
    line), a Parquet file or a folder written by ``datasets``' ``save_to_disk`` (row = a dict, number = its
    1-based position; the ``[data]`` extra reads them). ``where`` names the file and the line or row."""
    source = Path(path)
    if not source.exists():
        raise TaskError(f"task file {path} does not exist; check the path option")
    if source.is_dir() or source.suffix == ".parquet":
        return [(i, f"{path}, row {i}", row) for i, row in enumerate(_read_table(source), start=1)]
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise TaskError(f"cannot read task file {path}: {err}") from err
    return [(n, f"{path}, line {n}", line) for n, line in enumerate(lines, start=1) if line.strip()]


def _read_table(source: Path) -> list[dict]:
    try:
        if source.is_dir():
            import datasets

            table = datasets.load_from_disk(str(source))
            if isinstance(table, datasets.DatasetDict):
                raise TaskError(f"{source} holds splits {sorted(table)}, not one table: name the split's folder "
                                f"({source}/{sorted(table)[0]}, say)")
            return table.to_list()
        import pyarrow.parquet

        return pyarrow.parquet.read_table(source).to_pylist()
    except ImportError as err:
        raise TaskError(f"reading {source} needs the [data] extra (pip install 'heterorl[data]'): {err}") from err
    except TaskError:
        raise
    except Exception as err:
        kind = "a datasets folder (save_to_disk)" if source.is_dir() else "a Parquet file"
        raise TaskError(f"cannot read {source} as {kind}: {type(err).__name__}: {err}") from err


def _parse_row(where: str, row: object, prompt_key: str = "prompt",
               answer_key: str = "answer") -> tuple[str, str, dict[str, Any]]:
    if isinstance(row, str):
        try:
            row = json.loads(row)
        except json.JSONDecodeError as err:
            raise TaskError(f"{where}: not valid JSON ({err.msg}); write one JSON object per line") from err
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object with {prompt_key!r} and {answer_key!r}, "
                        f"got {type(row).__name__}")
    hint = "" if prompt_key in row and answer_key in row else (
        f" (its keys: {', '.join(map(repr, row))}; name the columns with task.options.prompt_column / answer_column)")
    prompt = row.get(prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
        problem = "missing" if prompt is None else f"must be a non-empty string, got {prompt!r}"
        raise TaskError(f"{where}: {prompt_key!r} {problem}{hint}")
    if answer_key not in row:
        raise TaskError(f"{where}: {answer_key!r} is missing{hint}")
    answer = row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TaskError(f"{where}: {answer_key!r} must be a string or a number, got {type(answer).__name__}")
    answer = str(answer).strip()
    if not answer:
        raise TaskError(f"{where}: {answer_key!r} is empty")
    extra = {key: value for key, value in row.items() if key not in (prompt_key, answer_key)}
    return prompt, answer, extra


class JsonlTask(FixedRows):
    """Question/answer rows read once from a JSONL file and split into train and eval. With extractor
    ``math_verify`` each reward is a `MathVerifyScorer` call limited to ``reward_timeout_s`` seconds (None: no
    limit), counted by outcome in ``stats``."""

    name = "jsonl"
    scored_by_library = True  # `make_task` passes task.reward_timeout_s

    def __init__(self, config: JsonlConfig, reward_timeout_s: float | None = TaskConfig.reward_timeout_s) -> None:
        self.config = config
        self._extract = EXTRACTORS[config.extractor]
        self._math_verify = MathVerifyScorer(reward_timeout_s) if config.extractor == "math_verify" else None
        self._load_checks = Counter()  # its outcomes scoring every row's demonstration, not rewards of the run
        rows = self._load(str(config.path))
        problems = [p for _, p in rows]
        if config.eval_path is not None:
            held_out = self._load(str(config.eval_path))[:config.eval_size]
            self._eval = [p for _, p in held_out]
            eval_prompts = {p.prompt for p in self._eval}
            self._train = [p for p in problems if p.prompt not in eval_prompts]
        else:
            if len(problems) < 2:
                raise TaskError(f"{config.path} has {len(problems)} row(s); need at least 2 (one train, one eval), "
                                "or name an eval file with task.options.eval_path")
            order = list(range(len(problems)))
            random.Random(config.split_seed).shuffle(order)
            n_eval = config.eval_size or max(1, int(config.eval_fraction * len(problems)))
            if n_eval >= len(problems):
                raise TaskError(
                    f"eval set of {n_eval} rows leaves no training rows in {config.path} ({len(problems)} rows); "
                    "lower eval_size or eval_fraction"
                )
            self._eval = [problems[i] for i in order[:n_eval]]
            self.held_out_rows = sorted(rows[i][0] for i in order[:n_eval])
            unit = "rows" if Path(config.path).is_dir() or Path(config.path).suffix == ".parquet" else "lines"
            log.info("held out %s %s of %s for evaluation (split_seed %d); name the eval rows yourself with "
                     "task.options.eval_path", unit, _ranges(self.held_out_rows), config.path, config.split_seed)
            eval_prompts = {p.prompt for p in self._eval}
            self._train = [problems[i] for i in order[n_eval:] if problems[i].prompt not in eval_prompts]
        if not self._train:
            raise TaskError(f"every training row of {config.path} repeats an eval prompt; lower eval_size or use "
                            "an eval file that does not repeat the training rows")
        chars = {ch for p in problems + self._eval for ch in p.prompt + self.demonstration(p)}
        self._alphabet = "".join(sorted(chars))
        self._load_checks = self.stats

    held_out_rows: list[int] | None = None  # the lines (JSONL) or rows of ``path`` held out (None: an eval file)

    def _load(self, path: str) -> list[tuple[int, Problem]]:
        """(line or row number, problem) of every row of ``path``."""
        problems = []
        for number, where, row in read_rows(path):
            prompt, answer, extra = _parse_row(where, row, self.config.prompt_column, self.config.answer_column)
            problem = Problem(
                problem_id="jsonl-" + hashlib.sha1(prompt.encode()).hexdigest()[:12],
                prompt=prompt,
                answer=answer,
                data=extra,
            )
            if self._math_verify is not None and not self._math_verify.reference_parses(answer, where):
                raise TaskError(f"{where}: answer {answer!r} does not parse: math-verify reads no value from "
                                f"\\boxed{{{answer}}} (it would match only the same broken text); fix its LaTeX "
                                "(balanced braces, complete \\frac{a}{b}), or use another extractor "
                                f"({', '.join(EXTRACTORS)})")
            if self.reward(problem, self.demonstration(problem)) != 1.0:
                raise TaskError(
                    f"{where}: answer {answer!r} cannot be read back by the "
                    f"{self.config.extractor!r} extractor from {self.demonstration(problem)!r}; "
                    f"simplify the answer or use another extractor ({', '.join(EXTRACTORS)})"
                )
            problems.append((number, problem))
        if not problems:
            raise TaskError(f"task file {path} is empty; add rows like {{\"prompt\": ..., \"answer\": ...}}")
        return problems

    def demonstration(self, problem: Problem) -> str:
        if self.config.extractor == "hash":
            return f"#### {problem.answer}"
        return f"\\boxed{{{problem.answer}}}"

    @property
    def stats(self) -> Counter:
        """The rewards math-verify scored since the rows were loaded, by outcome (`MathVerifyScorer.stats`: ok,
        too_long, timeout, error:TYPE); empty for the other extractors."""
        if self._math_verify is None:
            return Counter()
        return self._math_verify.stats - self._load_checks

    def reward(self, problem: Problem, completion: str) -> float:
        if self._math_verify is not None:
            return self._math_verify(completion, problem.answer,
                                     where=f"problem {problem.problem_id!r}, completion {completion[:60]!r}")
        predicted = self._extract(completion)
        return 1.0 if predicted is not None and answers_match(predicted, problem.answer) else 0.0
