"""cookbook_env: the tinker-cookbook's own environments (twenty questions, arithmetic, guess-the-number) played by
a scripted policy through reset/step to the cookbook's rewards; the increment rule, the stop conditions and the
group rewards it refuses, with their messages; a library error passing through; the split of a source."""

import asyncio
import re
from concurrent.futures import Future

import pytest

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (`make install` adds it)")

from tinker_cookbook.exceptions import RendererError  # noqa: E402
from tinker_cookbook.recipes.multiplayer_rl.twenty_questions.env import PLAYER_SYSTEM_PROMPT  # noqa: E402

from heterorl.engines.base import SampleOutput, SamplingParams  # noqa: E402
from heterorl.errors import TaskError  # noqa: E402
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups  # noqa: E402
from heterorl.tasks import make_task  # noqa: E402
from heterorl.tasks.base import Problem  # noqa: E402
from heterorl.tasks.cookbook_env import CookbookEnvConfig, CookbookEnvTask, observation_increment  # noqa: E402
from heterorl.tasks.environment import EnvContractError, checked_step, is_multi_turn  # noqa: E402
from heterorl.tasks.rewards import outcome_counts  # noqa: E402
from tests.tasks.cookbook_fixture import CLEANED_UP, TOKENIZER_NAME, byte_tokenizer, renderer  # noqa: E402

FIXTURE = "tests.tasks.cookbook_fixture"
TOKENIZER = byte_tokenizer()
EOT = TOKENIZER.convert_tokens_to_ids("<|eot_id|>")


def turn(text: str, stop: bool = True) -> list[int]:
    """A policy turn's token ids, as the engine gives them: the text's, then the stop token."""
    return TOKENIZER.encode(text, add_special_tokens=False) + ([EOT] if stop else [])


def task_of(source: str, **options) -> CookbookEnvTask:
    options.setdefault("stop_token_ids", [EOT])
    return CookbookEnvTask(CookbookEnvConfig(source=f"{FIXTURE}:{source}" if ":" not in source else source,
                                             **options))


@pytest.fixture(scope="module")
def questions() -> CookbookEnvTask:
    return task_of("twenty_questions", eval_size=2)


def test_twenty_questions_played_to_the_cookbooks_reward(questions):
    problem = questions.eval_problems()[0]
    secret = questions._builders[problem.problem_id].answer
    env = questions.environment(problem)
    assert env.takes_token_ids
    prompt = env.reset(problem)
    system = {"role": "system", "content": PLAYER_SYSTEM_PROMPT}
    assert prompt == renderer().build_generation_prompt([system]).to_ints()  # the cookbook's own first observation
    actions = [turn("Is it an animal?"), turn(f"Is it a {secret}?"), turn(f"Guess: {secret}")]
    results = [checked_step(env.step(action)) for action in actions]
    answers = [TOKENIZER.decode(r.observation) for r in results[:2]]
    assert answers == [f"<|start_header_id|>user<|end_header_id|>\n\n{word}<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n" for word in ("no", "yes")]
    assert [(r.reward, r.done) for r in results] == [(0.0, False), (0.0, False), (1.0, True)]
    assert results[2].observation == []
    # prompt, action, answer, action, answer: the cookbook's whole last prompt, token for token
    conversation = [system, {"role": "assistant", "content": "Is it an animal?"}, {"role": "user", "content": "no"},
                    {"role": "assistant", "content": f"Is it a {secret}?"}, {"role": "user", "content": "yes"}]
    whole = renderer().build_generation_prompt(conversation).to_ints()
    assert prompt + actions[0] + results[0].observation + actions[1] + results[1].observation == whole


class ScriptedSampler:
    """The runner's sampler, scripted: an episode's k-th turn is ``turns[k]``, its stop token included."""

    version = 0
    tokenizer = TOKENIZER

    def __init__(self, turns: list[str]) -> None:
        self.turns = turns

    def sample(self, contexts, num_samples, params, weight_updates=None) -> Future:
        groups = []
        for context in contexts:
            taken = TOKENIZER.decode(context).count("assistant<|end_header_id|>") - 1  # the prompt ends with one
            tokens = turn(self.turns[taken])
            groups.append([SampleOutput(tokens, [-1.0] * len(tokens), "eos") for _ in range(num_samples)])
        done = Future()
        done.set_result(groups)
        return done


