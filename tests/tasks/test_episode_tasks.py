"""What every shipped multi-turn task (calculator, maze_walk) holds, each one test for both: the expert's
episodes score exactly 1.0 on the held-out problems, the alphabet covers every prompt, action and observation
(an episode off script's too), the held-out split is stable and never drawn for training, and a single completion
is not scored. Each task's own rules are tested in its own file, with `play`."""

import random

import pytest

from heterorl.errors import TaskError
from heterorl.tasks import make_task
from heterorl.tasks.calculator import CalculatorTask
from heterorl.tasks.environment import EpisodeTask, is_multi_turn
from heterorl.tasks.maze_walk import MazeWalkTask


def play(env, actions):
    """The observations of ``actions`` played through ``env``, and the last step's result."""
    observations, result = [], None
    for action in actions:
        assert result is None or not result.done, "a step after the episode ended"
        result = env.step(action)
        observations.append(result.observation)
    return observations, result


def refused_calls(env, rng: random.Random) -> list[str]:
    """A calculator episode off script: calls answered with an error, a value, the limit; what it showed."""
    actions = ["<calc>(</calc>", "<calc>1</calc>", "<calc>(1)</calc>"]
    observations, _ = play(env, actions)
    return actions + observations


def random_walk(env, rng: random.Random) -> list[str]:
    """A maze_walk episode off script: random moves and invalid turns until it ends; what it showed."""
    shown, result = [], None
    while result is None or not result.done:
        action = rng.choice("UDLR?")
        result = env.step(action)
        shown += [action, result.observation]
    return shown


@pytest.mark.parametrize("name, kind, expert_shows", [
    ("calculator", CalculatorTask,  # its first call computes the answer
     lambda problem, actions, observations: observations[0] == f"\n={problem.answer}\n"),
    ("maze_walk", MazeWalkTask,  # its walk is a shortest one
     lambda problem, actions, observations: len(actions) == problem.data["shortest"]),
])
def test_the_expert_scores_exactly_one_on_every_eval_problem(name, kind, expert_shows):
    task = make_task(name)
    assert isinstance(task, kind) and isinstance(task, EpisodeTask) and is_multi_turn(task)
    for problem in task.eval_problems()[:50]:
        env = task.environment(problem)
        assert env.reset(problem) == problem.prompt
        actions = task.demonstration(problem)
        observations, result = play(env, actions)
        assert expert_shows(problem, actions, observations), problem.prompt
        assert result.done and result.reward == 1.0, problem.prompt


@pytest.mark.parametrize("name, off_script, must_see", [
    ("calculator", refused_calls, "-*+()"),
    ("maze_walk", random_walk, "#?SG>"),  # bumps and invalid turns were seen
])
def test_the_alphabet_covers_every_prompt_action_and_observation(name, off_script, must_see):
    task, rng = make_task(name), random.Random(0)
    seen = set()
    for _ in range(200):
        problem = task.sample_train(rng)
        env = task.environment(problem)
        seen |= set(env.reset(problem))
        actions = task.demonstration(problem)
        observations, _ = play(env, actions)
        seen |= set("".join(actions) + "".join(observations))
        env.reset(problem)
        seen |= set("".join(off_script(env, rng)))
    assert set(must_see) <= seen
    assert seen <= set(task.alphabet()), seen - set(task.alphabet())


@pytest.mark.parametrize("name, options, draws", [
    ("calculator", {"digits": 1, "eval_size": 64}, 2000),  # a small space: 1,000 * 9 expressions
    ("maze_walk", {"eval_size": 64}, 300),
])
def test_held_out_problems_are_stable_and_never_drawn_for_training(name, options, draws):
    task = make_task(name, options)
    held_out = {p.prompt for p in task.eval_problems()}
    assert held_out == {p.prompt for p in make_task(name, options).eval_problems()}
    rng = random.Random(1)
    assert not held_out & {task.sample_train(rng).prompt for _ in range(draws)}


@pytest.mark.parametrize("name", ["calculator", "maze_walk"])
def test_a_single_completion_is_not_scored(name):
    task = make_task(name)
    problem = task.eval_problems()[0]
    with pytest.raises(TaskError, match="scored by its environment"):
        task.reward(problem, "".join(task.demonstration(problem)))  # not even the expert's turns, as one text
