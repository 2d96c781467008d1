"""Rollouts of any task: one completion per sample, or, for a multi-turn task, one episode per sample played with
its environment (`rollout_groups`, the one function every rollout path calls: a batch worker, the simulation, the
synchronous loop, evaluation). The one path that does not is a streaming vLLM worker (``runtime.vllm_streaming``),
which calls `start_group` instead: `rollout_groups` returns when the slowest completion of its batch has ended,
and that barrier is what streaming removes (each group is sent as soon as its own last sample ends, while the
others run on). `start_group` makes the request `rollout_groups` makes for one single-turn problem (the same
prompt encoding and ``max_tokens`` cap, `single_turn_requests`) and returns its future at once; multi-turn
episodes advance in rounds and are not streamed (a streaming run of a multi-turn task is refused at start).

An episode's trajectory is one token array: the first observation is the prompt; then each turn appends the
policy's tokens (with their behaviour log-probs and the version that drew each) and the environment's answer
(log-prob 0, the version of the turn before it, marked in ``env_spans`` so that no loss trains on it). The episodes
of a batch advance in rounds: every episode waiting for the policy is generated in one engine call, then their
environments step in threads. A round starts as soon as the steps have come back, or, when some are slow, once
`STRAGGLER_WAIT_S` has passed after the first came back: a slow environment delays only its own episode. A
step past ``rollout.env_step_timeout_s``, a step that raises, or one that breaks the contract (a malformed
observation, reward or done flag) ends its episode with reward 0, counted by reason in the task's
``episode_outcomes`` (as every ending is: ``episode:done``, ``episode:max_turns``, ``episode:budget``,
``episode:timeout``, ``episode:error:TYPE``, ``episode:bad_observation``).

Bounds: at most ``rollout.max_turns`` policy turns; each turn at most ``rollout.max_tokens`` tokens; prompt and
completion (the environment's tokens included) within ``EpisodeLimits.max_context`` (the learner's
``max_sequence_len``, or the model's positions); the completion within ``rollout.max_episode_tokens``. An answer
that would not fit, with room for one more policy token, ends the episode (``budget``) with the reward so far.

KV caches: each round hands the engine every episode's whole context. vLLM's prefix cache reuses the keys and
values of the context it has seen; the torch engine, asked to (``reuse_prefixes``), keeps the keys and values of
each context's earlier turns and prefills only what is new: the last turn's final token and the answer
(docs/ENGINES.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

from heterorl.config import RolloutConfig
from heterorl.engines.base import SampleOutput, SamplingParams
from heterorl.errors import HeteroRLError, SamplingError, TaskError
from heterorl.rollout.textcodec import encode_prompt, encode_text
from heterorl.tasks.base import Problem
from heterorl.tasks.environment import EnvContractError, check_observation, checked_step, is_multi_turn

log = logging.getLogger("heterorl.rollout.episodes")

STRAGGLER_WAIT_S = 0.2  # after a round's first step returns, how long it waits for the others (fast ones: all)
MAX_ABANDONED_STEPS = 8  # environment calls past their timeout (each leaves a stuck thread) before the run stops
MAX_OUTCOME_CHARS = 32  # an episode's stop reason travels as a trajectory's stop_reason (32 characters at most)


@dataclass(frozen=True)
class EpisodeLimits:
    """The bounds of an episode (see the module's docstring); None: no bound of that kind."""

    max_turns: int = 16
    max_context: int | None = None
    max_episode_tokens: int | None = None
    step_timeout_s: float | None = 30.0

    @classmethod
    def of(cls, rollout: RolloutConfig, max_context: int | None) -> EpisodeLimits:
        """A run's limits: ``rollout``'s, within ``max_context`` tokens (the learner's max_sequence_len)."""
        return cls(rollout.max_turns, max_context, rollout.max_episode_tokens, rollout.env_step_timeout_s)

    @classmethod
    def for_sampler(cls, rollout: RolloutConfig, sampler) -> EpisodeLimits:
        """`of`, within the context of ``sampler``'s model (its engine's ``max_positions``; none when it does not
        say, as a sampler over a remote engine)."""
        return cls.of(rollout, getattr(getattr(sampler, "engine", None), "max_positions", None))


@dataclass
class _Episode:
    index: int  # problem-major: problem i's sample j is i * num_samples + j
    env: object
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    end: str | None = None
    action: object = None  # the last turn, as the environment takes it (text, or token ids)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def output(self) -> SampleOutput:
        """The episode as one sample; ``versions`` None when one version drew all its turns (as for a single
        generation: whoever stamps it names that version)."""
        versions = self.versions if len(set(self.versions)) > 1 else None
        return SampleOutput(tokens=self.tokens, logprobs=self.logprobs, stop_reason=self.end or "done",
                            text="".join(self.texts), versions=versions, env_spans=tuple(self.spans),
                            reward=self.reward)


class _Steps:
    """The environments' calls, in threads shared by every batch of the process, each with a deadline. A call
    past its deadline leaves its thread stuck: after `MAX_ABANDONED_STEPS` of them the run stops with an error
    naming the environment, rather than piling up threads."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="heterorl-env")
        self._lock = threading.Lock()
        self.abandoned = 0

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def abandon(self, what: str, timeout_s: float) -> None:
        with self._lock:
            self.abandoned += 1
            if self.abandoned > MAX_ABANDONED_STEPS:
                raise TaskError(f"{what} has not returned within {timeout_s:g} s on {self.abandoned} calls "
                                "(rollout.env_step_timeout_s); each leaves a thread stuck inside it, so the run "
                                "stops here: raise rollout.env_step_timeout_s or fix the environment")


_STEPS = _Steps()


def rollout_groups(sampler, task, problems: Sequence[Problem], num_samples: int, params: SamplingParams, *,
                   chat_template: bool = False, limits: EpisodeLimits | None = None,
                   weight_updates: Callable | None = None,
                   between_turns: Callable[[], None] | None = None) -> tuple[list[list[int]], list[list[SampleOutput]]]:
    """(prompts, groups): each problem's prompt tokens and ``num_samples`` samples of it (outer list: problems).

    A single-turn task: the prompts encoded (`encode_prompt`) and one generation (``weight_updates`` as
    `SamplingClient.sample` takes them); the samples are scored later (`heterorl.tasks.rewards.score_all`). A
    multi-turn task: episodes played with its environments under ``limits``, each sample scored (its
    ``reward``); ``between_turns`` is called before every round after the first (a worker loads newer weights
    there, so later turns are drawn, and stamped, with them).

    Every rollout path calls it except a streaming vLLM worker, which starts each group with `start_group`: this
    call returns with its batch's slowest completion, and a streaming worker sends each group as its own ends."""
    limits = limits or EpisodeLimits()
    if not is_multi_turn(task):
        prompts, params = single_turn_requests(sampler.tokenizer, problems, params, chat_template, limits.max_context)
        updates = {} if weight_updates is None else {"weight_updates": weight_updates}
        return prompts, sampler.sample(prompts, num_samples, params, **updates).result()
    player = _EpisodePlayer(sampler, task, limits, chat_template, weight_updates)
    return player.play(problems, num_samples, params, between_turns)


def start_group(engine, tokenizer, problem: Problem, num_samples: int, params: SamplingParams, *,
                chat_template: bool = False, max_context: int | None = None) -> tuple[list[int], Future]:
    """(prompt, future): one single-turn group started on a streaming engine (``engine.submit``,
    `StreamingVLLMEngine`) and not waited for: its prompt tokens, and a future of its ``num_samples`` samples,
    done when the last one ends. The request is the one `rollout_groups` makes for the problem (see the module's
    docstring for why a streaming worker calls this instead); the samples come back without ``text``."""
    (prompt,), params = single_turn_requests(tokenizer, [problem], params, chat_template, max_context)
    return prompt, engine.submit(prompt, params, num_samples)


def single_turn_requests(tokenizer, problems: Sequence[Problem], params: SamplingParams, chat_template: bool,
                         max_context: int | None) -> tuple[list[list[int]], SamplingParams]:
    """(prompts, params): single-turn problems' prompts encoded (`encode_prompt`), and ``params`` with
    ``max_tokens`` fitted to the longest of them (`fit_max_tokens`)."""
    prompts = [encode_prompt(tokenizer, p.prompt, chat_template) for p in problems]
    return prompts, fit_max_tokens(params, prompts, max_context)


def fit_max_tokens(params: SamplingParams, contexts: list[list[int]], max_context: int | None) -> SamplingParams:
    """``params`` with ``max_tokens`` capped so that the longest of ``contexts`` plus a completion fits
    ``max_context`` tokens (the learner's ``max_sequence_len``; None: no cap); HeteroRLError when a context alone
    leaves no room."""
    if max_context is None:
        return params
    longest = max(map(len, contexts))
    room = max_context - longest
    if room < 1:
        raise HeteroRLError(f"a prompt of {longest} tokens leaves no room for a completion in the learner's "
                            f"max_sequence_len ({max_context}, its model's context): use shorter prompts "
                            "(task.options) or a model with a longer context")
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))