def test_episodes_through_the_runner_mark_the_cookbooks_answers_as_the_environments(questions):
    problem = questions.eval_problems()[0]
    secret = questions._builders[problem.problem_id].answer
    sampler = ScriptedSampler(["Is it an animal?", f"Guess: {secret}"])
    (prompt,), (group,) = rollout_groups(sampler, questions, [problem], 2, SamplingParams(max_tokens=64),
                                         limits=EpisodeLimits(max_turns=4))
    assert prompt == questions.environment(problem).reset(problem)
    answer = turn("Is it an animal?")
    for sample in group:
        assert (sample.stop_reason, sample.reward) == ("done", 1.0)
        start, end = sample.env_spans
        assert start == len(answer) and TOKENIZER.decode(sample.tokens[start:end]).startswith(
            "<|start_header_id|>user<|end_header_id|>\n\nno<|eot_id|>")
        assert sample.tokens[end:] == turn(f"Guess: {secret}")
    assert outcome_counts(questions)["episode:done"] == 2


def test_a_wrong_guess_scores_zero_and_the_game_goes_on(questions):
    problem = questions.eval_problems()[1]
    env = questions.environment(problem)
    env.reset(problem)
    result = env.step(turn("Guess: zebra"))
    assert (result.reward, result.done) == (0.0, False)
    assert TOKENIZER.decode(result.observation).startswith("<|start_header_id|>user<|end_header_id|>\n\nno")


def addends(prompt: list[int]) -> tuple[int, int]:
    return tuple(map(int, re.findall(r"What is (\d+) \+ (\d+)\?", TOKENIZER.decode(prompt))[-1]))


@pytest.mark.parametrize("answer, stop, reward", [("right", True, 1.0), ("right", False, 0.9), ("wrong", True, 0.0)])
def test_arithmetic_problem_env_gives_its_format_and_answer_reward(answer, stop, reward):
    """The cookbook's ProblemEnv: 1 for the right sum, less its format_coef (0.1) when the turn did not end at the
    stop token, 0 for a wrong sum."""
    task = task_of("arithmetic", eval_size=1)
    problem = task.eval_problems()[0]
    env = task.environment(problem)
    x, y = addends(env.reset(problem))
    result = env.step(turn(str(x + y if answer == "right" else x + y + 1), stop))
    assert (result.reward, result.done, result.observation) == (pytest.approx(reward), True, [])


def test_a_dataset_builder_of_the_cookbook_gives_its_test_split_as_the_eval_set():
    """GuessNumberDatasetBuilder (a chz RLDatasetBuilder) builds its tokenizer by name: the one registered here."""
    task = task_of("tinker_cookbook.recipes.multiplayer_rl.guess_number.env:GuessNumberDatasetBuilder",
                   source_args={"batch_size": 4, "renderer_name": "llama3", "train_group_size": 2,
                                "model_name": TOKENIZER_NAME},
                   eval_size=3, max_groups=8)
    assert [p.problem_id for p in task.eval_problems()] == ["cookbook-test-0", "cookbook-test-1", "cookbook-test-2"]
    assert len(task._train) == 8 and {p.problem_id for p in task._train} == {f"cookbook-{i}" for i in range(8)}
    eval_answers = {task._builders[p.problem_id].answer for p in task.eval_problems()}
    assert not eval_answers & {task._builders[p.problem_id].answer for p in task._train}
    problem = task.eval_problems()[0]
    env = task.environment(problem)
    env.reset(problem)
    result = env.step(turn(f"Guess: {task._builders[problem.problem_id].answer}"))
    assert (result.reward, result.done) == (1.0, True)


def test_an_observation_that_rewrites_the_episode_is_refused():
    """guess-the-number renders the policy's past turns under the role "player", not "assistant": its second
    prompt does not begin with the first prompt and the action."""
    task = task_of("tinker_cookbook.recipes.multiplayer_rl.guess_number.env:GuessNumberDatasetBuilder",
                   source_args={"batch_size": 2, "renderer_name": "llama3", "train_group_size": 2,
                                "model_name": TOKENIZER_NAME}, eval_size=1, max_groups=2)
    problem = task.eval_problems()[0]
    env = task.environment(problem)
    prompt = env.reset(problem)
    # the first prompt ends "<|start_header_id|>assistant<|end_header_id|>\n\n", one token a byte: the two part
    # at the role's first letter, 12 tokens from the prompt's end
    p, a = TOKENIZER.convert_tokens_to_ids(["p", "a"])
    with pytest.raises(EnvContractError, match="next observation does not extend the episode: it has token "
                                               f"{p} at position {len(prompt) - 12}, where the episode has {a}") as err:
        env.step(turn(f"Guess: {task._builders[problem.problem_id].answer + 1}"))
    assert "extension property" in str(err.value)
    assert not env._cleanup.alive  # the episode ended: its builder cleaned up


