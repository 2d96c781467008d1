"""A verifiers taskset as a task (task.name=verifiers): the taskset's prompts rendered to text, its own rewards
scoring our completions (bounded and counted by GuardedScore), a held-out split never drawn for training, its
answers as demonstrations, and the config's errors. The taskset is tests/tasks/verifiers_envs.py, run by the
real library."""

import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from heterorl.errors import TaskError
from heterorl.tasks import make_task
from heterorl.tasks.rewards import outcome_counts

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (the [dev] extra has it)")

ENVS = "tests.tasks.verifiers_envs"
SYSTEM = "Put the final answer in \\boxed{}."


def verifiers_task(env: str = f"{ENVS}:load_environment", reward_timeout_s: float | None = 5.0, **options):
    return make_task("verifiers", {"env": env, **options}, reward_timeout_s=reward_timeout_s)


def test_the_tasks_own_reward_scores_our_completion_right_one_wrong_zero():
    task = verifiers_task()
    problem = task.sample_train(random.Random(0))
    question = problem.prompt.split("\n\n")[1]
    assert problem.prompt == f"{SYSTEM}\n\n{question}"  # system prompt, a blank line, the user message
    answer = str(int(question.removeprefix("What is ").removesuffix(" + 3?")) + 3)
    assert problem.answer == answer
    assert task.reward(problem, f"Adding three: \\boxed{{{answer}}}") == 1.0
    assert task.reward(problem, answer) == 1.0  # unboxed text counts whole (the library's extract_boxed_answer)
    assert task.reward(problem, f"\\boxed{{{int(answer) + 1}}}") == 0.0
    assert task.stats == Counter({"ok": 3})
    assert outcome_counts(task) == Counter({"ok": 3})


def test_a_prompt_of_chat_messages_renders_as_the_same_text_and_a_conversation_is_refused():
    text = verifiers_task(split_seed=3)
    messages = verifiers_task(split_seed=3, env_args={"messages": True})
    assert [p.prompt for p in messages.eval_problems()] == [p.prompt for p in text.eval_problems()]
    problem = messages.eval_problems()[0]
    assert messages.reward(problem, problem.answer) == 1.0
    with pytest.raises(TaskError, match="its prompt holds an 'assistant' message; heterorl renders single-turn"):
        verifiers_task(env_args={"assistant_in_prompt": True})


def test_eval_problems_are_held_out_and_never_drawn_for_training():
    task = verifiers_task(env_args={"n": 40}, eval_size=10, split_seed=7)
    eval_prompts = {p.prompt for p in task.eval_problems()}
    assert len(eval_prompts) == 10
    assert task.eval_problems() == verifiers_task(env_args={"n": 40}, eval_size=10, split_seed=7).eval_problems()
    rng = random.Random(1)
    drawn = {task.sample_train(rng).prompt for _ in range(600)}
    assert drawn.isdisjoint(eval_prompts)
    assert len(drawn) == 30  # every other task is drawn
    assert len(verifiers_task(env_args={"n": 40}).eval_problems()) == 4  # eval_fraction 0.1


def test_eval_env_args_build_the_eval_set_and_training_skips_its_prompts():
    # train: a in [0, 20); eval: a in [15, 25), so 15..19 are in both and must leave training
    task = verifiers_task(env_args={"n": 20}, eval_env_args={"n": 10, "first": 15})
    assert sorted(p.answer for p in task.eval_problems()) == [str(a + 3) for a in range(15, 25)]
    rng = random.Random(0)
    drawn = {task.sample_train(rng).answer for _ in range(500)}
    assert drawn == {str(a + 3) for a in range(15)}
    assert len(verifiers_task(env_args={"n": 20}, eval_env_args={"n": 10}, eval_size=4).eval_problems()) == 4


def test_every_demonstration_scores_one_and_a_taskset_without_answers_has_none():
    task = verifiers_task()
    problems = task.eval_problems() + [task.sample_train(random.Random(i)) for i in range(30)]
    assert all(task.reward(p, task.demonstration(p)) == 1.0 for p in problems)
    no_answers = verifiers_task(answer_field="solution")
    with pytest.raises(TaskError, match="has no demonstrations for SFT: its tasks have no 'solution' field"):
        no_answers.demonstration(no_answers.eval_problems()[0])


def test_a_reward_that_raises_scores_zero_and_is_counted_by_its_exception():
    task = verifiers_task(env_args={"mode": "raise"})
    problem = task.eval_problems()[0]
    assert task.reward(problem, problem.answer) == 0.0
    assert task.reward(problem, "anything") == 0.0
    assert task.stats == Counter({"error:ValueError": 2})


