"""The sampling-engine contract: what a rollout needs from a generator.

Engines (the torch engine here, vLLM behind the ``[vllm]`` extra) return, for
each sample, the tokens, the per-token log-probs of the distribution the token
was actually drawn from (after temperature / top-k / top-p), and why it stopped.
Those log-probs are the *behaviour* log-probs the losses need.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from heterorl.errors import SamplingError

STOP_EOS = "eos"  # the model's end-of-sequence token was sampled
STOP_TOKEN = "stop"  # one of SamplingParams.stop_token_ids was sampled
STOP_LENGTH = "length"  # max_tokens was reached


GREEDY_BELOW = 1e-5  # a sampling temperature below this is greedy decoding


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding, and so does any temperature below
    `GREEDY_BELOW` (as vLLM does: dividing the logits by less makes them infinite).

    With ``temperature == 0`` the reported log-probs are those of the unmodified
    model (temperature 1), since the greedy "distribution" is a point mass.
    """

    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks: every sample gets max_tokens tokens)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise SamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class SampleOutput:
    """One completion: its tokens (the stop token included), their log-probs, and the stop reason. ``versions``:
    the policy version that sampled each token, when the generation took in-flight weight updates
    (`WeightUpdates`); None when one set of weights sampled it all.

    A multi-turn episode (heterorl.rollout.episodes) is one completion too: its tokens are the policy's turns and the
    environment's answers back to back, ``env_spans`` marks the answers (heterorl.rollout.spans; their log-probs are
    0), ``versions`` is given when its turns were drawn by more than one version, and ``reward`` is the episode's
    reward, from its environment."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    text: str = field(default="", compare=False)
    versions: list[int] | None = field(default=None, compare=False)
    env_spans: tuple[int, ...] = field(default=(), compare=False)
    reward: float | None = field(default=None, compare=False)


class WeightUpdates:
    """Newer weights for a generation in progress (in-flight updates, as PipelineRL applies them): an engine that
    supports them calls `poll` between decode steps, loads what it returns, and stamps each later token with the
    new version. ``version``: the version of the weights the generation starts with."""

    def __init__(self, version: int, poll: Callable[[], tuple[int, dict] | None]) -> None:
        self.version = version
        self._poll = poll
        self.applied = 0  # updates applied during generations

    def poll(self) -> tuple[int, dict] | None:
        """(version, state dict) of newer weights, or None; the caller loads them."""
        got = self._poll()
        if got is not None:
            self.version = got[0]
            self.applied += 1
        return got


class GenerationCancelled(SamplingError):
    """A generation stopped between two decode steps because its caller cancelled it (`GenerationWatch.cancel`)."""


class GenerationWatch:
    """A caller's view of a generation in progress, and its brake. An engine that supports it
    (``SamplingEngine.supports_watch``) calls `tokens` after every decode step with the token each unfinished row
    drew (rows prompt-major: prompt ``i``'s sample ``j`` is row ``i * num_samples + j``), and stops with
    `GenerationCancelled` between two decode steps once `cancel` was called (from any thread). An engine that
    does not (vLLM) is checked before it starts and reports each row's tokens when it is done
    (`SamplingClient.sample` does both)."""

    def __init__(self, on_tokens: Callable[[list[int], list[int], list[float]], None] | None = None) -> None:
        """``on_tokens(rows, tokens, logprobs)``: called on the generating thread, so it must be quick."""
        self._on_tokens = on_tokens
        self._cancelled = threading.Event()
        self.version: int | None = None  # the policy version that generates (set when the generation starts)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raise `GenerationCancelled` once `cancel` was called."""
        if self._cancelled.is_set():
            raise GenerationCancelled("the generation was cancelled by its caller (its client went away)")

    def tokens(self, rows: list[int], tokens: list[int], logprobs: list[float]) -> None:
        if self._on_tokens is not None and rows:
            self._on_tokens(rows, tokens, logprobs)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Check prompts are non-empty lists of in-vocabulary token ids; return them as lists."""
    if len(prompts) == 0:
        raise SamplingError("no prompts given: pass at least one prompt (a list of token ids)")
    checked = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise SamplingError(f"prompt {i} is empty: a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError(
                f"prompt {i} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
                "was it encoded with another model's tokenizer?"
            )
        checked.append(prompt)
    return checked


def validate_request(prompts: Sequence[Sequence[int]], params: SamplingParams, num_samples: int, vocab_size: int,
                     max_positions: int | None) -> list[list[int]]:
    """`validate_prompts`, and check that ``num_samples`` is a positive integer and that the longest prompt plus
    ``max_tokens`` fits the model's positions; return the prompts as lists."""
    prompts = validate_prompts(prompts, vocab_size)
    if not isinstance(num_samples, int) or num_samples < 1:
        raise SamplingError(f"num_samples must be a positive integer, got {num_samples!r}")
    longest = max(len(p) for p in prompts) + params.max_tokens
    if max_positions is not None and longest > max_positions:
        raise SamplingError(
            f"prompt length + max_tokens = {longest} exceeds the model's max_position_embeddings "
            f"({max_positions}); lower max_tokens or shorten the prompt"
        )
    return prompts


def check_weights(state_dict, expected: dict[str, tuple[int, ...]], model: str, skip: Sequence[str] = ()) -> dict:
    """The tensors of ``state_dict`` to load, after checking each name and shape against ``expected`` (the engine's
    model; ``skip``: names the state may hold that the model does not load, e.g. a tied ``lm_head.weight``): a
    missing, unknown or misshapen weight is a `SamplingError` naming it, raised before anything is loaded."""
    state = {name: t for name, t in state_dict.items() if name not in skip}
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    misshapen = [f"{n} {tuple(state[n].shape)} (the engine's model has {tuple(expected[n])})"
                 for n in sorted(set(state) & set(expected)) if tuple(state[n].shape) != tuple(expected[n])]
    if unknown or missing or misshapen:
        parts = ([f"unknown {unknown[:5]}"] if unknown else []) + ([f"missing {missing[:5]}"] if missing else [])
        parts += [f"misshapen {misshapen[:3]}"] if misshapen else []
        raise SamplingError(f"these weights do not fit {model}: {'; '.join(parts)}; was this version made from "
                            "another model? (a worker's policy must be the learner's)")
    return state


def stop_reason(tokens: Sequence[int], params: SamplingParams, eos_token_id: int, *, cut: bool) -> str:
    """Why a completion ended: ``cut`` when it reached ``max_tokens`` without a stop token as its last."""
    last = tokens[-1] if tokens else None
    if cut or last is None:
        return STOP_LENGTH
    if last == eos_token_id and not params.ignore_eos:
        return STOP_EOS
    if last in params.stop_token_ids:
        return STOP_TOKEN
    return STOP_LENGTH


class SamplingEngine(ABC):
    """Generates completions from a fixed set of weights."""

    supports_inflight_updates = False  # generate takes ``updates`` (`WeightUpdates`) between decode steps
    supports_watch = False  # generate takes ``watch`` (`GenerationWatch`): tokens as they come, cancel between steps
    supports_prefix_reuse = False  # generate takes ``reuse_prefixes``: a prompt extending a context it generated
    # from earlier prefills only its new tokens (multi-turn episodes; vLLM's own prefix cache does this unasked)

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[list[SampleOutput]]:
        """For each prompt, ``num_samples`` completions (outer list: prompts)."""

    @abstractmethod
    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log p(token_t | tokens_<t) for t >= 1 of each sequence."""

    @abstractmethod
    def load_state_dict(self, state_dict) -> None:
        """Replace the engine's weights."""

    def close(self) -> None:  # noqa: B027 (optional: most engines hold nothing outside this process)
        """Release what the engine holds beyond this process's memory (vLLM's engine processes)."""