def demonstration_episode(task, problem: Problem, tokenizer, chat_template: bool = False):
    """(prompt, completion, env_spans, reward): the expert's actions (``task.demonstration``) played through a
    fresh environment, each turn ended by the end-of-sequence token as a sampled turn is, for SFT. TaskError
    when the environment ends the episode before the actions run out, or they run out before it ends."""
    env = task.environment(problem)
    prompt = encode_prompt(tokenizer, check_observation(env.reset(problem)), chat_template)
    completion, spans, reward = [], [], 0.0
    actions = task.demonstration(problem)
    for turn, action in enumerate(actions, start=1):
        tokens = encode_text(tokenizer, action, "a demonstration's action") + [tokenizer.eos_token_id]
        completion += tokens
        result = checked_step(env.step(tokens if getattr(env, "takes_token_ids", False) else action))
        reward += float(result.reward)
        if result.done:
            if turn < len(actions):
                raise TaskError(f"{task.name}: the demonstration of {problem.problem_id} ends its episode after "
                                f"{turn} of its {len(actions)} actions")
            return prompt, completion, tuple(spans), reward
        observation = check_observation(result.observation)
        if observation:
            ids = encode_text(tokenizer, observation, "an observation") if isinstance(observation, str) else observation
            spans += [len(completion), len(completion) + len(ids)]
            completion += ids
    raise TaskError(f"{task.name}: the demonstration of {problem.problem_id} ran out of actions ({len(actions)}) "
                    "before its episode ended")


