"""Tasks: maze, arithmetic, JSONL, answer extraction, custom reward functions, the registry."""

from __future__ import annotations

import importlib
import io
import json
import random
import re
import sys
import threading
import time
from collections import deque

import pytest

from heterorl.errors import ConfigError, TaskError
from heterorl.tasks import TASKS, Problem, Task, make_task, make_task_from
from heterorl.tasks.answers import answers_match, extract_boxed_answer, extract_hash_answer
from heterorl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from heterorl.tasks.jsonl import JsonlConfig, JsonlTask
from heterorl.tasks.maze import MazeConfig, MazeTask, maze_problem
from heterorl.tasks.rewards import (
    REWARD_FACTS,
    CallTimedOut,
    CustomRewardTask,
    TimedCall,
    accepted_facts,
    load_reward_fn,
    score,
)

# ---------------------------------------------------------------- maze

MAZE3 = ["S.#", ".#.", "..G"]  # only path: DDRR
MAZE4 = ["S.#.", "#...", "..#G", "...."]  # only shortest path: RDRRD


def bfs_len(grid: list[str]) -> int | None:
    """Independent BFS: shortest S-to-G moves, or None."""
    n = len(grid)
    cells = {(r, c): ch for r, row in enumerate(grid) for c, ch in enumerate(row)}
    start = next(p for p, ch in cells.items() if ch == "S")
    dist, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if cells[(r, c)] == "G":
            return dist[(r, c)]
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < n and 0 <= nc < n and cells[(nr, nc)] != "#" and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return None


def test_maze_problem_layout():
    p = maze_problem(MAZE3)
    assert p.prompt == "S.#\n.#.\n..G\n>"
    assert p.answer == "DDRR"
    assert p.data == {"grid": MAZE3, "start": [0, 0], "goal": [2, 2], "shortest": 4}
    assert re.fullmatch(r"maze-[0-9a-f]{12}", p.problem_id)
    assert maze_problem(list(MAZE3)).problem_id == p.problem_id
    assert maze_problem(MAZE4).problem_id != p.problem_id


@pytest.mark.parametrize(
    "moves, expected",
    [
        ("DDRR", 1.0),
        ("DDRR\n", 1.0),  # trailing whitespace ignored
        ("DDRR  ", 1.0),
        ("DDRRUD", 1.0),  # leaves G and comes back: still stops on G
        (" DDRR", 0.0),  # leading whitespace is not a move
        ("RD", 0.0),  # (1,1) is a wall
        ("RR", 0.0),  # (0,2) is a wall
        ("U", 0.0),  # off the top
        ("L", 0.0),  # off the left
        ("DDR", 0.0),  # stops short
        ("DDRRU", 0.0),  # overshoots G to (1,2)
        ("DDRRD", 0.0),  # overshoots G off the grid
        ("ddrr", 0.0),
        ("DDXRR", 0.0),
        ("DDRR#", 0.0),
        ("D D R R", 0.0),
        ("", 0.0),
        ("  \n", 0.0),
    ],
)
def test_maze_reward_3x3(moves, expected):
    assert MazeTask().reward(maze_problem(MAZE3), moves) == expected


@pytest.mark.parametrize(
    "moves, expected",
    [
        ("RDRRD", 1.0),
        ("RDDDRRU", 1.0),  # longer legal walk around the wall
        ("DR", 0.0),  # (1,0) is a wall
        ("RR", 0.0),  # (0,2) is a wall
        ("RDRRR", 0.0),  # off the right edge
        ("RDRR", 0.0),  # stops at (1,3)
        ("RDRRDD", 0.0),  # overshoots to (3,3)
        ("RDRRDL", 0.0),  # (2,2) is a wall
        ("RDRRD!", 0.0),
    ],
)
def test_maze_reward_4x4(moves, expected):
    p = maze_problem(MAZE4)
    assert p.answer == "RDRRD" and p.data["shortest"] == 5
    assert MazeTask().reward(p, moves) == expected


def test_maze_demonstration_tie_break_prefers_u_d_l_r():
    assert maze_problem(["S..", "...", "..G"]).answer == "DDRR"
    assert maze_problem(["G..", "...", "..S"]).answer == "UULL"
    assert maze_problem(["..G", "...", "S.."]).answer == "UURR"