def test_observation_increment():
    assert observation_increment([1, 2, 3], [1, 2, 3, 4, 5]) == [4, 5]
    assert observation_increment([1, 2], [1, 2]) == []
    with pytest.raises(EnvContractError, match="it is 2 tokens, shorter than the episode's 3"):
        observation_increment([1, 2, 3], [1, 2])
    with pytest.raises(EnvContractError, match="it has token 9 at position 1, where the episode has 2"):
        observation_increment([1, 2, 3], [1, 9, 3, 4])


def test_a_text_stop_sequence_is_refused():
    task = task_of("twenty_questions", source_args={"renderer_name": "role_colon"}, eval_size=1)
    problem = task.eval_problems()[0]
    with pytest.raises(EnvContractError, match=r"ends a turn at the text \['\\n\\nUser:'\]; heterorl's engines end "
                                               "a turn at a token id only"):
        task.environment(problem).reset(problem)


def test_stop_token_ids_not_listed_are_refused():
    task = task_of("twenty_questions", stop_token_ids=[], eval_size=1)
    problem = task.eval_problems()[0]
    with pytest.raises(EnvContractError, match=rf"ends a turn at token ids \[{EOT}\], which "
                                               r"task.options.stop_token_ids \[\] does not list"):
        task.environment(problem).reset(problem)


def test_an_error_inside_the_cookbook_env_propagates_as_it_is(questions):
    """The Llama 3 renderer refuses a response with two stop tokens: its RendererError reaches the runner (which
    counts it as episode:error:RendererError), and the episode is cleaned up."""
    problem = questions.eval_problems()[0]
    env = questions.environment(problem)
    env.reset(problem)
    with pytest.raises(RendererError, match="expected to split into 1 or 2 pieces"):
        env.step(turn("Is it blue?") + turn("Is it red?"))
    assert not env._cleanup.alive


def test_the_builders_cleanup_runs_once_when_an_episode_ends_or_is_left_unfinished():
    CLEANED_UP.clear()
    task = task_of("tidy_twenty_questions", eval_size=1)
    finished, left = task._train
    answers = [task._builders[p.problem_id].answer for p in (finished, left)]
    env = task.environment(finished)
    env.reset(finished)
    assert env.step(turn(f"Guess: {answers[0]}")).done and CLEANED_UP == answers[:1]
    unfinished = task.environment(left)
    unfinished.reset(left)
    unfinished.step(turn("Is it a dog?"))  # the runner's max_turns, say, ends the episode here
    del env, unfinished
    task.loop.run(asyncio.sleep(0))  # the cleanup was scheduled on the loop before this
    assert CLEANED_UP == answers


def test_group_rewards_are_refused_when_the_task_is_built():
    with pytest.raises(TaskError, match="PairwisePreferenceGroupBuilder computes group rewards "
                                        r"\(compute_group_rewards\).*plays each episode alone"):
        task_of("pairwise", eval_size=1)


def test_the_split_holds_out_by_position_with_the_seed(questions):
    assert is_multi_turn(questions) and questions.name == "cookbook_env"
    again = task_of("twenty_questions", eval_size=2)
    assert questions.eval_problems() == again.eval_problems()
    held_out = {p.problem_id for p in questions.eval_problems()}
    assert len(held_out) == 2 and not held_out & {p.problem_id for p in questions._train}
    assert len(questions._train) == 4
    other = task_of("twenty_questions", eval_size=2, split_seed=1)
    assert {p.problem_id for p in other.eval_problems()} != held_out


def test_make_task_builds_it_by_name():
    task = make_task("cookbook_env", {"source": f"{FIXTURE}:twenty_questions", "eval_size": 2,
                                      "stop_token_ids": [EOT]})
    assert isinstance(task, CookbookEnvTask) and len(task.eval_problems()) == 2


def test_what_the_task_refuses(questions):
    with pytest.raises(TaskError, match="is not a builder of cookbook_env source"):
        questions.environment(Problem("cookbook-99", "", ""))
    with pytest.raises(TaskError, match="no demonstrations"):
        questions.demonstration(questions.eval_problems()[0])
    with pytest.raises(TaskError, match="must look like 'package.module:name'"):
        CookbookEnvConfig(source="tests.tasks.cookbook_fixture")
    with pytest.raises(TaskError, match="stop_token_ids"):
        CookbookEnvConfig(source="a:b", stop_token_ids=[-1])
    with pytest.raises(TaskError, match="an eval set of 6 leaves no training rows of 6"):
        task_of("twenty_questions", eval_size=6)
    with pytest.raises(TaskError, match="gave a str; give an RLDatasetBuilder"):
        task_of("builtins:str")