def test_a_reward_that_hangs_past_the_limit_scores_zero_and_is_counted_as_a_timeout():
    task = verifiers_task(env_args={"mode": "hang"}, reward_timeout_s=0.2)
    problem = task.eval_problems()[0]
    started = time.monotonic()
    assert task.reward(problem, problem.answer) == 0.0
    assert time.monotonic() - started < 1.5
    assert task.stats == Counter({"timeout": 1})


def test_the_weighted_sum_is_kept_as_the_library_gives_it_not_clipped():
    # the library's own reward override: the task config gives `correct` weight 2.5
    task = verifiers_task(env_args={"task": {"rewards": {"correct": {"weight": 2.5}}}},
                          env=f"{ENVS}:ArithmeticTaskset")
    problem = task.eval_problems()[0]
    assert task.reward(problem, problem.answer) == 2.5
    assert task.reward(problem, "no") == 0.0


def test_threads_that_score_at_once_each_get_the_right_reward():
    task = verifiers_task(reward_timeout_s=None)  # no limit: every call runs in its caller's thread, on its loop
    problems = task.eval_problems()
    results: dict[int, list[float]] = {}

    def score(worker: int) -> None:
        results[worker] = [task.reward(p, p.answer if (i + worker) % 2 else "wrong")
                           for i, p in enumerate(problems * 5)]

    threads = [threading.Thread(target=score, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for worker, rewards in results.items():
        assert rewards == [1.0 if (i + worker) % 2 else 0.0 for i in range(len(problems) * 5)]
    assert task.stats == Counter({"ok": 4 * 5 * len(problems)})


def test_a_taskset_class_an_env_and_an_infinite_taskset(monkeypatch):
    by_class = verifiers_task(env=f"{ENVS}:ArithmeticTaskset", env_args={"n": 12})
    rng = random.Random(0)
    assert len(by_class.eval_problems()) == 1 and len({by_class.sample_train(rng).prompt for _ in range(300)}) == 11
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the library imports a taskset id as a module
    by_env = verifiers_task(env=f"{ENVS}:load_single_agent_env", env_args={"n": 12})
    assert by_env.eval_problems() == by_class.eval_problems()
    problem = by_env.eval_problems()[0]
    assert by_env.reward(problem, problem.answer) == 1.0
    with pytest.raises(TaskError, match="is an infinite taskset; bound it with task.options.max_tasks"):
        verifiers_task(env_args={"infinite": True})
    bounded = verifiers_task(env_args={"infinite": True}, max_tasks=30)
    assert len(bounded.eval_problems()) + len({bounded.sample_train(rng).prompt for _ in range(600)}) == 30


@pytest.mark.parametrize("options, message", [
    ({"env": f"{ENVS}.load_environment"}, "must look like 'package.module:name'"),
    ({"env": "no_such_module_here:load"}, "cannot import module 'no_such_module_here'"),
    ({"env": f"{ENVS}:no_such_function"}, "has no attribute 'no_such_function'"),
    ({"env": f"{ENVS}:not_a_taskset"}, "returned a dict, not a verifiers Taskset or Env"),
    ({"env": f"{ENVS}:ArithmeticTaskset", "env_args": {"n": "many"}}, r"with arguments \{'n': 'many'\} raised"),
    ({"env": f"{ENVS}:load_environment", "env_args": {"sandbox": True}}, "rewards \\['correct'\\] need a runtime"),
    ({"env": f"{ENVS}:load_environment", "eval_size": 20}, "leaves no training rows of 20"),
    ({"env": f"{ENVS}:load_environment", "eval_fraction": 1.5}, "eval_fraction=1.5 must be a number in"),
    ({"env": f"{ENVS}:load_environment", "env_args": ["n", 3]}, "env_args=\\['n', 3\\] must be a mapping"),
    ({"env": f"{ENVS}:load_environment", "seed": 3}, "unknown option 'seed' for task 'verifiers'"),
    ({}, "task 'verifiers' needs option\\(s\\) env"),
])
def test_a_bad_config_is_a_task_error_that_says_what_to_fix(options, message):
    with pytest.raises(TaskError, match=message):
        make_task("verifiers", options, reward_timeout_s=1.0)


def test_a_problem_from_another_config_is_refused_by_name():
    task = verifiers_task()
    other = verifiers_task(env_args={"first": 100}).eval_problems()[0]
    with pytest.raises(TaskError, match="is not a task of verifiers env .* options must match the learner's"):
        task.reward(other, other.answer)