@pytest.mark.parametrize(
    "grid", [["S.", "G"], ["S.", "GG"], ["S..", ".x.", "..G"], ["S#", "#G"], ["S"]]
)
def test_maze_problem_rejects_bad_grids(grid):
    with pytest.raises(TaskError, match="maze grid"):
        maze_problem(grid)


@pytest.mark.parametrize(
    "config",
    [
        MazeConfig(size=3, wall_density=0.2, min_path_len=2),
        MazeConfig(size=5, wall_density=0.3, min_path_len=3, max_path_len=6),
        MazeConfig(size=7, wall_density=0.4, min_path_len=6),
        MazeConfig(size=4, wall_density=0.0, min_path_len=1),
    ],
)
def test_generated_mazes_are_valid(config):
    task = MazeTask(config)
    longest = config.max_path_len or config.size**2
    for seed in range(3):
        rng = random.Random(seed)
        for _ in range(25):
            p = task.generate(rng)
            grid = p.data["grid"]
            assert len(grid) == config.size and all(len(row) == config.size for row in grid)
            assert "".join(grid).count("S") == 1 and "".join(grid).count("G") == 1
            assert set("".join(grid)) <= set(".#SG")
            assert p.prompt == "\n".join(grid) + "\n>"
            shortest = bfs_len(grid)
            assert shortest is not None and config.min_path_len <= shortest <= longest
            demo = task.demonstration(p)
            assert len(demo) == shortest == p.data["shortest"]
            assert task.reward(p, demo) == 1.0
            assert set(p.prompt + demo) <= set(task.alphabet())


def test_maze_eval_set_is_stable_and_disjoint_from_training():
    first, second = MazeTask(MazeConfig()), MazeTask(MazeConfig())
    evals = first.eval_problems()
    assert evals == second.eval_problems()
    assert 200 < len(evals) <= 256
    assert len({p.prompt for p in evals}) == len(evals)
    assert first.eval_problems() == evals  # cached, same content
    eval_prompts = {p.prompt for p in evals}
    rng = random.Random(7)
    train = [first.sample_train(rng) for _ in range(2000)]
    assert not eval_prompts & {p.prompt for p in train}
    assert len({p.prompt for p in train}) > 1000


def test_maze_generation_failure_names_settings():
    with pytest.raises(TaskError, match="min_path_len"):
        MazeTask(MazeConfig(size=2, min_path_len=3)).generate(random.Random(0))


@pytest.mark.parametrize(
    "options, field",
    [
        ({"size": 1}, "size"),
        ({"size": 2.5}, "size"),
        ({"wall_density": 1.0}, "wall_density"),
        ({"wall_density": -0.1}, "wall_density"),
        ({"min_path_len": 0}, "min_path_len"),
        ({"eval_size": 0}, "eval_size"),
        ({"min_path_len": 4, "max_path_len": 3}, "max_path_len"),
    ],
)
def test_maze_config_validation(options, field):
    with pytest.raises(TaskError, match=field):
        MazeConfig(**options)


