"""Mazes walked one move a turn: the policy writes U, D, L or R, the environment answers where the walker stands.

The prompt is the grid, one row a line, then the walker's cell as two digits (row, column) and ">", e.g.
``"S.#.\\n....\\n.#G.\\n....\\n00>"``. Each turn the policy writes one move (then its end-of-sequence token) and
the environment answers, as long as the episode goes on, with the walker's cell after the move:

- ``"\\n01>"``: the move was legal, the walker now stands on row 0, column 1;
- ``"\\n#00>"``: a bump: the move ran into a wall or off the grid, and the walker stayed where it was;
- ``"\\n?00>"``: the turn was not exactly one of U, D, L, R (surrounding whitespace ignored); the walker stayed.

Every turn counts as a move. Reaching G ends the episode with reward
``max(0, 1 - step_penalty * (moves - shortest))``, so a shortest walk scores exactly 1.0; ``max_moves`` moves
(None: ``2 * shortest + 2``) without reaching G end it with reward 0.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from heterorl.errors import TaskError
from heterorl.tasks.base import GeneratedTask, Problem
from heterorl.tasks.environment import Environment, StepResult
from heterorl.tasks.maze import MOVES, MazeConfig, MazeTask

MAX_SIDE = 10  # a cell is written as two digits
BUMP, INVALID = "#", "?"


@dataclass(frozen=True)
class MazeWalkConfig(MazeConfig):
    """The maze options (`heterorl.tasks.maze.MazeConfig`, here with ``size`` 4, at most 10), and the walk's.

    ``max_moves`` is the number of moves an episode may take (None: ``2 * shortest + 2`` for each maze); it must
    be at least the longest shortest path a maze may have (``max_path_len``, else ``size * size - 1``) so that
    every maze can be walked in time. ``step_penalty`` is what each move past the shortest path costs.
    """

    size: int = 4
    max_moves: int | None = None
    step_penalty: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size > MAX_SIDE:
            raise TaskError(f"maze_walk option size={self.size} must be <= {MAX_SIDE}: a cell is written as two "
                            "digits")
        if self.max_moves is not None:
            longest = self.max_path_len if self.max_path_len is not None else self.size * self.size - 1
            if not isinstance(self.max_moves, int) or isinstance(self.max_moves, bool) or self.max_moves < longest:
                raise TaskError(f"maze_walk option max_moves={self.max_moves!r} must be an integer >= {longest}, "
                                "the longest shortest path a maze may have (max_path_len, else size*size - 1); "
                                "lower max_path_len or leave max_moves None (2 * shortest + 2)")
        penalty = self.step_penalty
        if (not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not math.isfinite(penalty)
                or penalty < 0):
            raise TaskError(f"maze_walk option step_penalty={penalty!r} must be a finite number >= 0")


def cell_text(cell) -> str:
    """A cell as the environment writes it: row and column, one digit each (``(0, 1)`` -> ``"01"``)."""
    return f"{cell[0]}{cell[1]}"


def walk_prompt(grid: list[str], start) -> str:
    """The grid, one row a line, then the start cell and ">"."""
    if len(grid) > MAX_SIDE:
        raise TaskError(f"a maze of side {len(grid)} cannot be walked: a cell is written as two digits "
                        f"(side <= {MAX_SIDE})")
    return "\n".join(grid) + "\n" + cell_text(start) + ">"


def walk_problem(maze: Problem) -> Problem:
    """A maze problem (`heterorl.tasks.maze`: ``MazeTask.generate``, ``maze_problem``) prompted for walking."""
    prompt = walk_prompt(maze.data["grid"], maze.data["start"])
    return Problem(problem_id="maze_walk-" + hashlib.sha1(prompt.encode()).hexdigest()[:12], prompt=prompt,
                   answer=maze.answer, data=dict(maze.data))


class MazeWalk(Environment):
    """One walk through one maze (see the module's docstring)."""

    def __init__(self, max_moves: int | None = None, step_penalty: float = 0.05) -> None:
        self.max_moves, self.step_penalty = max_moves, step_penalty

    def reset(self, problem: Problem) -> str:
        try:
            self.grid, self.shortest = problem.data["grid"], int(problem.data["shortest"])
            self.here, self.goal = tuple(problem.data["start"]), tuple(problem.data["goal"])
        except (KeyError, TypeError, ValueError) as err:
            raise TaskError(f"problem {problem.problem_id!r} lacks maze data (grid, start, goal, shortest); "
                            "walk only problems made by MazeWalkTask or walk_problem") from err
        self.moves = 0
        self.limit = self.max_moves if self.max_moves is not None else 2 * self.shortest + 2
        return walk_prompt(self.grid, self.here)

    def step(self, action: str) -> StepResult:
        self.moves += 1
        move, marker = action.strip(), ""
        if move not in MOVES:
            marker = INVALID
        else:
            row, col = self.here[0] + MOVES[move][0], self.here[1] + MOVES[move][1]
            if 0 <= row < len(self.grid) and 0 <= col < len(self.grid) and self.grid[row][col] != "#":
                self.here = (row, col)
            else:
                marker = BUMP
        if self.here == self.goal:
            return StepResult(reward=max(0.0, 1.0 - self.step_penalty * (self.moves - self.shortest)), done=True)
        if self.moves >= self.limit:
            return StepResult(reward=0.0, done=True)
        return StepResult("\n" + marker + cell_text(self.here) + ">")


class MazeWalkTask(GeneratedTask):
    """Mazes walked one move a turn, scored by the environment: 1.0 for a shortest walk to G, less per extra move.

    The mazes are `MazeTask`'s for the same options; ``demonstration`` is its shortest path, one move a turn.
    """

    name = "maze_walk"

    redraw_hint = MazeTask.redraw_hint

    def __init__(self, config: MazeWalkConfig | None = None) -> None:
        super().__init__(config or MazeWalkConfig())
        self._mazes = MazeTask(self.config)

    def alphabet(self) -> str:
        return ".#SG\n>UDLR?0123456789"

    def generate(self, rng: random.Random) -> Problem:
        """Draw one maze meeting the config (eval mazes included), prompted for walking."""
        return walk_problem(self._mazes.generate(rng))

    def environment(self, problem: Problem) -> MazeWalk:
        return MazeWalk(self.config.max_moves, self.config.step_penalty)

    def demonstration(self, problem: Problem) -> list[str]:
        """The shortest path that sorts first with U < D < L < R, one move a turn."""
        return list(problem.answer)

    def reward(self, problem: Problem, completion: str) -> float:
        raise TaskError("maze_walk is scored by its environment, turn by turn (task.environment(problem)); "
                        "a single completion has no reward")
