"""maze_walk: a maze walked one move a turn; the observations of a hand-written grid, bumps, invalid turns, the
move limit and the step penalty, the expert's walk scoring exactly 1.0, the alphabet, the held-out split."""

import random

import pytest

from heterorl.errors import TaskError
from heterorl.tasks import make_task
from heterorl.tasks.environment import EpisodeTask, is_multi_turn
from heterorl.tasks.maze import maze_problem
from heterorl.tasks.maze_walk import MazeWalk, MazeWalkConfig, MazeWalkTask, walk_problem

GRID = ["S.#.",
        "....",
        ".#G.",
        "...."]  # S at 00, G at 22; the shortest walk sorting first with U < D < L < R is DRRD


def walk(env: MazeWalk, actions):
    """The observations of ``actions`` played through ``env``, and the last step's result."""
    observations, result = [], None
    for action in actions:
        assert result is None or not result.done, "a step after the episode ended"
        result = env.step(action)
        observations.append(result.observation)
    return observations, result


@pytest.fixture
def problem():
    return walk_problem(maze_problem(GRID))


def test_the_prompt_and_the_observations_of_a_hand_written_grid(problem):
    assert problem.prompt == "S.#.\n....\n.#G.\n....\n00>" and problem.data["shortest"] == 4
    env = MazeWalk()
    assert env.reset(problem) == problem.prompt
    observations, result = walk(env, ["D", "R", "R", "D"])
    assert observations == ["\n10>", "\n11>", "\n12>", ""]
    assert result.done and result.reward == 1.0
    assert MazeWalkTask().demonstration(problem) == ["D", "R", "R", "D"]


def test_a_bump_and_an_invalid_turn_leave_the_walker_where_it_was_and_count(problem):
    env = MazeWalk()
    env.reset(problem)
    turns = ["U", "L", "R", "R", " R\n", "", "RR", "x", "D"]  # off the grid twice, into the wall at 02, ...
    observations, result = walk(env, turns)
    assert observations == ["\n#00>", "\n#00>", "\n01>", "\n#01>", "\n#01>", "\n?01>", "\n?01>", "\n?01>", "\n11>"]
    assert not result.done and env.moves == len(turns)


def test_running_out_of_moves_ends_the_episode_with_zero(problem):
    env = MazeWalk()  # 2 * 4 + 2 = 10 moves
    env.reset(problem)
    observations, result = walk(env, ["U"] * 10)
    assert observations[:9] == ["\n#00>"] * 9 and result.done and result.reward == 0.0
    env = MazeWalk(max_moves=5)
    env.reset(problem)
    _, result = walk(env, ["R", "L", "D", "R", "R"])  # one move short of G
    assert result.done and result.reward == 0.0


def test_each_move_past_the_shortest_walk_costs_the_step_penalty(problem):
    env = MazeWalk(step_penalty=0.05)
    env.reset(problem)
    _, result = walk(env, ["R", "L", "D", "R", "R", "D"])  # a detour of 2 moves
    assert result.done and result.reward == pytest.approx(1 - 2 * 0.05, abs=1e-12)
    env.reset(problem)  # G reached on the last allowed move (10): it counts, 6 moves past the shortest
    _, result = walk(env, ["U"] * 6 + ["D", "R", "R", "D"])
    assert result.done and result.reward == pytest.approx(1 - 6 * 0.05, abs=1e-12)
    env = MazeWalk(step_penalty=0.3)
    env.reset(problem)
    _, result = walk(env, ["U"] * 4 + ["D", "R", "R", "D"])  # 1 - 1.2 is clipped to 0
    assert result.done and result.reward == 0.0


def test_the_expert_walks_every_eval_maze_in_its_shortest_path_for_exactly_one():
    task = make_task("maze_walk")
    assert isinstance(task, MazeWalkTask) and isinstance(task, EpisodeTask) and is_multi_turn(task)
    for problem in task.eval_problems()[:50]:
        env = task.environment(problem)
        assert env.reset(problem) == problem.prompt
        actions = task.demonstration(problem)
        assert len(actions) == problem.data["shortest"]
        _, result = walk(env, actions)
        assert result.done and result.reward == 1.0, problem.prompt


def test_the_alphabet_covers_every_prompt_action_and_observation():
    task, rng = MazeWalkTask(), random.Random(0)
    seen = set()
    for _ in range(200):
        problem = task.sample_train(rng)
        env = task.environment(problem)
        seen |= set(env.reset(problem))
        actions = task.demonstration(problem)
        observations, _ = walk(env, actions)
        seen |= set("".join(actions) + "".join(observations))
        env.reset(problem)
        result = None
        while result is None or not result.done:  # a random walk, with invalid turns: bumps, "?"
            action = rng.choice("UDLR?")
            result = env.step(action)
            seen |= set(action + result.observation)
    assert {"#", "?", "S", "G", ">"} <= seen  # bumps and invalid turns were seen
    assert seen <= set(task.alphabet()), seen - set(task.alphabet())


def test_held_out_mazes_are_stable_and_never_drawn_for_training():
    task = MazeWalkTask(MazeWalkConfig(eval_size=64))
    held_out = {p.prompt for p in task.eval_problems()}
    assert held_out == {p.prompt for p in MazeWalkTask(MazeWalkConfig(eval_size=64)).eval_problems()}
    rng = random.Random(1)
    assert not held_out & {task.sample_train(rng).prompt for _ in range(300)}


def test_a_single_completion_is_not_scored(problem):
    with pytest.raises(TaskError, match="scored by its environment"):
        MazeWalkTask().reward(problem, "DRRD")


@pytest.mark.parametrize("options, field", [
    ({"size": 11}, "size"),
    ({"max_moves": 14}, "max_moves"),  # a 4x4 maze's shortest path may be 15 moves
    ({"max_moves": 5, "max_path_len": 6}, "max_moves"),
    ({"max_moves": 6.0}, "max_moves"),
    ({"step_penalty": -0.1}, "step_penalty"),
    ({"step_penalty": float("nan")}, "step_penalty"),
    ({"wall_density": 1.0}, "wall_density"),  # the maze options are checked as the maze task's
])
def test_bad_options_are_refused_naming_the_option(options, field):
    with pytest.raises(TaskError, match=field):
        MazeWalkConfig(**options)
    assert MazeWalkConfig(max_moves=15).max_moves == 15 and MazeWalkConfig(max_moves=6, max_path_len=6)
