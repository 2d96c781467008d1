"""Answers checked by math-verify (heterorl.tasks.math_answers): the hard cases side by side with the hand-written
extractors, the jsonl task's ``extractor: math_verify``, the reward function, and the bounds (length, time,
library errors) with their counted outcomes."""

import json
import random
import sys
import threading
import time
from collections import Counter

import math_verify
import pytest

from heterorl.errors import TaskError
from heterorl.tasks import make_task
from heterorl.tasks.answers import answers_match, extract_boxed_answer, extract_hash_answer
from heterorl.tasks.jsonl import JsonlConfig, JsonlTask
from heterorl.tasks.math_answers import (
    MAX_VERIFY_CHARS,
    MathVerifyScorer,
    _VerifierProcess,
    math_verify_score,
)
from heterorl.tasks.rewards import CustomRewardTask, outcome_counts, outcomes_kind

# reference, completion, is the completion right, then what each scorer says: hand-written `hash`, hand-written
# `boxed` (both through answers_match), math_verify. The docs/TASKS.md table is this one.
HARD_CASES = [
    ("0.5", "\\boxed{\\frac{1}{2}}", True, 0, 0, 1),
    ("\\frac{1}{2}", "\\boxed{0.5}", True, 0, 0, 1),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", True, 0, 0, 1),
    ("1000", "\\boxed{1,000}", True, 0, 1, 1),
    ("1,000", "#### 1000", True, 1, 0, 1),
    ("42", "The total is \\boxed{42} apples.", True, 0, 1, 1),
    ("42", "First \\boxed{41}, corrected: \\boxed{42}", True, 0, 1, 1),
    ("5", "The answer is $5$.", True, 0, 0, 1),
    ("5", "\\boxed{5.0}", True, 0, 1, 1),
    ("-3", "\\boxed{- 3}", True, 0, 0, 1),
    ("-3", "\\boxed{3}", False, 0, 0, 0),
    ("50\\%", "\\boxed{0.5}", True, 0, 0, 1),
    ("50\\%", "\\boxed{50}", True, 0, 0, 1),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", True, 0, 0, 1),
    ("\\{1,2\\}", "\\boxed{\\{1,3\\}}", False, 0, 0, 0),
    ("(1,2]", "\\boxed{(1,2]}", True, 0, 1, 1),
    ("(1,2]", "\\boxed{(1,2)}", False, 0, 0, 0),
    ("3", "\\boxed{x = 3}", True, 0, 0, 1),
    ("100", "\\boxed{\\$100}", True, 0, 0, 1),
    ("12", "\\boxed{1,2}", False, 0, 1, 0),  # answers_match drops the comma: a wrong answer accepted
    ("42", "#### 42", True, 1, 0, 1),
    ("42", "6 boxes of 7 make 42\n#### 42", True, 1, 0, 1),
    ("42", "####42", True, 1, 0, 0),  # math-verify reads no number glued to the marker
    ("42", "#### 42\nThat is 6 boxes of 7.", True, 1, 0, 0),  # ... and takes the last number of the text
    ("10", "\\boxed{10.}", True, 0, 1, 0),  # "10." does not parse
    ("Paris", "\\boxed{sirap}", False, 0, 0, 1),  # a word is a product of symbols, so any anagram matches
    ("0.3333333", "\\boxed{\\frac{1}{3}}", False, 0, 0, 1),  # decimals rounded to ~6 places
    ("42", "no answer here", False, 0, 0, 0),
]


def hand_written(extract, completion: str, reference: str) -> int:
    predicted = extract(completion)
    return int(predicted is not None and answers_match(predicted, reference))


@pytest.mark.parametrize("reference, completion, right, by_hash, by_boxed, by_math_verify", HARD_CASES)
def test_hard_cases_side_by_side(reference, completion, right, by_hash, by_boxed, by_math_verify):
    assert hand_written(extract_hash_answer, completion, reference) == by_hash
    assert hand_written(extract_boxed_answer, completion, reference) == by_boxed
    assert math_verify_score(completion, reference) == float(by_math_verify)


def test_neither_is_strictly_better():
    """Why `hash` stays the default and `boxed` keeps answers_match: each side gets cases the other misses."""
    def misses(column):
        return {(ref, comp) for ref, comp, right, *scores in HARD_CASES if scores[column] != int(right)}

    math_verify_misses = misses(2)
    assert misses(0) - math_verify_misses and math_verify_misses - misses(0)  # vs `hash`
    assert misses(1) - math_verify_misses and math_verify_misses - misses(1)  # vs `boxed`


