"""tinker-cookbook RL environments as heterorl environments (task ``cookbook_env``).

The cookbook (``tinker_cookbook.rl.types``, 0.6) defines an ``Env`` (``await initial_observation()`` gives a
``tinker.ModelInput`` and a ``StopCondition``; ``await step(action_tokens)`` gives a ``StepResult`` with
``reward``, ``episode_done``, ``next_observation``, ``next_stop_condition``), an ``EnvGroupBuilder`` (``await
make_envs()`` gives the G envs of one group) and an ``RLDataset`` (``get_batch(i)`` gives builders), built by an
``RLDatasetBuilder`` (``await builder()`` gives the train dataset and an optional test dataset).

- **Problems.** The task's ``source`` (``"package.module:name"``, called as ``name(**source_args)``) gives an
  ``RLDatasetBuilder``, an ``RLDataset`` or a list of ``EnvGroupBuilder``s; each builder is one problem, named by
  its position (``cookbook-7``, ``cookbook-test-2``): a worker and the learner build the task from the same
  options and must read the same builders. The eval set is the test dataset's builders when the source gives one
  (its first ``eval_size``), else ``eval_size`` (or ``eval_fraction``) builders held out by shuffling with
  ``random.Random(split_seed)``; training never draws a held-out position.
- **Episodes.** ``environment(problem)`` makes a `CookbookEnvironment`: its ``reset`` builds the builder's group
  (``make_envs``) and plays its first env; the others are left unused. Every episode of a problem thus starts
  alike (heterorl's group is its ``group_size`` episodes of that problem). The builder's ``cleanup`` runs when
  the episode ends, when a call into the env raises, or, for an episode the runner leaves unfinished (its
  ``max_turns``, its token budget, a timeout), when the runner closes the environment (or, failing that, when
  it is garbage-collected). A builder whose envs only play
  together (two seats of one game, sharing a coordinator) cannot be played this way: its first env waits for a
  partner until ``rollout.env_step_timeout_s``.
- **Observations are increments.** A cookbook step's ``next_observation`` is the whole next prompt (the
  conversation rendered so far); heterorl's trajectory is one token array, so the adapter gives the runner only
  what is new: ``next_observation`` must begin with the previous observation followed by the action's tokens,
  and the rest is the observation (`observation_increment`). One that does not (a renderer that rewrites history,
  an env that renders the policy's turns under another role) is refused with `EnvContractError`. Actions are
  the policy's token ids (``takes_token_ids``), its stop token included.
- **Rewards.** A turn's reward is the step's ``reward``. Group rewards (``compute_group_rewards``) need the
  group's trajectories together, and heterorl plays each episode alone: a builder whose class overrides it is
  refused when the task is built, except with the implementation of the cookbook's ``ProblemGroupBuilder``,
  which gives 0 to every trajectory (`group_rewards_problem`).
- **Stop conditions.** heterorl's engines end a turn at a token id (the policy's end-of-sequence token), never at
  a text: a ``StopCondition`` of strings (``RoleColonRenderer``'s ``"\\n\\nUser:"``) is refused, and one of token
  ids must list only ids that ``stop_token_ids`` (the task option naming the ids a turn of this run's policy ends
  at) holds (`check_stop`). An empty one (no stop) needs nothing.
- **Errors.** A break of the rules above is an `EnvContractError` (counted ``episode:bad_observation``); an
  exception raised inside the cookbook's env or builder (a ``RendererError`` on an action with two stop tokens,
  say) propagates as it is (counted ``episode:error:RendererError``). Either ends the episode with reward 0.
- **Event loop.** The cookbook's calls are coroutines; they run on the task's `LoopThread`, one event loop for
  all its episodes, as the cookbook runs every env of a run on one loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from heterorl.errors import TaskError
from heterorl.import_paths import import_object, split_import_path
from heterorl.loop_thread import LoopThread
from heterorl.tasks.base import FixedRows, Problem, check_split_options, held_out_split
from heterorl.tasks.environment import EnvContractError, Environment, StepResult

INSTALL_HINT = "`make install` adds it: pip install --no-deps tinker-cookbook==0.6.1, its other imports in [dev]"
SOURCE_NAMES = ("an RLDatasetBuilder class, or a function returning an RLDatasetBuilder, an RLDataset or a list of "
                "EnvGroupBuilders")  # what `source` must name


@dataclass(frozen=True)
class CookbookEnvConfig:
    """Which cookbook environments, how to split them, and which token ids end a policy turn (see the module's
    docstring). ``max_groups`` bounds how many builders are read from each dataset (None: all)."""

    source: str
    source_args: dict = field(default_factory=dict)
    eval_size: int | None = None
    eval_fraction: float = 0.1
    split_seed: int = 0
    max_groups: int | None = None
    stop_token_ids: list = field(default_factory=list)

    def __post_init__(self) -> None:
        split_import_path(self.source, "cookbook_env option source", SOURCE_NAMES)
        if not isinstance(self.source_args, Mapping) or not all(isinstance(k, str) for k in self.source_args):
            raise TaskError(f"cookbook_env option source_args={self.source_args!r} must be a mapping of argument "
                            "names to values")
        check_split_options("cookbook_env", self, ("eval_size", "max_groups"))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(type(t) is int and t >= 0 for t in ids):
            raise TaskError(f"cookbook_env option stop_token_ids={ids!r} must be a list of token ids (integers "
                            ">= 0): those a turn of this run's policy ends at, its end-of-sequence token")


def import_cookbook():
    """``tinker_cookbook.rl.types``, or a TaskError saying how to install it."""
    try:
        from tinker_cookbook.rl import types
    except ImportError as err:
        raise TaskError(f"task cookbook_env needs tinker-cookbook 0.6: {INSTALL_HINT} ({err})") from err
    return types


def observation_increment(context: list[int], observation: list[int]) -> list[int]:
    """What ``observation`` (a cookbook step's whole next prompt) adds to ``context`` (the previous observation
    and the action's tokens): ``observation[len(context):]``; `EnvContractError` saying where the two part when
    ``observation`` does not begin with ``context``."""
    n = len(context)
    if observation[:n] == context:
        return observation[n:]
    at = next((i for i, (a, b) in enumerate(zip(context, observation)) if a != b), len(observation))
    where = (f"is {len(observation)} tokens, shorter than the episode's {n}" if at == len(observation) else
             f"has token {observation[at]} at position {at}, where the episode has {context[at]}")
    raise EnvContractError(
        f"the cookbook env's next observation does not extend the episode: it {where}. heterorl's trajectory is "
        "one token array, so each observation must begin with the previous one and the action's tokens; a "
        "renderer that rewrites history (drops earlier thinking, renders the policy's turns under another role) "
        "breaks this: use one with the extension property (renderer.has_extension_property)")


def check_stop(stop, stop_token_ids: frozenset[int]) -> None:
    """`EnvContractError` unless a turn can end where the cookbook's ``stop`` condition asks (module docstring)."""
    if not stop:
        return
    if any(isinstance(s, str) for s in stop):
        raise EnvContractError(
            f"the cookbook env ends a turn at the text {list(stop)!r:.80}; heterorl's engines end a turn at a token "
            "id only (the policy's end-of-sequence token): use a renderer whose stop sequences are token ids "
            "(llama3, qwen3, ...; renderer.get_stop_sequences())")
    missing = sorted({t for t in stop if t not in stop_token_ids})
    if missing:
        raise EnvContractError(
            f"the cookbook env ends a turn at token ids {missing}, which task.options.stop_token_ids "
            f"{sorted(stop_token_ids)} does not list: set it to the token ids a turn of this run's policy ends at "
            "(its end-of-sequence token) when they are these, or use a renderer that stops there")


def model_input_tokens(observation, what: str) -> list[int]:
    """The token ids of a ``tinker.ModelInput``; `EnvContractError` for one with image chunks."""
    try:
        return list(observation.to_ints())
    except (AttributeError, ValueError) as err:
        raise EnvContractError(f"the cookbook env's {what} is not a ModelInput of text tokens ({err}); heterorl "
                               "observations are token ids") from None


def group_rewards_problem(types, builder) -> str | None:
    """Why ``builder``'s group rewards cannot be given here; None when they are 0 (module docstring)."""
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    method = type(builder).compute_group_rewards
    if method in (types.EnvGroupBuilder.compute_group_rewards, ProblemGroupBuilder.compute_group_rewards):
        return None
    return (f"{type(builder).__name__} computes group rewards (compute_group_rewards), which need the group's "
            "trajectories together; heterorl plays each episode alone and cannot give them")


class CookbookEnvironment(Environment):
    """One episode of the first env of ``builder``'s group, its coroutines run on ``loop`` (see the module's
    docstring)."""

    takes_token_ids = True

    def __init__(self, builder, stop_token_ids: frozenset[int], loop: LoopThread) -> None:
        self.builder = builder
        self.stop_token_ids = stop_token_ids
        self._loop = loop
        self._env = None
        self._context: list[int] = []
        self._cleanup: weakref.finalize | None = None

    def reset(self, problem: Problem) -> list[int]:
        # an episode the runner leaves unfinished is cleaned up when this environment is collected
        self._cleanup = weakref.finalize(self, _clean_up, self._loop, self.builder)
        self._cleanup.atexit = False  # the loop's thread is gone by then
        return self._ended_if_raises(self._first_observation)

    def step(self, action: list[int]) -> StepResult:
        return self._ended_if_raises(self._step, list(action))

    def _first_observation(self) -> list[int]:
        from tinker_cookbook.rl.types import InitialObservationOverflow

        envs = self._loop.run(self.builder.make_envs())
        if not envs:
            raise EnvContractError(f"{type(self.builder).__name__}.make_envs() made no env")
        self._env = envs[0]
        first = self._loop.run(self._env.initial_observation())
        if isinstance(first, InitialObservationOverflow):
            raise EnvContractError(f"the cookbook env's first observation overflows its token budget ({first.logs}); "
                                   "an episode needs a policy turn: shorten the prompt or raise the env's budget")
        observation, stop = first
        check_stop(stop, self.stop_token_ids)
        self._context = model_input_tokens(observation, "first observation")
        if not self._context:
            raise EnvContractError("the cookbook env's first observation is empty; the prompt needs a token")
        return list(self._context)

    def _step(self, action: list[int]) -> StepResult:
        result = self._loop.run(self._env.step(action))
        if result.episode_done:
            self._end()
            return StepResult([], result.reward, True)
        observation = model_input_tokens(result.next_observation, "next observation")
        increment = observation_increment(self._context + action, observation)
        check_stop(result.next_stop_condition, self.stop_token_ids)
        self._context = observation
        return StepResult(increment, result.reward, False)

    def _ended_if_raises(self, call, *args):
        """``call(*args)``; the episode ends (its builder cleaned up) when it raises, as the cookbook cleans up a
        group whose rollout failed."""
        try:
            return call(*args)
        except BaseException:
            self._end()
            raise

    def close(self) -> None:
        """The builder's cleanup, once the runner has ended the episode (a bound, a timeout: whatever ended it)."""
        self._end()

    def _end(self) -> None:
        """The builder's cleanup, waited for (once)."""
        if self._cleanup is not None and self._cleanup.detach() is not None:
            self._loop.run(self.builder.cleanup())


def _clean_up(loop: LoopThread, builder) -> None:
    loop.submit(builder.cleanup())


def load_builders(types, spec: str, args: Mapping, max_groups: int | None,
                  loop: LoopThread) -> tuple[list, list | None]:
    """The train builders and, when the source gives a test dataset, the test builders (module docstring); an
    ``RLDatasetBuilder`` runs on ``loop``, where the episodes will."""
    target = import_object(spec, "cookbook_env option source", SOURCE_NAMES)
    try:
        built, test = target(**args), None
        if isinstance(built, types.RLDatasetBuilder):
            built, test = loop.run(built())
    except TaskError:
        raise
    except Exception as err:
        raise TaskError(f"cookbook_env source {spec!r} with arguments {dict(args)!r} raised {type(err).__name__}: "
                        f"{err}") from err
    train = _builders_of(types, built, spec, max_groups)
    return train, None if test is None else _builders_of(types, test, f"{spec} (its test dataset)", max_groups)


def _builders_of(types, source, what: str, max_groups: int | None) -> list:
    if isinstance(source, types.RLDataset):
        builders = []
        for index in range(len(source)):
            builders += source.get_batch(index)
            if max_groups is not None and len(builders) >= max_groups:
                break
    elif isinstance(source, Sequence) and not isinstance(source, str):
        builders = list(source)
    else:
        raise TaskError(f"cookbook_env source {what} gave a {type(source).__name__}; give an RLDatasetBuilder, an "
                        "RLDataset or a list of EnvGroupBuilders")
    builders = builders[:max_groups]
    wrong = [type(b).__name__ for b in builders if not isinstance(b, types.EnvGroupBuilder)]
    if wrong:
        raise TaskError(f"cookbook_env source {what} gave {wrong[0]} where an EnvGroupBuilder was expected")
    if not builders:
        raise TaskError(f"cookbook_env source {what} gave no env group builders")
    return builders


class CookbookEnvTask(FixedRows):
    """The env group builders of a tinker-cookbook source, each a problem played by its first env."""

    name = "cookbook_env"

    def __init__(self, config: CookbookEnvConfig) -> None:
        self.config = config
        types = import_cookbook()
        self.loop = LoopThread(f"heterorl-cookbook-{config.source}")
        train, test = load_builders(types, config.source, config.source_args, config.max_groups, self.loop)
        for builder in train + (test or []):
            if (why := group_rewards_problem(types, builder)) is not None:
                raise TaskError(f"cookbook_env source {config.source!r}: {why}")
        self._builders: dict[str, object] = {}
        problems = self._problems("cookbook", train)
        if test is not None:
            self._eval = self._problems("cookbook-test", test)[:config.eval_size]
            self._train = problems
        else:
            self._train, self._eval = held_out_split(problems, config.eval_size, config.eval_fraction,
                                                     config.split_seed, f"cookbook_env source {config.source!r}",
                                                     "give a source with a test dataset", by_prompt=False)
        self._alphabet = ""  # observations are token ids of the renderer's tokenizer, which the policy must share
        self._stop_token_ids = frozenset(config.stop_token_ids)

    def _problems(self, prefix: str, builders: list) -> list[Problem]:
        problems = []
        for index, builder in enumerate(builders):
            problem_id = f"{prefix}-{index}"
            self._builders[problem_id] = builder
            problems.append(Problem(problem_id, f"{type(builder).__name__} {problem_id}", "", {"index": index}))
        return problems

    def environment(self, problem: Problem) -> CookbookEnvironment:
        builder = self._builders.get(problem.problem_id)
        if builder is None:
            raise TaskError(f"problem {problem.problem_id!r} is not a builder of cookbook_env source "
                            f"{self.config.source!r}; the worker's task options must match the learner's")
        return CookbookEnvironment(builder, self._stop_token_ids, self.loop)

    def demonstration(self, problem: Problem) -> list[str]:
        raise TaskError("cookbook_env has no demonstrations for SFT: a cookbook env gives no expert's actions")

    def reward(self, problem: Problem, completion: str) -> float:
        raise TaskError("cookbook_env is scored by its environments, turn by turn (task.environment(problem)); a "
                        "single completion has no reward")
