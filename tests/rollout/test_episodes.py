"""The episode runner: multi-turn episodes played with the torch engine, their token layout, and every way an
environment can fail."""

import copy
import threading
import time

import pytest
import torch

from heterorl.engines.base import SamplingParams
from heterorl.rollout.episodes import EpisodeLimits, demonstration_episode, rollout_groups
from heterorl.rollout.spans import env_spans_problem, policy_token_mask
from heterorl.runtime.buffer import Group
from heterorl.runtime.learner import group_datums
from heterorl.runtime.worker import stamp_groups
from heterorl.tasks.base import Problem
from heterorl.tasks.environment import Environment, StepResult
from heterorl.tasks.rewards import outcome_counts
from heterorl.training.session import SamplingClient
from tests.conftest import teacher_forced


class Counting(Environment):
    """Three turns; the answers show the turn number; 0.25 a turn."""

    turns = 3

    def reset(self, problem):
        self.n = 0
        return problem.prompt

    def step(self, action):
        self.n += 1
        return StepResult(f"\n{self.n}>", reward=0.25, done=self.n == self.turns)


class OneTurn(Environment):
    def reset(self, problem):
        return problem.prompt

    def step(self, action):
        return StepResult("", reward=float(action.startswith("U")), done=True)


class Raises(Counting):
    def step(self, action):
        if self.n == 1:
            raise ValueError("the tool broke")
        return super().step(action)


class Malformed(Counting):
    answers = {1: (42, 0.0, False)}

    def step(self, action):
        self.n += 1
        return self.answers.get(self.n, (f"\n{self.n}>", 0.25, self.n == 3))


class Unencodable(Counting):
    def step(self, action):
        return StepResult("\nzz", 0.5, False)  # 'z' is outside the policy's alphabet


class Forever(Counting):
    turns = 10_000


class Wordy(Counting):
    def step(self, action):
        return StepResult("\n" + "1" * 40 + ">", 0.5, False)


class Toy:
    """A multi-turn task over ``env`` for the tests' tiny policy (maze alphabet and digits)."""

    name = "toy"

    def __init__(self, env=Counting, prompts=("S.G\n>", "S#\n.G\n>")) -> None:
        self.env, self.prompts = env, prompts

    def alphabet(self):
        return ".#SG\n>UDLR0123456789"

    def sample_train(self, rng):
        prompt = rng.choice(self.prompts)
        return Problem(f"toy-{self.prompts.index(prompt)}", prompt, "U")

    def eval_problems(self):
        return [Problem(f"toy-{i}", p, "U") for i, p in enumerate(self.prompts)]

    def environment(self, problem):
        return self.env()

    def demonstration(self, problem):
        return ["U", "D", "R"]

    def reward(self, problem, completion):
        return float(completion.startswith("U"))


def _sampler(tiny_policy, version=0):
    model, tok = tiny_policy
    return SamplingClient.for_model(copy.deepcopy(model), tok, version=version)



PARAMS = SamplingParams(max_tokens=3, temperature=1.0, seed=7)


def test_an_episode_is_one_token_array_with_the_answers_marked_and_the_policy_logprobs_exact(tiny_policy):
    sampler = _sampler(tiny_policy)
    task = Toy()
    problems = task.eval_problems()
    prompts, groups = rollout_groups(sampler, task, problems, 4, PARAMS, limits=EpisodeLimits(max_turns=8))
    tok = sampler.tokenizer
    assert [len(g) for g in groups] == [4, 4]
    for prompt, problem, group in zip(prompts, problems, groups):
        assert tok.decode(prompt) == problem.prompt
        for sample in group:
            spans = sample.env_spans
            assert len(spans) == 4 and env_spans_problem(spans, len(sample.tokens)) is None
            assert [tok.decode(sample.tokens[a:b]) for a, b in zip(spans[::2], spans[1::2])] == ["\n1>", "\n2>"]
            assert sample.reward == 0.75 and sample.stop_reason == "done"
            mask = policy_token_mask(spans, len(sample.tokens))
            logprobs = torch.tensor(sample.logprobs)
            assert (logprobs[~torch.from_numpy(mask)] == 0).all()
            # each policy token's log-prob is the model's, given everything before it: the answers included
            exact = teacher_forced(sampler.engine.model, prompt, sample.tokens)
            assert (exact - logprobs)[torch.from_numpy(mask)].abs().max() < 1e-4
    assert outcome_counts(task) == {"episode:done": 8}


def test_a_one_turn_episode_is_todays_single_turn_trajectory_bit_for_bit(tiny_policy):
    single, multi = Toy(), Toy(OneTurn)
    single.environment = None  # the same task without an environment: one completion per sample
    problems = single.eval_problems()
    p1, g1 = rollout_groups(_sampler(tiny_policy), single, problems, 4, PARAMS)
    p2, g2 = rollout_groups(_sampler(tiny_policy), multi, problems, 4, PARAMS)
    assert p1 == p2
    for a, b in zip(sum(g1, []), sum(g2, [])):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and b.env_spans == () and b.versions is None
    s1 = stamp_groups(single, "w", 0, 0, problems, p1, g1, 0.0, 1.0)
    s2 = stamp_groups(multi, "w", 0, 0, problems, p2, g2, 0.0, 1.0)
    d1 = group_datums([Group(g[0].group_id, g, 0.0) for g in s1])
    d2 = group_datums([Group(g[0].group_id, g, 0.0) for g in s2])
    assert d1 == d2 and all(d.weights is None for d in d2)


