"""maze_walk: a maze walked one move a turn; the observations of a hand-written grid, bumps, invalid turns, the
move limit and the step penalty, the options. What it holds as every multi-turn task does (the expert, the
alphabet, the held-out split): tests/tasks/test_episode_tasks.py."""

import pytest

from heterorl.errors import TaskError
from heterorl.tasks.maze import maze_problem
from heterorl.tasks.maze_walk import MazeWalk, MazeWalkConfig, MazeWalkTask, walk_problem
from tests.tasks.test_episode_tasks import play

GRID = ["S.#.",
        "....",
        ".#G.",
        "...."]  # S at 00, G at 22; the shortest walk sorting first with U < D < L < R is DRRD


@pytest.fixture
def problem():
    return walk_problem(maze_problem(GRID))


def test_the_prompt_and_the_observations_of_a_hand_written_grid(problem):
    assert problem.prompt == "S.#.\n....\n.#G.\n....\n00>" and problem.data["shortest"] == 4
    env = MazeWalk()
    assert env.reset(problem) == problem.prompt
    observations, result = play(env, ["D", "R", "R", "D"])
    assert observations == ["\n10>", "\n11>", "\n12>", ""]
    assert result.done and result.reward == 1.0
    assert MazeWalkTask().demonstration(problem) == ["D", "R", "R", "D"]


def test_a_bump_and_an_invalid_turn_leave_the_walker_where_it_was_and_count(problem):
    env = MazeWalk()
    env.reset(problem)
    turns = ["U", "L", "R", "R", " R\n", "", "RR", "x", "D"]  # off the grid twice, into the wall at 02, ...
    observations, result = play(env, turns)
    assert observations == ["\n#00>", "\n#00>", "\n01>", "\n#01>", "\n#01>", "\n?01>", "\n?01>", "\n?01>", "\n11>"]
    assert not result.done and env.moves == len(turns)


def test_running_out_of_moves_ends_the_episode_with_zero(problem):
    env = MazeWalk()  # 2 * 4 + 2 = 10 moves
    env.reset(problem)
    observations, result = play(env, ["U"] * 10)
    assert observations[:9] == ["\n#00>"] * 9 and result.done and result.reward == 0.0
    env = MazeWalk(max_moves=5)
    env.reset(problem)
    _, result = play(env, ["R", "L", "D", "R", "R"])  # one move short of G
    assert result.done and result.reward == 0.0


def test_each_move_past_the_shortest_walk_costs_the_step_penalty(problem):
    env = MazeWalk(step_penalty=0.05)
    env.reset(problem)
    _, result = play(env, ["R", "L", "D", "R", "R", "D"])  # a detour of 2 moves
    assert result.done and result.reward == pytest.approx(1 - 2 * 0.05, abs=1e-12)
    env.reset(problem)  # G reached on the last allowed move (10): it counts, 6 moves past the shortest
    _, result = play(env, ["U"] * 6 + ["D", "R", "R", "D"])
    assert result.done and result.reward == pytest.approx(1 - 6 * 0.05, abs=1e-12)
    env = MazeWalk(step_penalty=0.3)
    env.reset(problem)
    _, result = play(env, ["U"] * 4 + ["D", "R", "R", "D"])  # 1 - 1.2 is clipped to 0
    assert result.done and result.reward == 0.0


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