class _EpisodePlayer:
    """One batch of episodes (`rollout_groups` for a multi-turn task)."""

    def __init__(self, sampler, task, limits: EpisodeLimits, chat_template: bool, weight_updates) -> None:
        self.sampler, self.task, self.limits = sampler, task, limits
        self.chat_template, self.weight_updates = chat_template, weight_updates
        self.tokenizer = sampler.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.outcomes = task.__dict__.setdefault("episode_outcomes", Counter())
        self.name = getattr(task, "name", type(task).__name__)

    # -- the batch ----------------------------------------------------------------------------------
    def play(self, problems, num_samples: int, params: SamplingParams, between_turns):
        episodes, prompts = self._reset(problems, num_samples)
        self._first_turn(episodes, prompts, num_samples, params)
        pending: dict[Future, tuple[_Episode, float]] = {}
        self._submit_steps([e for e in episodes if e.end is None], pending)
        for round_ in itertools.count(1):
            ready = self._collect(pending)
            if not ready and not pending:
                break
            if ready:
                if between_turns is not None:
                    between_turns()
                self._turn(ready, params, round_)
                self._submit_steps([e for e in ready if e.end is None], pending)
        self._close_environments(episodes)
        outputs = [e.output() if e.prompt else SampleOutput([], [], e.end or "reset_failed", reward=0.0)
                   for e in episodes]
        return prompts, [outputs[i * num_samples:(i + 1) * num_samples] for i in range(len(problems))]

    def _reset(self, problems, num_samples: int) -> tuple[list[_Episode], list[list[int]]]:
        """A fresh environment per episode, all reset at once: the group's prompt is its first episode's first
        observation (an episode whose reset fails, or differs from its group's, is left out: it has no tokens)."""
        episodes, resets = [], []
        for i, problem in enumerate(problems):
            for j in range(num_samples):
                episode = _Episode(i * num_samples + j, None, [])
                episodes.append(episode)
                try:
                    episode.env = self.task.environment(problem)
                    resets.append(_STEPS.submit(episode.env.reset, problem))
                except Exception as exc:
                    self._close(episode, f"error:{type(exc).__name__}", exc)
                    resets.append(None)
        prompts = []
        timeout = self.limits.step_timeout_s
        deadline = time.monotonic() + timeout if timeout is not None else None
        for i, problem in enumerate(problems):
            group_prompt = None
            for episode, future in zip(episodes[i * num_samples:(i + 1) * num_samples],
                                       resets[i * num_samples:(i + 1) * num_samples]):
                if future is None:
                    continue
                try:
                    prompt = self._encode(self._result(future, deadline), first=True)
                except _Ended as ended:
                    self._close(episode, ended.reason, ended.__cause__)
                    continue
                if group_prompt is not None and prompt != group_prompt:
                    self._close(episode, "reset_differs", EnvContractError(
                        f"reset gave another first observation than its group's (problem {problem.problem_id}); "
                        "a group's episodes must start alike"))
                    continue
                group_prompt = episode.prompt = prompt
            prompts.append(group_prompt or [])
        return episodes, prompts

    def _first_turn(self, episodes: list[_Episode], prompts: list[list[int]], num_samples: int,
                    params: SamplingParams) -> None:
        """Every problem's prompt once, ``num_samples`` samples each: the same call as a single-turn rollout's."""
        live = [i for i, p in enumerate(prompts) if p]
        if not live:
            return
        params = self._fit(params, [prompts[i] for i in live], 0)
        groups = self.sampler.sample([prompts[i] for i in live], num_samples, params,
                                     **self._sample_options()).result()
        for i, group in zip(live, groups):
            for j, sample in enumerate(group):
                episode = episodes[i * num_samples + j]
                if episode.end is None:
                    self._add_action(episode, sample)

    def _turn(self, ready: list[_Episode], params: SamplingParams, round_: int) -> None:
        """One turn of every episode in ``ready``, in one engine call (one sample each)."""
        params = self._fit(params, [e.context for e in ready], round_)
        samples = self.sampler.sample([e.context for e in ready], 1, params,
                                      **self._sample_options()).result()
        for episode, (sample,) in zip(ready, samples):
            self._add_action(episode, sample)

    def _sample_options(self) -> dict:
        """The sampler's options beyond the defaults: in-flight updates when given, and ``reuse_prefixes`` for an
        engine that keeps the contexts of earlier turns (`supports_prefix_reuse`)."""
        options = {} if self.weight_updates is None else {"weight_updates": self.weight_updates}
        if getattr(getattr(self.sampler, "engine", None), "supports_prefix_reuse", False):
            options["reuse_prefixes"] = True
        return options

    def _fit(self, params: SamplingParams, contexts: list[list[int]], round_: int) -> SamplingParams:
        """``params`` for one round: ``max_tokens`` within the context left (`fit_max_tokens`) and, after the
        first round, a seed of its own."""
        if round_ and params.seed is not None:
            params = dataclasses.replace(params, seed=zlib.crc32(f"{params.seed}/{round_}".encode()))
        return fit_max_tokens(params, contexts, self.limits.max_context)

    def _add_action(self, episode: _Episode, sample: SampleOutput) -> None:
        version = self.sampler.version
        tokens = list(sample.tokens)
        budget = self.limits.max_episode_tokens
        cut = budget is not None and len(episode.tokens) + len(tokens) > budget
        if cut:
            tokens = tokens[:budget - len(episode.tokens)]
        episode.tokens += tokens
        episode.logprobs += list(sample.logprobs[:len(tokens)])
        episode.versions += list(sample.versions[:len(tokens)]) if sample.versions else [version] * len(tokens)
        takes_ids = getattr(episode.env, "takes_token_ids", False)
        decoded = self.tokenizer.decode(tokens, skip_special_tokens=True) if cut or not takes_ids else None
        episode.texts.append(decoded if cut else sample.text)
        episode.turns += 1
        if cut or not tokens:
            self._close(episode, "budget")
        episode.action = tokens if takes_ids else decoded

    # -- the environments' steps ----------------------------------------------------------------------
    def _submit_steps(self, episodes: list[_Episode], pending: dict) -> None:
        timeout = self.limits.step_timeout_s
        for e in episodes:
            deadline = time.monotonic() + timeout if timeout is not None else float("inf")
            pending[_STEPS.submit(e.env.step, e.action)] = (e, deadline)

    def _collect(self, pending: dict) -> list[_Episode]:
        """Wait for steps (see the module's docstring); apply those that came back or overran; the episodes
        that go on, in batch order."""
        if not pending:
            return []
        first_deadline = min(deadline for _, deadline in pending.values())
        done, _ = wait(pending, timeout=max(0.0, first_deadline - time.monotonic()), return_when=FIRST_COMPLETED)
        if done and len(done) < len(pending):
            done, _ = wait(pending, timeout=STRAGGLER_WAIT_S)
        ready = []
        now = time.monotonic()
        for future in list(pending):
            episode, deadline = pending[future]
            if future.done():
                del pending[future]
                self._apply(episode, future)
                if episode.end is None:
                    ready.append(episode)
            elif now >= deadline:
                del pending[future]
                self._close(episode, "timeout", TimeoutError(f"a step ran past {self.limits.step_timeout_s:g} s"))
                _STEPS.abandon(f"{self.name}'s environment step", self.limits.step_timeout_s)
        return sorted(ready, key=lambda e: e.index)

    def _apply(self, episode: _Episode, future: Future) -> None:
        """A step's result: its reward added, and its observation appended unless the episode ends."""
        try:
            result = checked_step(future.result())
            if result.done or episode.turns >= self.limits.max_turns:
                episode.reward += float(result.reward)
                self._close(episode, "done" if result.done else "max_turns")
                return
            observation = self._encode(result.observation, first=False)
        except _Ended as ended:
            self._close(episode, ended.reason, ended.__cause__)
            return
        except EnvContractError as exc:
            self._close(episode, "bad_observation", exc)
            return
        except Exception as exc:  # the environment's own error: this episode ends, the run goes on
            self._close(episode, f"error:{type(exc).__name__}", exc)
            return
        episode.reward += float(result.reward)
        if not self._fits(episode, len(observation)):
            self._close(episode, "budget")
            return
        if observation:
            start = len(episode.tokens)
            episode.tokens += observation
            episode.logprobs += [0.0] * len(observation)
            episode.versions += [episode.versions[-1]] * len(observation)
            episode.spans += [start, len(episode.tokens)]

    def _fits(self, episode: _Episode, more: int) -> bool:
        """Whether ``more`` environment tokens and one more policy token fit the episode's bounds."""
        limits = self.limits
        if limits.max_context is not None and len(episode.prompt) + len(episode.tokens) + more + 1 > limits.max_context:
            return False
        return limits.max_episode_tokens is None or len(episode.tokens) + more + 1 <= limits.max_episode_tokens

    def _encode(self, observation, first: bool) -> list[int]:
        """An observation's token ids: text encoded (a first observation as a prompt), ids checked; `_Ended`
        (``bad_observation``) when it is malformed or the tokenizer cannot represent it."""
        try:
            observation = check_observation(observation)
            if isinstance(observation, str):
                if not observation:
                    if first:
                        raise EnvContractError("reset returned an empty observation; the prompt needs a token")
                    return []
                if first:
                    return encode_prompt(self.tokenizer, observation, self.chat_template)
                return encode_text(self.tokenizer, observation, "an observation")
            if any(not 0 <= t < self.vocab_size for t in observation) or (first and not observation):
                raise EnvContractError(f"an observation's token ids must be in [0, {self.vocab_size}) (and a first "
                                       "observation non-empty)")
            return list(observation)
        except (EnvContractError, SamplingError) as exc:
            raise _Ended("bad_observation") from exc

    def _result(self, future: Future, deadline: float | None):
        """A reset's result by ``deadline`` (None: no limit); `_Ended` when it fails."""
        try:
            return future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            _STEPS.abandon(f"{self.name}'s environment reset", self.limits.step_timeout_s)
            raise _Ended("timeout") from exc
        except Exception as exc:
            raise _Ended(f"error:{type(exc).__name__}") from exc

    def _close_environments(self, episodes: list[_Episode]) -> None:
        """Every environment's ``close``, in the step threads, waited for within the step timeout (one that
        raises or hangs is logged; its episode has ended already)."""
        closing = [_STEPS.submit(e.env.close) for e in episodes if callable(getattr(e.env, "close", None))]
        done, hung = wait(closing, timeout=self.limits.step_timeout_s)
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed or hung:
            log.warning("%s: %d environment close() call(s) raised (first: %r) and %d did not return in time",
                        self.name, len(failed), failed[0] if failed else None, len(hung))

    # -- endings --------------------------------------------------------------------------------------
    def _close(self, episode: _Episode, reason: str, failure: BaseException | None = None) -> None:
        """End ``episode`` and count how (``episode:REASON``); a ``failure`` (an environment that raised, hung or
        broke the contract) scores 0 and is logged the first time its reason occurs."""
        reason = reason[:MAX_OUTCOME_CHARS]
        key = f"episode:{reason}"
        if failure is not None:
            episode.reward = 0.0
            if not self.outcomes[key]:
                log.warning("%s: %s (%s: %s); that episode ends with reward 0, counted as %s in the run's "
                            "reward_outcomes", self.name, "an environment call failed", type(failure).__name__,
                            str(failure)[:200], key)
        episode.end = reason
        self.outcomes[key] += 1


class _Ended(Exception):
    """An environment call ended its episode (``reason``; the failure is its ``__cause__``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