def test_each_turn_is_stamped_with_the_version_that_drew_it(tiny_policy):
    sampler = _sampler(tiny_policy, version=3)
    model = sampler.engine.model
    newer = {name: t + 0.01 for name, t in model.state_dict().items()}
    rounds = []

    def between_turns():  # a worker takes newer weights here: version 4 from the second turn on
        rounds.append(1)
        if len(rounds) == 1:
            sampler.load_weights(4, newer)

    task = Toy()
    _, groups = rollout_groups(sampler, task, task.eval_problems()[:1], 2, PARAMS, between_turns=between_turns)
    for sample in groups[0]:
        second_turn = sample.env_spans[1]  # (an answer carries the version of the turn it answers)
        assert set(sample.versions[:second_turn]) == {3}
        assert set(sample.versions[second_turn:]) == {4}
    assert len(rounds) == 2  # before the second and the third turn


@pytest.mark.parametrize("env, reason", [
    (Raises, "episode:error:ValueError"), (Malformed, "episode:bad_observation"),
    (Unencodable, "episode:bad_observation"), (Forever, "episode:max_turns"), (Wordy, "episode:budget"),
])
def test_an_environment_that_breaks_ends_only_its_episode(tiny_policy, env, reason, caplog):
    task = Toy(env)
    limits = EpisodeLimits(max_turns=4, max_context=60, step_timeout_s=5.0)
    _, groups = rollout_groups(_sampler(tiny_policy), task, task.eval_problems(), 2, PARAMS, limits=limits)
    samples = sum(groups, [])
    assert outcome_counts(task) == {reason: 4}
    for sample in samples:
        assert sample.tokens and sample.stop_reason == reason.removeprefix("episode:")
        assert env_spans_problem(sample.env_spans, len(sample.tokens)) is None
        assert len(_sampler(tiny_policy).tokenizer.encode("S#\n.G\n>")) + len(sample.tokens) <= 60
    failed = reason.endswith(("Error", "observation"))
    # a bound keeps the rewards so far: four turns of 0.25, or two answers of 0.5 before the third did not fit
    assert all(s.reward == (0.0 if failed else 1.0) for s in samples)
    assert (reason in caplog.text) == failed  # a failure is logged (once), a bound is not


def test_a_slow_environment_delays_only_its_own_episode(tiny_policy):
    """One episode's step hangs past the timeout: it ends (timeout, reward 0) and the others finish their turns
    meanwhile; nothing waits for the stuck call."""
    release = threading.Event()
    slow_index = []

    class Slow(Counting):
        def __init__(self):
            self.slow = not slow_index
            slow_index.append(1)

        def step(self, action):
            if self.slow:
                release.wait(30)
            return super().step(action)

    task = Toy(Slow)
    start = time.monotonic()
    try:
        _, groups = rollout_groups(_sampler(tiny_policy), task, task.eval_problems()[:1], 4, PARAMS,
                                   limits=EpisodeLimits(step_timeout_s=0.5))
    finally:
        release.set()
    assert time.monotonic() - start < 20
    assert [s.stop_reason for s in groups[0]] == ["timeout", "done", "done", "done"]
    assert groups[0][0].reward == 0.0 and groups[0][1].reward == 0.75
    assert outcome_counts(task) == {"episode:timeout": 1, "episode:done": 3}


def test_the_demonstration_is_played_through_the_environment(tiny_policy):
    _, tok = tiny_policy
    prompt, completion, spans, reward = demonstration_episode(Toy(), Toy().eval_problems()[0], tok)
    assert tok.decode(prompt) == "S.G\n>" and reward == 0.75
    assert tok.decode(completion) == "U<eos>\n1>D<eos>\n2>R<eos>"
    assert policy_token_mask(spans, len(completion)).tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]


def test_a_training_row_of_an_episode_weighs_the_environment_tokens_zero(tiny_policy):
    task = Toy()
    problems = task.eval_problems()
    prompts, groups = rollout_groups(_sampler(tiny_policy), task, problems, 2, PARAMS)
    stamped = stamp_groups(task, "w", 0, 0, problems, prompts, groups, 0.0, 1.0)
    datums = group_datums([Group(g[0].group_id, g, 0.0) for g in stamped])
    for datum, traj in zip(datums, [t for g in stamped for t in g]):
        assert datum.weights == policy_token_mask(traj.env_spans, len(traj.completion_tokens)).astype(float).tolist()
        assert traj.policy_token_count == sum(datum.weights)


def test_every_environment_is_closed_once_its_episode_has_ended_however_it_ended(tiny_policy):
    closed = []

    class Closing(Raises):  # one episode in two raises at its second step; the others run out of turns
        def __init__(self):
            self.raises = len(closed_or_made) % 2 == 0
            closed_or_made.append(self)

        def step(self, action):
            return super().step(action) if self.raises else Counting.step(self, action)

        def close(self):
            closed.append(self)

    closed_or_made = []
    task = Toy(Closing)
    _, groups = rollout_groups(_sampler(tiny_policy), task, task.eval_problems(), 2, PARAMS,
                               limits=EpisodeLimits(max_turns=2))
    assert sorted(map(id, closed)) == sorted(map(id, closed_or_made)) and len(closed) == 4
    assert outcome_counts(task) == {"episode:error:ValueError": 2, "episode:max_turns": 2}


def test_a_reward_function_cannot_replace_an_environments_reward():
    from heterorl.errors import TaskError
    from heterorl.tasks import make_task

    with pytest.raises(TaskError, match="multi-turn: its environment scores each episode"):
        make_task("calculator", reward_fn="tests.constant_reward:score")
