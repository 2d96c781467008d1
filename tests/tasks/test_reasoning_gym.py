"""reasoning-gym's datasets as a task: prompts from its generators, its own scoring as the reward (bounded and
counted by GuardedScore), a held-out split never drawn for training, weighted mixtures with success per dataset,
and `heterorl tasks`."""

import json
import random
import time
from collections import Counter

import pytest

from heterorl.cli import main
from heterorl.engines.base import SampleOutput
from heterorl.errors import TaskError
from heterorl.policies.tiny import build_char_tokenizer
from heterorl.runs import StepRecorder
from heterorl.tasks import TASKS, make_task
from heterorl.tasks.guarded import MAX_ABANDONED_CALLS, GuardedScore
from heterorl.tasks.rewards import outcome_counts
from heterorl.training.evaluation import evaluate

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (the [dev] extra has it)")

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 1-digit sums: a small space


def chain_sum(**options):
    return make_task("reasoning_gym", {"dataset": "chain_sum", "config": SMALL, **options}, reward_timeout_s=5)


def test_the_librarys_own_scoring_is_the_reward_right_scores_one_and_wrong_scores_zero():
    task = chain_sum()
    problem = task.sample_train(random.Random(0))
    assert problem.prompt.startswith("State the final answer to the following arithmetic problem:")
    assert problem.prompt.endswith("Give only your final answer, inside <answer></answer>.")
    assert task.reward(problem, f"Thinking... <answer> {problem.answer} </answer>") == 1.0
    assert task.reward(problem, task.demonstration(problem)) == 1.0
    assert task.reward(problem, "<answer>x</answer>") == 0.0
    assert task.reward(problem, problem.answer) == 0.0  # no tags: no answer
    assert task.stats == Counter({"ok": 3, "no_answer": 1})
    assert outcome_counts(task) == task.stats  # what a worker reports as reward_outcomes
    plain = chain_sum(answer_format="plain", instruction="")
    problem = plain.sample_train(random.Random(1))
    assert problem.prompt.endswith("=")  # the question alone
    assert plain.reward(problem, f" {problem.answer}\n") == 1.0
    assert plain.reward(problem, str(int(problem.answer) + 1)) == 0.0


def test_training_never_draws_a_held_out_question_and_the_split_is_seeded():
    task = chain_sum(eval_size=60)
    held_out = {p.prompt for p in task.eval_problems()}
    assert 10 < len(held_out) <= 60  # repeated items are held out once
    rng = random.Random(0)
    drawn = [task.sample_train(rng) for _ in range(2000)]
    assert not {p.prompt for p in drawn} & held_out
    assert all(p.data["split"] == "train" for p in drawn)
    assert [p.prompt for p in chain_sum(eval_size=60).eval_problems()] == [p.prompt for p in task.eval_problems()]
    assert [p.prompt for p in chain_sum(eval_size=60, eval_seed=7).eval_problems()] != \
        [p.prompt for p in task.eval_problems()]


def test_a_mixture_draws_by_weight_and_evaluation_reports_success_per_dataset():
    task = make_task("reasoning_gym", {"datasets": {"chain_sum": {"weight": 1, "config": SMALL},
                                                    "basic_arithmetic": {"weight": 3, "config": {"max_terms": 2}}},
                                       "eval_size": 8})
    rng = random.Random(0)
    counts = Counter(task.sample_train(rng).data["dataset"] for _ in range(2000))
    assert 0.70 < counts["basic_arithmetic"] / 2000 < 0.80
    tokenizer = build_char_tokenizer(task.alphabet())
    by_prompt = {p.prompt: p for p in task.eval_problems()}

    class AnswersChainSumOnly:  # a policy that solves one dataset of the mixture and not the other
        def __init__(self):
            self.tokenizer = tokenizer

        def sample(self, prompts, n, params):
            groups = []
            for prompt in prompts:
                problem = by_prompt[tokenizer.decode(prompt)]
                text = task.demonstration(problem) if problem.data["dataset"] == "chain_sum" else "<answer>?</answer>"
                groups.append([SampleOutput(tokens=tokenizer.encode(text), logprobs=[0.0], stop_reason="eos",
                                            text=text)])
            return type("Done", (), {"result": lambda self: groups})()

    result = evaluate(AnswersChainSumOnly(), task, task.eval_problems(), max_tokens=8)
    assert result.by_group == {"basic_arithmetic": 0.0, "chain_sum": 1.0}
    assert 0 < result.success < 1

    class Cfg:
        class rl:
            eval_every, steps = 1, 1
    recorder = StepRecorder(Cfg, lambda: result)
    recorder.start()
    metrics = {}
    recorder.record(1, metrics, 1.0)
    assert metrics["eval/success/chain_sum"] == 1.0 and metrics["eval/success/basic_arithmetic"] == 0.0
    assert recorder.history[-1]["eval/success/chain_sum"] == 1.0
    assert recorder.result(steps=1, minutes=0.0).final_success == result.success