# ---------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 1,234", "1234"),
        ("the answer is #### 12 then #### 13", "13"),
        ("####-5", "-5"),
        ("#### 12.0", "12.0"),
        ("####\t7 apples", "7"),
        ("#### yes\nmore text", "yes"),
        ("####   \nnext", None),
        ("no marker 42", None),
        ("", None),
    ],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{unclosed {", None),
        ("no box", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, expected",
    [
        ("12.0", "12", True),
        ("1,234", "1234", True),
        ("$1,000", "1000", True),
        (" -5 ", "-5", True),
        ("12", "13", False),
        ("1/2", "0.5", False),
        ("yes ", "yes", True),
        ("Yes", "yes", False),
    ],
)
def test_answers_match(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("#### 1,234", "1234", 1.0),
        ("the answer is #### 12 then #### 13", "13", 1.0),
        ("the answer is #### 12 then #### 13", "12", 0.0),
        ("####-5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("1234", "1234", 0.0),
        ("#### 12.0", "12", 1.0),
        ("#### 12.5", "12", 0.0),
        ("####", "12", 0.0),
        ("", "12", 0.0),
    ],
)
def test_arithmetic_reward(completion, answer, expected):
    problem = Problem(problem_id="p", prompt="x=", answer=answer)
    assert ArithmeticTask().reward(problem, completion) == expected


@pytest.mark.parametrize("completion, expected", [("579", 1.0), ("0579", 0.0), ("579 ", 0.0), (" 579", 0.0),
                                                  ("5790", 0.0), ("#### 579", 0.0), ("57", 0.0), ("", 0.0)])
def test_arithmetic_digits_format_wants_exactly_the_digits(completion, expected):
    task = ArithmeticTask(ArithmeticConfig(answer_format="digits"))
    problem = Problem(problem_id="p", prompt="123+456=", answer="579")
    assert task.demonstration(problem) == "579"
    assert task.reward(problem, completion) == expected


def test_arithmetic_rejects_an_unknown_answer_format():
    with pytest.raises(TaskError, match="answer_format='plain' must be one of hash, digits"):
        ArithmeticConfig(answer_format="plain")


def test_arithmetic_problems():
    task = ArithmeticTask(ArithmeticConfig(digits=2, ops="+-*", eval_size=50))
    rng = random.Random(3)
    seen_ops = set()
    for _ in range(300):
        p = task.sample_train(rng)
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", p.prompt).groups()
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert int(p.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert task.demonstration(p) == f"#### {p.answer}"
        assert task.reward(p, task.demonstration(p)) == 1.0
        assert set(p.prompt + task.demonstration(p)) <= set(task.alphabet())
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}
    p = Problem(problem_id="x", prompt="123+456=", answer="579")
    assert ArithmeticTask().demonstration(p) == "#### 579"


def test_arithmetic_eval_set_is_stable_and_disjoint_from_training():
    first, second = ArithmeticTask(), ArithmeticTask()
    evals = first.eval_problems()
    assert evals == second.eval_problems() and 500 <= len(evals) <= 512
    eval_prompts = {p.prompt for p in evals}
    rng = random.Random(11)
    assert not eval_prompts & {first.sample_train(rng).prompt for _ in range(2000)}


def test_arithmetic_exhausted_space_raises():
    task = ArithmeticTask(ArithmeticConfig(digits=1, eval_size=5000))
    with pytest.raises(TaskError, match="eval_size"):
        task.sample_train(random.Random(0))


@pytest.mark.parametrize(
    "options, field",
    [({"digits": 0}, "digits"), ({"ops": ""}, "ops"), ({"ops": "/"}, "ops"), ({"ops": "++"}, "ops"),
     ({"eval_size": 0}, "eval_size")],
)
def test_arithmetic_config_validation(options, field):
    with pytest.raises(TaskError, match=field):
        ArithmeticConfig(**options)


# ---------------------------------------------------------------- jsonl


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_task(tmp_path):
    rows = [{"prompt": f"q{i}?", "answer": i * 10, "source": "s"} for i in range(20)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "")
    lines.insert(9, "   ")
    path = write_lines(tmp_path / "d.jsonl", lines)
    task = JsonlTask(JsonlConfig(path=path))
    evals = task.eval_problems()
    assert len(evals) == 2
    assert evals == JsonlTask(JsonlConfig(path=path)).eval_problems()
    assert evals != JsonlTask(JsonlConfig(path=path, split_seed=1)).eval_problems()
    eval_prompts = {p.prompt for p in evals}
    rng = random.Random(0)
    train = {task.sample_train(rng).prompt for _ in range(500)}
    assert len(train) == 18 and not train & eval_prompts
    p = next(p for p in evals)
    assert p.data == {"source": "s"}
    assert task.demonstration(p) == f"#### {p.answer}"
    assert task.reward(p, f"work...\n#### {int(p.answer):,}") == 1.0
    assert task.reward(p, "#### 999999") == 0.0
    assert task.alphabet() == "".join(sorted(set("".join(r["prompt"] + f"#### {r['answer']}" for r in rows))))
    assert len(JsonlTask(JsonlConfig(path=path, eval_size=5)).eval_problems()) == 5


def test_jsonl_boxed(tmp_path):
    path = write_lines(
        tmp_path / "b.jsonl",
        [json.dumps({"prompt": "half?", "answer": "\\frac{1}{2}"}), json.dumps({"prompt": "two?", "answer": 2})],
    )
    task = JsonlTask(JsonlConfig(path=path, extractor="boxed", eval_size=1))
    for p in task.eval_problems() + [task.sample_train(random.Random(0))]:
        assert task.reward(p, "so " + task.demonstration(p)) == 1.0
    half = Problem(problem_id="h", prompt="half?", answer="\\frac{1}{2}")
    assert task.demonstration(half) == "\\boxed{\\frac{1}{2}}"
    assert task.reward(half, "\\boxed{\\frac{1}{3}}") == 0.0
    assert task.reward(half, "#### \\frac{1}{2}") == 0.0


@pytest.mark.parametrize(
    "bad_row, what",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"answer": "1"}', "'prompt' missing"),
        ('{"prompt": "", "answer": "1"}', "'prompt'"),
        ('{"prompt": 5, "answer": "1"}', "'prompt'"),
        ('{"prompt": "q"}', "'answer' is missing"),
        ('{"prompt": "q", "answer": [1]}', "'answer' must be"),
        ('{"prompt": "q", "answer": true}', "'answer' must be"),
        ('{"prompt": "q", "answer": " "}', "'answer' is empty"),
        ('{"prompt": "q", "answer": "1 2"}', "cannot be read back"),
    ],
)
def test_jsonl_malformed_row_names_file_and_line(tmp_path, bad_row, what):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "a", "answer": 1}', "", bad_row])
    with pytest.raises(TaskError, match=re.escape(what)) as info:
        JsonlTask(JsonlConfig(path=path))
    assert f"{path}, line 3" in str(info.value)


