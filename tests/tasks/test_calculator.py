"""calculator: arithmetic with a calculator tool; the tool's answers computed by hand (precedence, parentheses,
unary minus), malformed and oversized expressions answered with the error marker, the call limit, the final
answer's reward, the options. What it holds as every multi-turn task does (the expert, the alphabet, the
held-out split): tests/tasks/test_episode_tasks.py."""

import random

import pytest

from heterorl.errors import TaskError
from heterorl.tasks.calculator import (
    Calculator,
    CalculatorConfig,
    CalculatorTask,
    ExpressionError,
    calculate,
    calculator_problem,
    tool_answer,
)
from tests.tasks.test_episode_tasks import play


@pytest.mark.parametrize("expression, value", [
    ("23*47+18", 1099),
    ("2+3*4", 14),  # * binds tighter
    ("(2+3)*4", 20),
    ("10-4-3", 3),  # left-associative
    ("2*3*4-5", 19),
    ("2*(3-(4-5))", 8),
    ("-3*-2", 6),
    ("-(2+3)", -5),
    ("7-10", -3),
    ("007", 7),
    ("999999999999*999999999999", 999999999998000000000001),
    ("(" * 16 + "1" + ")" * 16, 1),  # nesting 16 deep: the bound
    ("-" * 63 + "1", -1),  # 64 characters: the bound
])
def test_the_calculator_computes_by_the_usual_rules(expression, value):
    assert calculate(expression) == value
    assert tool_answer(expression) == f"\n={value}\n"


@pytest.mark.parametrize("expression", [
    "", "2+", "+2", "2**3", "2*", "(2+3", "2+3)", "()", "2 + 3", "1/2", "2^3", "abc", "2\n", "\u00b2", "\u0663",
    "1" * 13,  # a 13-digit number
    "1+" * 32 + "1",  # 65 characters
    "(" * 17 + "1" + ")" * 17,  # nested 17 deep
    "(" * 40,
    "<calc>1</calc>",
])
def test_malformed_or_oversized_expressions_are_answered_with_the_error_marker(expression):
    with pytest.raises(ExpressionError):
        calculate(expression)
    assert tool_answer(expression) == "\n=error\n"
    env = Calculator()
    env.reset(calculator_problem("1+1"))
    result = env.step(f"<calc>{expression}</calc>")
    assert result.observation == "\n=error\n" and not result.done


def test_an_episode_of_a_hand_written_problem():
    problem = calculator_problem("23*47+18")
    assert problem.prompt == "23*47+18=?\n" and problem.answer == "1099"
    assert CalculatorTask().demonstration(problem) == ["<calc>23*47+18</calc>", "1099"]
    env = Calculator()
    assert env.reset(problem) == "23*47+18=?\n"
    observations, result = play(env, [" <calc>23*47</calc>\n", "<calc>1081+18</calc>", "1099\n"])
    assert observations == ["\n=1081\n", "\n=1099\n", ""] and result.done and result.reward == 1.0


@pytest.mark.parametrize("answer", ["1098", "", "1099 1099", "<calc>23*47+18</calc>x", "+1099", "=1099"])
def test_a_wrong_final_answer_scores_zero_and_ends_the_episode(answer):
    env = Calculator()
    env.reset(calculator_problem("23*47+18"))
    result = env.step(answer)
    assert result.done and result.reward == 0.0


def test_calls_past_max_calls_are_refused_and_the_episode_ends_after_max_calls_plus_two_turns():
    problem = calculator_problem("23*47+18")
    env = Calculator(max_calls=2)
    env.reset(problem)
    calls = ["<calc>1+1</calc>", "<calc>(</calc>", "<calc>23*47+18</calc>", "<calc>2+2</calc>"]
    observations, result = play(env, calls)  # an error still counts as a call
    assert observations == ["\n=2\n", "\n=error\n", "\n=limit\n", ""] and result.done and result.reward == 0.0
    env.reset(problem)
    _, result = play(env, calls[:3] + ["1099"])  # the last turn may still answer
    assert result.done and result.reward == 1.0
    env = Calculator(max_calls=1)
    env.reset(problem)
    observations, result = play(env, calls[:3])
    assert observations == ["\n=2\n", "\n=limit\n", ""] and result.done and result.reward == 0.0


def test_problems_follow_the_config():
    task, rng = CalculatorTask(CalculatorConfig(digits=3, ops="*", terms=4)), random.Random(2)
    for _ in range(20):
        expression = task.sample_train(rng).data["expression"]
        numbers = expression.split("*")
        assert len(numbers) == 4 and all(0 <= int(n) <= 999 for n in numbers)


@pytest.mark.parametrize("options, field", [
    ({"digits": 0}, "digits"),
    ({"digits": 13}, "digits"),
    ({"digits": 12, "terms": 6}, "terms"),  # 77 characters
    ({"terms": 1}, "terms"),
    ({"ops": "/"}, "ops"),
    ({"ops": "++"}, "ops"),
    ({"max_calls": 0}, "max_calls"),
])
def test_bad_options_are_refused_naming_the_option(options, field):
    with pytest.raises(TaskError, match=field):
        CalculatorConfig(**options)
