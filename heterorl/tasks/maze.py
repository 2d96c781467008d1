"""Grid mazes: find a walk of U/D/L/R moves from 'S' that stops on 'G'.

A prompt is the grid, one row a line, then a line holding ">" (where the
moves start), e.g. ``"S.#\\n.#.\\n..G\\n>"``. '.' is open, '#' a wall.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass

from heterorl.errors import TaskError
from heterorl.tasks.base import GeneratedTask, Problem

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MAX_TRIES = 10_000


def _require_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"maze option {name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise TaskError(f"maze option {name}={value!r} must be >= {minimum}")


@dataclass(frozen=True)
class MazeConfig:
    """Maze generation settings.

    ``size`` is the side of the square grid; each cell other than S and G is a
    wall with probability ``wall_density``. Mazes are redrawn until the
    shortest S-to-G path (in moves) lies in ``[min_path_len, max_path_len]``
    (no upper bound when ``max_path_len`` is None). The eval set is
    ``eval_size`` mazes drawn from ``random.Random(eval_seed)``, duplicates
    dropped.
    """

    size: int = 5
    wall_density: float = 0.3
    min_path_len: int = 3
    max_path_len: int | None = None
    eval_size: int = 256
    eval_seed: int = 12345

    def __post_init__(self) -> None:
        _require_int("size", self.size, 2)
        _require_int("min_path_len", self.min_path_len, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_seed", self.eval_seed)
        density = self.wall_density
        if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 <= density < 1:
            raise TaskError(f"maze option wall_density={density!r} must be a number in [0, 1)")
        if self.max_path_len is not None:
            _require_int("max_path_len", self.max_path_len, self.min_path_len)


def _shortest_path(grid: list[str], start: tuple[int, int], goal: tuple[int, int]) -> str | None:
    """The shortest S-to-G move string that sorts first with U < D < L < R, or None if G is unreachable."""
    size = len(grid)
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and grid[nxt[0]][nxt[1]] != "#" and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    if start not in dist:
        return None
    moves, here = [], start
    while here != goal:
        for move, (dr, dc) in MOVES.items():
            nxt = (here[0] + dr, here[1] + dc)
            if dist.get(nxt) == dist[here] - 1:
                moves.append(move)
                here = nxt
                break
    return "".join(moves)


def _problem(grid: list[str], start: tuple[int, int], goal: tuple[int, int], path: str) -> Problem:
    text = "\n".join(grid)
    return Problem(
        problem_id="maze-" + hashlib.sha1(text.encode()).hexdigest()[:12],
        prompt=text + "\n>",
        answer=path,
        data={"grid": list(grid), "start": list(start), "goal": list(goal), "shortest": len(path)},
    )


def maze_problem(grid: list[str]) -> Problem:
    """The problem for a hand-written square grid of '.', '#', one 'S' and one 'G'.

    Raises TaskError if the grid is not square, uses other characters, lacks
    exactly one S and one G, or has no path from S to G.
    """
    size = len(grid)
    if size < 2 or any(len(row) != size for row in grid):
        raise TaskError(f"maze grid {grid!r} must be square with side >= 2")
    text = "".join(grid)
    if set(text) - set(".#SG") or text.count("S") != 1 or text.count("G") != 1:
        raise TaskError(f"maze grid {grid!r} must hold only '.', '#' and exactly one 'S' and one 'G'")
    start, goal = divmod(text.index("S"), size), divmod(text.index("G"), size)
    path = _shortest_path(grid, start, goal)
    if path is None:
        raise TaskError(f"maze grid {grid!r} has no path from S to G; open a wall")
    return _problem(grid, start, goal, path)


class MazeTask(GeneratedTask):
    """Procedurally generated mazes; reward 1.0 for a legal walk that ends on G."""

    name = "maze"

    redraw_hint = "raise size or lower eval_size so training mazes remain"

    def __init__(self, config: MazeConfig | None = None) -> None:
        super().__init__(config or MazeConfig())

    def alphabet(self) -> str:
        return ".#SG\n>UDLR"

    def generate(self, rng: random.Random) -> Problem:
        """Draw one maze meeting the config (eval mazes included); TaskError if none is found in 10,000 tries."""
        cfg = self.config
        cells = cfg.size * cfg.size
        longest = cfg.max_path_len if cfg.max_path_len is not None else cells
        for _ in range(MAX_TRIES):
            s = rng.randrange(cells)
            g = rng.randrange(cells - 1)
            g += g >= s
            start, goal = divmod(s, cfg.size), divmod(g, cfg.size)
            rows = []
            for r in range(cfg.size):
                row = ["#" if rng.random() < cfg.wall_density else "." for _ in range(cfg.size)]
                if r == start[0]:
                    row[start[1]] = "S"
                if r == goal[0]:
                    row[goal[1]] = "G"
                rows.append("".join(row))
            path = _shortest_path(rows, start, goal)
            if path is not None and cfg.min_path_len <= len(path) <= longest:
                return _problem(rows, start, goal, path)
        raise TaskError(
            f"no {cfg.size}x{cfg.size} maze with a shortest path of {cfg.min_path_len}.."
            f"{cfg.max_path_len if cfg.max_path_len is not None else 'any'} moves found in {MAX_TRIES} tries "
            f"at wall_density={cfg.wall_density}; lower wall_density or min_path_len, "
            "raise max_path_len or size"
        )

    def demonstration(self, problem: Problem) -> str:
        """The shortest path that sorts first with U < D < L < R."""
        return problem.answer

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 iff the moves (trailing whitespace ignored) stay on open cells in the grid and stop on G.

        ``problem`` must carry this task's ``data`` (grid, start, goal).
        """
        try:
            grid, (r, c), goal = problem.data["grid"], problem.data["start"], problem.data["goal"]
        except (KeyError, TypeError, ValueError) as err:
            raise TaskError(
                f"problem {problem.problem_id!r} lacks maze data (grid, start, goal); "
                "score only problems made by MazeTask"
            ) from err
        moves = completion.rstrip()
        if not moves:
            return 0.0
        size = len(grid)
        for move in moves:
            if move not in MOVES:
                return 0.0
            r, c = r + MOVES[move][0], c + MOVES[move][1]
            if not (0 <= r < size and 0 <= c < size) or grid[r][c] == "#":
                return 0.0
        return 1.0 if [r, c] == list(goal) else 0.0