def test_a_scorer_that_raises_or_hangs_scores_zero_and_is_counted_by_name(monkeypatch):
    task = make_task("reasoning_gym", {"dataset": "chain_sum", "config": SMALL}, reward_timeout_s=0.2)
    problem = task.sample_train(random.Random(0))
    dataset = task._train["chain_sum"]

    def raises(answer, entry):
        raise ValueError("the library's bug")

    monkeypatch.setattr(dataset, "score_answer", raises)
    assert task.reward(problem, task.demonstration(problem)) == 0.0
    monkeypatch.setattr(dataset, "score_answer", lambda answer, entry: time.sleep(2) or 1.0)
    assert task.reward(problem, task.demonstration(problem)) == 0.0
    monkeypatch.setattr(dataset, "score_answer", lambda answer, entry: float("nan"))
    assert task.reward(problem, task.demonstration(problem)) == 0.0
    assert task.stats == Counter({"error:ValueError": 1, "timeout": 1, "bad_value": 1})


def test_a_scorer_that_keeps_hanging_stops_the_run_with_a_message_naming_it():
    scorer = GuardedScore(lambda: time.sleep(5), 0.02, "the test's scorer")
    for _ in range(MAX_ABANDONED_CALLS):
        assert scorer() == 0.0
    with pytest.raises(TaskError, match="the test's scorer has not returned within 0.02 s on 9 calls"):
        scorer(where="problem 9")
    assert GuardedScore(lambda: 1.7, None, "x")() == 1.0 and GuardedScore(lambda: 1.7, None, "x", clip=False)() == 1.7


@pytest.mark.parametrize("options, message", [
    ({}, "exactly one of the options dataset"),
    ({"dataset": "chain_summ"}, "no dataset 'chain_summ'; did you mean chain_sum"),
    ({"dataset": "chain_sum", "config": {"terms": 2}}, "has no option(s) terms; its options: min_terms"),
    ({"dataset": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}, "refused options"),
    ({"datasets": {"chain_sum": 0}}, "weight 0 must be a number > 0"),
    ({"datasets": {"chain_sum": {"wieght": 1}}}, "unknown key"),
    ({"datasets": {"chain_sum": 1}, "config": {"min_terms": 2}}, "in a mixture give each its own"),
    ({"dataset": "chain_sum", "answer_format": "boxed"}, "answer_format='boxed' must be one of"),
    ({"dataset": "chain_sum", "size": 0}, "size=0 must be an integer >= 1"),
])
def test_bad_options_are_refused_with_what_to_change(options, message):
    with pytest.raises(TaskError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_task("reasoning_gym", options)


def test_heterorl_tasks_lists_every_task_and_dataset_and_shows_one(capsys):
    assert main(["tasks"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in TASKS)
    assert "basic_arithmetic" in listed and "countdown" in listed
    assert main(["tasks", "--show", "chain_sum"]) == 0
    shown = capsys.readouterr().out
    assert "min_terms: 2" in shown and "<answer>" in shown
    assert main(["tasks", "--show", "jsonl"]) == 0
    assert 'path: "(required)"' in capsys.readouterr().out
    assert main(["tasks", "--show", "chain_summ"]) == 2
    assert "did you mean chain_sum" in capsys.readouterr().err
    assert main(["tasks", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert set(listing["tasks"]) == set(TASKS) and "chain_sum" in listing["reasoning_gym"]