def test_scored_off_the_main_thread():
    """The library's own timeouts (signal.alarm) raise in any other thread; ours are off, so this scores."""
    scores = []
    worker = threading.Thread(target=lambda: scores.append(math_verify_score("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert scores == [1.0]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


ROWS = [{"prompt": "half?", "answer": "\\frac{1}{2}"}, {"prompt": "thousand?", "answer": "1,000"},
        {"prompt": "set?", "answer": "\\{1,2\\}"}, {"prompt": "answer?", "answer": 42},
        {"prompt": "rate?", "answer": "50\\%"}, {"prompt": "neg?", "answer": "-3"}]
EQUIVALENT = {"half?": "0.5", "thousand?": "1000", "set?": "\\{2,1\\}", "answer?": "42.0", "rate?": "0.5",
              "neg?": "- 3"}


def test_jsonl_math_verify_end_to_end(tmp_path):
    path = write_rows(tmp_path / "math.jsonl", ROWS)
    task = make_task("jsonl", {"path": path, "extractor": "math_verify", "eval_size": 2}, reward_timeout_s=5.0)
    assert isinstance(task, JsonlTask) and task._math_verify.timeout_s == 5.0
    assert outcome_counts(task) == Counter()  # the load-time checks of every row are not rewards of the run
    evals = task.eval_problems()
    train = {task.sample_train(random.Random(seed)).prompt for seed in range(50)}
    assert len(evals) == 2 and len(train) == 4 and not train & {p.prompt for p in evals}
    for problem in evals + [task.sample_train(random.Random(0))]:
        assert task.demonstration(problem) == f"\\boxed{{{problem.answer}}}"
        assert task.reward(problem, "so " + task.demonstration(problem)) == 1.0
        assert task.reward(problem, f"that is \\boxed{{{EQUIVALENT[problem.prompt]}}}") == 1.0
        assert task.reward(problem, "\\boxed{7}") == 0.0
    assert outcome_counts(task) == Counter(ok=9)
    # named as what they count: a scoring library's calls here, the code task's programs, episodes' endings
    assert outcomes_kind(task) == "scoring" and outcomes_kind(make_task("code", {})) == "programs"
    assert outcomes_kind(make_task("calculator", {})) == "episodes"


@pytest.mark.parametrize("answer", ["}{", "\\frac{1}{"])
def test_jsonl_math_verify_rejects_an_answer_that_does_not_parse(tmp_path, answer):
    """``\\frac{1}{`` once passed: math-verify reads no value from it, keeps the text as a string, and matches the
    demonstration (the same broken text) with it, so every completion but that one would have scored 0."""
    path = write_rows(tmp_path / "bad.jsonl", ROWS[:2] + [{"prompt": "q", "answer": answer}])
    with pytest.raises(TaskError, match="line 3.*does not parse: math-verify reads no value"):
        JsonlTask(JsonlConfig(path=path, extractor="math_verify"), reward_timeout_s=None)
    with pytest.raises(TaskError, match="line 3.*does not parse"):  # in its bounded child process too
        JsonlTask(JsonlConfig(path=path, extractor="math_verify"), reward_timeout_s=5.0)


def test_library_error_is_counted_by_name(monkeypatch):
    scorer = MathVerifyScorer(timeout_s=None)  # in this thread, so the patched module is the one called

    def boom(*args, **kwargs):
        raise ValueError("odd expression")

    monkeypatch.setattr(math_verify, "verify", boom)
    assert scorer("\\boxed{42}", "42") == 0.0
    assert scorer.stats == Counter({"error:ValueError": 1})


def test_child_error_keeps_its_name():
    with pytest.raises(TypeError, match="expected string"):
        _VerifierProcess(timeout_s=5.0)(None, None)


def test_hang_is_bounded_and_the_next_call_scores():
    """``9^{9^{9^{9}}}`` makes sympy compute a 370-million-digit power in one C call that holds the GIL: no
    thread-based timeout could return here; the child is killed. The limit is 2 s, not less: the call after it
    must score within it on a loaded machine too (at 0.2 s it overran once, with six suite processes on 2 cores)."""
    scorer = MathVerifyScorer(timeout_s=2.0)
    start = time.monotonic()
    assert scorer("\\boxed{9^{9^{9^{9}}}}", "42") == 0.0
    assert time.monotonic() - start < 8.0  # the power alone takes minutes
    assert scorer.stats == Counter(timeout=1)
    assert scorer("\\boxed{42}", "42") == 1.0  # a fresh child
    assert scorer.stats == Counter(timeout=1, ok=1)


def test_over_long_text_is_never_parsed(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("parsed an over-long text")

    scorer = MathVerifyScorer(timeout_s=None)
    monkeypatch.setattr(math_verify, "parse", must_not_run)
    assert scorer("1 " * MAX_VERIFY_CHARS, "1") == 0.0
    assert scorer("\\boxed{" + "1" * (MAX_VERIFY_CHARS + 1) + "}", "1") == 0.0
    assert scorer("\\boxed{1}", "1" * (MAX_VERIFY_CHARS + 1)) == 0.0
    assert scorer.stats == Counter(too_long=3)
    monkeypatch.undo()
    assert scorer("x " * MAX_VERIFY_CHARS + "\\boxed{1}", "1") == 1.0  # only the last box is parsed


def test_reward_fn_path(tmp_path):
    path = write_rows(tmp_path / "math.jsonl", ROWS)
    task = make_task("jsonl", {"path": path, "extractor": "boxed"},
                     reward_fn="heterorl.tasks.math_answers:math_verify_reward")
    assert isinstance(task, CustomRewardTask)
    half = next(p for p in task.eval_problems() + task.base._train if p.prompt == "half?")
    before = outcome_counts(task)
    assert task.reward(half, "It is \\boxed{0.5}.") == 1.0
    assert task.reward(half, "It is \\boxed{0.25}.") == 0.0
    assert task.reward(half, "\\boxed{" + "1" * (MAX_VERIFY_CHARS + 1) + "}") == 0.0
    assert outcome_counts(task) - before == Counter(ok=2, too_long=1)  # reported as the run's reward_outcomes


def test_missing_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(TaskError, match="pip install math-verify"):
        JsonlTask(JsonlConfig(path=write_rows(tmp_path / "m.jsonl", ROWS), extractor="math_verify"))


def test_child_that_cannot_start_names_the_fix(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(TaskError, match="did not start .exit code 1.*import math_verify"):
        MathVerifyScorer(timeout_s=5.0)