def test_jsonl_file_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match=re.escape(missing)):
        JsonlTask(JsonlConfig(path=missing))
    with pytest.raises(TaskError, match="empty"):
        JsonlTask(JsonlConfig(path=write_lines(tmp_path / "e.jsonl", ["", "  "])))
    one = write_lines(tmp_path / "one.jsonl", ['{"prompt": "a", "answer": 1}'])
    with pytest.raises(TaskError, match="at least 2"):
        JsonlTask(JsonlConfig(path=one))
    two = write_lines(tmp_path / "two.jsonl", ['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2}'])
    with pytest.raises(TaskError, match="eval_size"):
        JsonlTask(JsonlConfig(path=two, eval_size=2))
    with pytest.raises(TaskError, match="extractor"):
        JsonlConfig(path=two, extractor="regex")
    with pytest.raises(TaskError, match="eval_fraction"):
        JsonlConfig(path=two, eval_fraction=0.0)


# ---------------------------------------------------------------- custom reward functions

REWARD_MODULE = '''
import math
def exact(prompt, completion, answer):
    return float(completion.strip() == answer)
def prompt_len(prompt, completion, answer):
    return len(prompt)
NOT_CALLABLE = 3
def text(prompt, completion, answer):
    return "high"
def nan(prompt, completion, answer):
    return math.nan
def boom(prompt, completion, answer):
    raise RuntimeError("kaboom")
def own_timeout(prompt, completion, answer):
    raise TimeoutError("scoring service timed out")
import threading
RELEASE = threading.Event()
CALLS = []
def stuck_once(prompt, completion, answer):  # the first call hangs until RELEASE is set
    CALLS.append(completion)
    if len(CALLS) == 1:
        RELEASE.wait(60)
    return 0.5
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "tt_rewards_mod.py").write_text(REWARD_MODULE)
    (tmp_path / "tt_broken_mod.py").write_text("import tt_no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tt_rewards_mod"


def test_load_reward_fn_and_wrap(reward_module):
    fn = load_reward_fn(f"{reward_module}:exact")
    assert fn("p", "42", "42") == 1.0
    task = make_task("arithmetic", {"digits": 1, "eval_size": 5}, reward_fn=f"{reward_module}:exact")
    assert isinstance(task, CustomRewardTask) and isinstance(task, Task)
    p = task.eval_problems()[0]
    assert task.name == "arithmetic"
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, task.demonstration(p)) == 0.0  # the custom rule, not ####
    assert task.alphabet() == ArithmeticTask().alphabet()
    assert CustomRewardTask(task.base, load_reward_fn(f"{reward_module}:prompt_len")).reward(p, "") == len(p.prompt)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tt_rewards_mod.exact", "package.module:name"),
        (":exact", "package.module:name"),
        ("tt_rewards_mod:", "package.module:name"),
        ("tt_no_such_pkg_xyz:f", "No module named 'tt_no_such_pkg_xyz'"),
        ("tt_broken_mod:f", "tt_no_such_module_xyz"),
        ("tt_rewards_mod:missing", "no attribute 'missing'"),
        ("tt_rewards_mod:NOT_CALLABLE", "not callable"),
    ],
)
def test_load_reward_fn_failures(reward_module, spec, message):
    with pytest.raises(TaskError, match=re.escape(message)):
        load_reward_fn(spec)


@pytest.mark.parametrize("name, message", [("text", "'high'"), ("nan", "nan"), ("boom", "kaboom"),
                                           ("own_timeout", "raised TimeoutError: scoring service timed out")])
def test_custom_reward_bad_results(reward_module, name, message):
    task = CustomRewardTask(ArithmeticTask(), load_reward_fn(f"{reward_module}:{name}"))
    with pytest.raises(TaskError, match=re.escape(message)) as info:
        task.reward(Problem(problem_id="p", prompt="1+1=", answer="2"), "#### 2")
    assert f"{reward_module}:{name}" in str(info.value)


def test_a_reward_that_never_returns_is_an_error_naming_it_the_limit_and_the_key(reward_module):
    module = importlib.import_module(reward_module)
    task = make_task("arithmetic", {"digits": 1, "eval_size": 5}, reward_fn=f"{reward_module}:stuck_once",
                     reward_timeout_s=0.2)
    problem = task.eval_problems()[0]
    try:
        start = time.monotonic()
        with pytest.raises(TaskError) as info:
            task.reward(problem, "first")
        assert 0.2 <= time.monotonic() - start < 5
        message = str(info.value)
        assert f"{reward_module}:stuck_once did not return within 0.2 s" in message
        assert "task.reward_timeout_s=SECONDS" in message and repr(problem.problem_id) in message
        # the stuck call is abandoned: the next one runs on a fresh thread and returns
        assert task.reward(problem, "second") == 0.5
    finally:
        module.RELEASE.set()
    assert task.reward(problem, "third") == 0.5  # the first call's late result is never taken for another's
    assert module.CALLS == ["first", "second", "third"]


def test_timed_call_runs_in_a_daemon_thread_or_without_a_limit_in_the_callers():
    caller = threading.current_thread()
    assert TimedCall(threading.current_thread, None)() is caller
    helper = TimedCall(threading.current_thread, 5.0)
    first = helper()
    assert first is not caller and first.daemon and helper() is first  # one long-lived thread for every call
    with pytest.raises(KeyError, match="k"):
        TimedCall({}.__getitem__, 5.0)("k")  # the function's own exception, unchanged
    with pytest.raises(CallTimedOut, match="within 0.05 s"):
        TimedCall(time.sleep, 0.05)(2)


# ---------------------------------------------------------------- registry


def test_make_task(tmp_path):
    assert set(TASKS) == {"maze", "arithmetic", "jsonl", "code", "reasoning_gym", "verifiers", "maze_walk",
                          "calculator", "cookbook_env", "verifiers_multiturn"}
    maze = make_task("maze", {"size": 4, "eval_size": 3})
    assert isinstance(maze, MazeTask) and isinstance(maze, Task) and maze.config.size == 4
    assert isinstance(make_task("arithmetic"), ArithmeticTask)
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2}'])
    assert isinstance(make_task("jsonl", {"path": path}), JsonlTask)
    with pytest.raises(TaskError, match="known tasks: arithmetic, calculator, code, cookbook_env, jsonl, maze, "):
        make_task("chess")
    with pytest.raises(TaskError, match="unknown option 'sise'.*size, wall_density"):
        make_task("maze", {"sise": 4})
    with pytest.raises(TaskError, match="needs option.*path"):
        make_task("jsonl")


# ---------------------------------------------------------------- rewards with facts


def test_a_reward_function_gets_the_facts_its_signature_names():
    assert accepted_facts(lambda prompt, completion, answer: 0.0) == ()
    assert accepted_facts(lambda prompt, completion, answer, *, stop_reason: 0.0) == ("stop_reason",)
    assert accepted_facts(lambda prompt, completion, answer, token_ids=None, row=None: 0.0) == ("token_ids", "row")
    assert accepted_facts(lambda *args, **kwargs: 0.0) == REWARD_FACTS
    assert accepted_facts(len) == ()  # no signature: the three strings only


def test_a_token_level_reward_tells_eos_from_a_cut_completion():
    from heterorl.engines.base import SampleOutput

    task = make_task("arithmetic", {"answer_format": "digits", "eval_size": 4},
                     reward_fn="tests.token_reward:digits_then_eos")
    problem = Problem(problem_id="p", prompt="123+456=", answer="579")
    ended = SampleOutput(tokens=[5, 7, 9, 0], logprobs=[-0.1] * 4, stop_reason="eos", text="579")
    cut = SampleOutput(tokens=[5, 7, 9], logprobs=[-0.1] * 3, stop_reason="length", text="579")
    assert (score(task, problem, ended), score(task, problem, cut)) == (1.0, 0.0)
    assert score(ArithmeticTask(ArithmeticConfig(answer_format="digits")), problem, cut) == 1.0  # text alone
    with pytest.raises(TaskError, match="tests.token_reward:digits_then_eos raised TypeError.*"
                                        "prompt '123\\+456=', completion '579'"):
        task.reward(problem, "579")  # scoring text alone cannot give it the stop reason; the error names the row


def test_sampled_completions_are_scored_with_their_token_ids_stop_reason_and_row():
    from heterorl.config import load_config, packaged
    from heterorl.loops.sync_rl import rollout_datums
    from heterorl.policies import load_policy
    from heterorl.training.session import TrainingClient
    from tests import token_reward

    cfg = load_config(packaged("add3_rl.yaml"), ["rollout.group_size=2", "rollout.max_tokens=6",
                                                 "task.reward_fn=tests.token_reward:record"])
    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(cfg.rl.base)
    sampler = TrainingClient(model, tokenizer).save_weights_and_get_sampling_client()
    token_reward.FACTS.clear()
    problems = task.eval_problems()[:3]
    datums, _ = rollout_datums(sampler, task, problems, cfg, seed=0)
    assert len(token_reward.FACTS) == len(datums) == 6
    for facts, datum, problem in zip(token_reward.FACTS, datums, [p for p in problems for _ in range(2)]):
        assert set(facts) == set(REWARD_FACTS)
        assert facts["token_ids"] == datum.tokens[datum.prompt_len:]  # what the learner trains on
        assert (facts["token_ids"][-1] == tokenizer.eos_token_id) == (facts["stop_reason"] == "eos")
        assert facts["row"] == {"prompt": problem.prompt, "answer": problem.answer}


def test_jsonl_eval_file_names_the_held_out_rows(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [f'{{"q": "{i}+1=", "a": {i + 1}, "level": {i % 3}}}'
                                                   for i in range(10)])
    held = write_lines(tmp_path / "eval.jsonl", ['{"q": "3+1=", "a": 4}', '{"q": "20+1=", "a": 21}'])
    task = JsonlTask(JsonlConfig(path=train, eval_path=held, prompt_column="q", answer_column="a"))
    assert [(p.prompt, p.answer) for p in task.eval_problems()] == [("3+1=", "4"), ("20+1=", "21")]
    assert task.held_out_rows is None
    drawn = {task.sample_train(random.Random(s)).prompt for s in range(200)}
    assert "3+1=" not in drawn and len(drawn) == 9  # the eval prompt is never drawn for training
    assert task.sample_train(random.Random(0)).data["level"] in (0, 1, 2)  # other columns travel with the row
    first = JsonlTask(JsonlConfig(path=train, eval_path=held, eval_size=1, prompt_column="q", answer_column="a"))
    assert [p.prompt for p in first.eval_problems()] == ["3+1="]


def test_jsonl_split_without_an_eval_file_says_which_lines_it_held_out(tmp_path, caplog):
    path = write_lines(tmp_path / "d.jsonl", [f'{{"prompt": "{i}+1=", "answer": {i + 1}}}' for i in range(10)])
    with caplog.at_level("INFO", logger="heterorl.tasks.jsonl"):
        task = JsonlTask(JsonlConfig(path=path, eval_size=3))
    lines = task.held_out_rows
    assert len(lines) == 3 and [f"{n - 1}+1=" for n in lines] == sorted(p.prompt for p in task.eval_problems())
    assert "held out lines" in caplog.text and "task.options.eval_path" in caplog.text


def test_jsonl_columns_and_eval_file_errors_name_file_line_and_keys(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ['{"question": "1+1=", "solution": 2}',
                                              '{"question": "2+2=", "solution": 4}'])
    with pytest.raises(TaskError, match=r"d.jsonl, line 1: 'prompt' missing \(its keys: 'question', 'solution'; "
                                        r"name the columns with task.options.prompt_column / answer_column\)"):
        JsonlTask(JsonlConfig(path=path))
    bad_eval = write_lines(tmp_path / "e.jsonl", ['{"question": "3+3=", "solution": 6}', "not json"])
    with pytest.raises(TaskError, match="e.jsonl, line 2: not valid JSON"):
        JsonlTask(JsonlConfig(path=path, eval_path=bad_eval, prompt_column="question", answer_column="solution"))
    with pytest.raises(TaskError, match="prompt_column and answer_column are both 'x'"):
        JsonlConfig(path=path, prompt_column="x", answer_column="x")


def test_parquet_files_and_datasets_folders_are_read_like_jsonl(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    rows = {"question": [f"{i}+2=" for i in range(12)], "solution": [str(i + 2) for i in range(12)],
            "level": [i % 2 for i in range(12)]}
    pyarrow.parquet.write_table(pyarrow.table(rows), tmp_path / "train.parquet")
    datasets.Dataset.from_dict({k: v[:3] for k, v in rows.items()}).save_to_disk(str(tmp_path / "held"))
    options = {"prompt_column": "question", "answer_column": "solution"}
    task = make_task("jsonl", {"path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "held"),
                               **options})
    assert [(p.prompt, p.answer, p.data) for p in task.eval_problems()] == [
        ("0+2=", "2", {"level": 0}), ("1+2=", "3", {"level": 1}), ("2+2=", "4", {"level": 0})]
    assert {task.sample_train(random.Random(s)).prompt for s in range(300)} == set(rows["question"][3:])
    split = make_task("jsonl", {"path": str(tmp_path / "train.parquet"), "eval_size": 2, **options})
    assert len(split.held_out_rows) == 2 and all(1 <= r <= 12 for r in split.held_out_rows)


def test_bad_tables_are_errors_naming_the_file_row_and_columns(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["1+1=", "2+2="], "answer": [2, None]}),
                                tmp_path / "gap.parquet")
    with pytest.raises(TaskError, match=r"gap.parquet, row 2: 'answer' must be a string or a number, got NoneType"):
        make_task("jsonl", {"path": str(tmp_path / "gap.parquet")})
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(TaskError, match="cannot read .*junk.parquet as a Parquet file"):
        make_task("jsonl", {"path": str(tmp_path / "junk.parquet")})
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(TaskError, match=r"holds splits \['train'\], not one table: name the split's folder"):
        make_task("jsonl", {"path": str(tmp_path / "dd")})


def test_trl_style_batched_reward_functions_summed_with_weights():
    from heterorl.config import load_config
    from heterorl.engines.base import SampleOutput

    task = make_task("arithmetic", {"answer_format": "digits", "eval_size": 4},
                     reward_fn="tests.token_reward:trl_exact, tests.token_reward:trl_short", reward_weights=[1.0, 0.25])
    problem = Problem(problem_id="p", prompt="123+456=", answer="579")
    sample = SampleOutput(tokens=[5, 7, 9, 0], logprobs=[-0.1] * 4, stop_reason="eos", text="579")
    assert score(task, problem, sample) == 1.25 and task.reward(problem, "5790") == 0.0
    with pytest.raises(TaskError, match=r"trl_wrong_length returned \[0.0, 0.0\] for 1 completion: a batched reward "
                                        "function returns a list with one float per completion"):
        make_task("arithmetic", {"eval_size": 4}, reward_fn="tests.token_reward:trl_wrong_length").reward(problem, "1")
    with pytest.raises(TaskError, match="2 reward weights .* for 1 reward functions"):
        make_task("arithmetic", {"eval_size": 4}, reward_fn="tests.token_reward:trl_exact", reward_weights=[1, 2])
    with pytest.raises(ConfigError, match="`task.reward_weights`.*one weight per reward function \\(2 in"):
        load_config(None, ["task.reward_fn=a:b,c:d", "task.reward_weights=[1.0]"])


def test_the_catalog_prints_to_the_stdout_of_the_call_not_the_one_at_import(monkeypatch):
    from heterorl.tasks.catalog import print_catalog, show

    now = io.StringIO()
    monkeypatch.setattr(sys, "stdout", now)
    print_catalog()
    show("maze")
    text = now.getvalue()
    assert "heterorl's tasks" in text and "maze: " in text
