"""verifiers_multiturn: a verifiers 0.4 env's run() played by a scripted policy through reset/step, to the env's
and the task's rewards; the seat's max_turns and the task's @vf.stop ending the exchange; the env's own error
passing through; a reward that raises scored 0 and counted; what the seat refuses to play; the rendering."""

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (the [dev] extra has it)")

import verifiers.v1 as vf  # noqa: E402

from heterorl.errors import TaskError  # noqa: E402
from heterorl.tasks import make_task  # noqa: E402
from heterorl.tasks.environment import EnvContractError, checked_step, is_multi_turn  # noqa: E402
from heterorl.tasks.verifiers_multiturn import (  # noqa: E402
    VerifiersMultiTurnConfig,
    VerifiersMultiTurnTask,
    render_turn,
)

TASKSET = {"id": "vf-guess-fixture"}  # tests/tasks/vf_guess_fixture.py, imported by the library as a top-level module


@pytest.fixture(scope="module", autouse=True)
def taskset_on_path():
    folder = str(Path(__file__).parent)
    sys.path.insert(0, folder)
    yield
    sys.path.remove(folder)


def make(env=None, **options) -> VerifiersMultiTurnTask:
    return VerifiersMultiTurnTask(VerifiersMultiTurnConfig(env=env or {"taskset": TASKSET}, **options))


@pytest.fixture(scope="module")
def guess(taskset_on_path) -> VerifiersMultiTurnTask:
    return make(eval_size=2)


def episode(task: VerifiersMultiTurnTask, secret: int):
    """A fresh episode of the task whose secret is ``secret``, reset: (environment, first observation)."""
    problem = next(p for p in task._train + task._eval if task._tasks[p.problem_id].data.secret == secret)
    env = task.environment(problem)
    return env, env.reset(problem)


def play(env, actions):
    return [checked_step(env.step(action)) for action in actions]


def test_an_episode_reaches_the_envs_and_the_tasks_rewards(guess):
    env, prompt = episode(guess, secret=4)
    assert prompt == "Guess a number in 0..9."
    before = guess.stats["ok"]
    results = play(env, ["1", "8", "4"])
    assert [(r.observation, r.reward, r.done) for r in results[:2]] == [("\nhigher\n", 0.0, False),
                                                                        ("\nlower\n", 0.0, False)]
    # solved (1.0, recorded by run) + brevity (1 / 3 turns, weight 0.5, the task's own reward)
    assert (results[2].observation, results[2].done) == ("", True)
    assert results[2].reward == pytest.approx(1.0 + 0.5 / 3)
    assert guess.stats["ok"] == before + 1
    trace = env._handoff.chat.trace
    assert [m.content for m in trace.messages] == ["Guess a number in 0..9.", "1", "higher", "8", "lower", "4"]
    assert trace.num_turns == 3 and trace.stop_condition == "user_closed"


def test_the_seats_max_turns_ends_the_episode(guess):
    """The seat's max_turns (4) refuses the fifth turn: run() sees a terminated segment and returns."""
    env, _ = episode(guess, secret=7)
    results = play(env, ["1", "2", "3", "9"])
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].reward == pytest.approx(0.5 / 4)  # not solved: brevity only
    assert env._handoff.chat.trace.stop_condition == "max_turns"


def test_a_stop_hook_of_the_task_ends_the_exchange(guess):
    env, _ = episode(guess, secret=3)
    (result,) = play(env, ["quit"])
    assert (result.done, result.reward) == (True, pytest.approx(0.5))
    assert env._handoff.chat.trace.stop_condition == "gave_up"
    # "sure?" was never sent: the stop fired before the turn
    assert [m.content for m in env._handoff.chat.trace.messages] == ["Guess a number in 0..9.", "quit"]


def test_an_error_in_the_envs_run_propagates_as_it_is(guess):
    env, _ = episode(guess, secret=6)
    with pytest.raises(ValueError, match="invalid literal for int"):
        env.step("six")
    assert env._run.done()


def test_an_episode_left_unfinished_has_its_run_cancelled(caplog):
    """The runner drops an episode it ends itself (its max_turns, its token budget): the env's run, suspended on
    the task's loop, is cancelled then, not left pending."""
    task = make(eval_size=2)
    env, _ = episode(task, secret=4)
    env.step("1")
    run = env._run
    del env
    assert run.cancelled()
    assert task.loop.run(pending_tasks()) == 0
    assert "destroyed but it is pending" not in caplog.text


async def pending_tasks() -> int:
    await asyncio.sleep(0)  # the cancellation, scheduled before this, has run
    return len(asyncio.all_tasks()) - 1


def test_a_reward_that_raises_scores_zero_and_is_counted():
    task = make_task("verifiers_multiturn", {"env": {"taskset": {**TASKSET, "task": {"broken_reward": True}}},
                                             "eval_size": 2}, reward_timeout_s=10)
    assert isinstance(task, VerifiersMultiTurnTask) and task._score.call.timeout_s == 10
    env, _ = episode(task, secret=9)
    (result,) = play(env, ["9"])
    assert (result.done, result.reward) == (True, 0.0)
    assert task.stats == {"error:ZeroDivisionError": 1}


def test_the_split_is_held_out_by_task_key(guess):
    assert is_multi_turn(guess) and guess.name == "verifiers_multiturn" and guess.seat == "player"
    held_out = {p.problem_id for p in guess.eval_problems()}
    assert len(held_out) == 2 and len(guess._train) == 4 and not held_out & {p.problem_id for p in guess._train}
    assert make(eval_size=2).eval_problems() == guess.eval_problems()
    by_taskset = make(eval_taskset={**TASKSET, "size": 2}, eval_size=1)
    assert len(by_taskset.eval_problems()) == 1 and len(by_taskset._train) == 5


def test_seats_the_policy_cannot_play_are_refused():
    user_sim = {"id": "user-sim", "taskset": TASKSET}  # the library's env: an assistant seat and a modeled user
    with pytest.raises(TaskError, match=r"its agent seats are \['assistant', 'user'\]; name the one"):
        make(user_sim)
    with pytest.raises(TaskError, match=r"its seats \['user'\] besides the policy's need a model"):
        make(user_sim, seat="assistant")
    with pytest.raises(TaskError, match=r"seat 'player' caps tokens \(max_input_tokens=100\)"):
        make({"taskset": TASKSET, "player": {"max_input_tokens": 100}})
    with pytest.raises(TaskError, match="needs taskset.id"):
        VerifiersMultiTurnConfig(env={"taskset": {}})
    with pytest.raises(TaskError, match="the library could not build it"):
        make({"taskset": {"id": "no-such-taskset"}})


def test_render_turn():
    messages = [vf.SystemMessage(content="Be brief."), vf.UserMessage(content="Guess.")]
    assert render_turn(messages, opening=True) == "Be brief.\n\nGuess."
    assert render_turn([vf.UserMessage(content="lower")], opening=False) == "\nlower\n"
    image = vf.UserMessage(content=[vf.ImageUrlContentPart(image_url={"url": "data:image/png;base64,AA=="})])
    with pytest.raises(EnvContractError, match="image_url content; heterorl observations are text"):
        render_turn([image], opening=False)
