"""The learner's trajectory contract: what a trajectory that decodes must also satisfy to reach this learner's
model (versions, vocabulary, context, a log-prob floor, group size), checked on a whole batch's extremes and
naming every trajectory that breaks it (docs/RELIABILITY.md). The decoder checks that a frame is well formed;
this checks that it fits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from heterorl.errors import HeteroRLError
from heterorl.transport.protocol.trajectories import BatchExtremes, TrajectoryBatch

# The lowest behaviour log-prob a learner takes (`TrajectoryContract.min_logprob`). A sampler draws a token of
# log-prob below -50 with probability < V·e^-50 (< 2e-16 for a vocabulary of V = 10^6), so no honest value lies
# below it; and it keeps importance weights finite in float32: exp(log p − log q) ≤ e^50 ≈ 5e21 per token, and
# GEPO's group weight likewise (its log-denominator lies between the group's lowest and highest mean log q),
# where exp overflows past 88.7. A floor of -1e4 would not: exp(1e4) is inf.
MIN_LOGPROB = -50.0


@dataclass(frozen=True)
class Breach:
    """Trajectory ``index`` of a batch breaks its contract: ``reason`` is a short tag, ``message`` names the
    field, the value and the bound."""

    index: int
    reason: str
    message: str


@dataclass(frozen=True)
class TrajectoryContract:
    """What a trajectory must satisfy before it may reach the learner's model (docs/RELIABILITY.md). The
    decoder checks that a frame is well formed; this checks that it fits this learner:

    - ``policy_versions``: every entry in [0, newest version published] (`version_ahead`, `version_negative`);
    - ``prompt_tokens``, ``completion_tokens``: ids < ``vocab_size``, the rows of the model's input embedding
      (`token_out_of_vocab`);
    - prompt + completion ≤ ``max_sequence_len``, the model's context (`too_long`);
    - ``behaviour_logprobs`` ≥ ``min_logprob``, a floor that keeps the loss finite (`logprob_below_floor`;
      see `MIN_LOGPROB`);
    - ``group_size`` ≤ ``group_size`` (None: any), the completions sampled per prompt: a worker leaves out empty
      completions, so a group may be smaller, never larger (`group_too_large`).
    """

    vocab_size: int
    max_sequence_len: int
    min_logprob: float = MIN_LOGPROB
    group_size: int | None = None

    _SETTINGS: ClassVar[tuple[str, ...]] = ("vocab_size", "max_sequence_len", "min_logprob", "group_size")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_sequence_len", "group_size"):
            value = getattr(self, name)
            if name == "group_size" and value is None:
                continue  # any group size
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HeteroRLError(f"TrajectoryContract.{name} = {value!r}: must be a positive integer")
        if not (isinstance(self.min_logprob, (int, float)) and -math.inf < self.min_logprob < 0):
            raise HeteroRLError(f"TrajectoryContract.min_logprob = {self.min_logprob!r}: must be finite and < 0")

    def breaches(self, batch: TrajectoryBatch, newest_version: int) -> list[Breach]:
        """The trajectories of ``batch`` that break the contract, each with the first bound it breaks; [] when
        none does. The common case costs a few comparisons: the batch's extremes (reduced once, by the decoder
        for a received batch) are checked first, and each trajectory only when some bound fails."""
        if self._breach(batch.extremes(), newest_version) is None:
            return []
        found = []
        for index, traj in enumerate(batch.trajectories):
            breach = self._breach(BatchExtremes.of([traj]), newest_version)
            if breach is not None:
                found.append(Breach(index, *breach))
        return found

    def _breach(self, x: BatchExtremes, newest_version: int) -> tuple[str, str] | None:
        """(reason, message) of the first bound ``x`` breaks, or None."""
        if x.version_max > newest_version:
            return "version_ahead", (f"policy_versions holds version {x.version_max} > {newest_version}, the newest "
                                     "the learner has published")
        if x.version_min < 0:
            return "version_negative", f"policy_versions holds version {x.version_min} < 0"
        for name, top in (("prompt_tokens", x.prompt_token_max), ("completion_tokens", x.completion_token_max)):
            if top >= self.vocab_size:
                return "token_out_of_vocab", f"{name} holds token id {top} >= vocab_size {self.vocab_size}"
        if x.sequence_len_max > self.max_sequence_len:
            return "too_long", (f"prompt_tokens + completion_tokens = {x.sequence_len_max} tokens > max_sequence_len "
                                f"{self.max_sequence_len}")
        if x.logprob_min < self.min_logprob:
            return "logprob_below_floor", (f"behaviour_logprobs holds {x.logprob_min:g} < min_logprob "
                                           f"{self.min_logprob:g}")
        if self.group_size is not None and x.group_size_max > self.group_size:
            return "group_too_large", f"group_size {x.group_size_max} > {self.group_size} completions per prompt"
        return None

    def settings(self) -> dict[str, Any]:
        """The contract as ``ready`` settings (``contract.<field>``), so a worker can keep it."""
        return {f"contract.{name}": getattr(self, name) for name in self._SETTINGS}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> TrajectoryContract | None:
        """The contract a learner stated in its ``ready`` settings; None when it stated none."""
        if "contract.vocab_size" not in settings:
            return None
        return cls(**{name: settings.get(f"contract.{name}") for name in cls._SETTINGS})
