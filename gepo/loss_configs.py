"""The losses' config dataclasses, the built-in losses' names and the advantage estimators' names, without torch:
a run's config is checked against them (`heterorl.config`) by processes that never compute a loss (``heterorl
train``'s launcher, ``heterorl tasks``, a refused command line), so importing them costs no torch. The losses
themselves are in gepo.losses; the estimators in gepo.advantages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

# the estimators of gepo.advantages by name (gepo.advantages.ADVANTAGE_ESTIMATORS maps these to functions)
ADVANTAGE_NAMES = ("group_centered", "group_normalized", "bnpo", "raw_reward")
ADVANTAGE_CHOICES = (*ADVANTAGE_NAMES, "given")


def check_advantage_name(name: str) -> None:
    if name not in ADVANTAGE_CHOICES:
        raise ValueError(f"advantage={name!r} is not an estimator; choose one of {', '.join(ADVANTAGE_CHOICES)}")


@dataclass
class RLLossConfig:
    """Fields every RL loss's config has. Subclasses override the defaults with their paper's.

    advantage: an estimator of gepo.advantages ("group_centered", "group_normalized", "bnpo"),
               computed from batch.rewards by group, or "given" to use batch.advantages as they are.
    """

    advantage: str = "group_normalized"
    choices: ClassVar[dict[str, tuple]] = {}

    def __post_init__(self):
        check_advantage_name(self.advantage)
        for name, allowed in self.choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(map(repr, allowed))}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{f.name}={value}: must be >= 0")


@dataclass
class CrossEntropyConfig:
    """No options: supervised next-token loss."""


@dataclass
class ImportanceSamplingConfig(RLLossConfig):
    """The plain (unclipped) importance-sampling policy gradient; advantages as given by default."""

    advantage: str = "given"


@dataclass
class GRPOConfig(RLLossConfig):
    """GRPO's defaults: clip ε = 0.2, group-normalised advantages."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # asymmetric clip (DAPO "clip-higher", arXiv 2503.14476); None = clip_eps
    advantage: str = "group_normalized"


@dataclass
class OPSMConfig(GRPOConfig):
    """GRPO's clip and advantages plus off-policy sequence masking at δ = 1e-4 (slime's default; the paper does
    not publish its δ)."""

    delta: float = 1e-4


@dataclass
class DAPOConfig(GRPOConfig):
    """DAPO's token-level loss with GRPO's clip (TRL's ``loss_type="dapo"``: ε = ε_high = 0.2 unless set; the DAPO
    paper's clip-higher is ``clip_eps_high=0.28``), group-normalised advantages."""


@dataclass
class DrGRPOConfig(RLLossConfig):
    """Dr.GRPO's defaults: clip ε = 0.2, no std division; the normaliser is B · max_completion_len."""

    clip_eps: float = 0.2
    max_completion_len: int | None = None  # the generation budget; None = the batch's padded length T
    advantage: str = "group_centered"


@dataclass
class BNPOConfig(RLLossConfig):
    """BNPO as the GEPO authors ran it: clip ε = 0.2, Beta-re-weighted advantages, token-sum / token-count."""

    clip_eps: float = 0.2
    advantage: str = "bnpo"


@dataclass
class DecoupledPPOConfig(RLLossConfig):
    """AReaL's decoupled PPO: clip ε = 0.2 against the proximal policy; optional behaviour-weight cap."""

    clip_eps: float = 0.2
    behaviour_weight_cap: float | None = None  # drop tokens with π_prox/μ above this (AReaL's behav_imp_weight_cap)
    advantage: str = "group_normalized"


@dataclass
class TISConfig(RLLossConfig):
    """Truncated importance sampling: cap C = 2, per token or per sequence."""

    level: str = "token"  # "token": cap r_it; "sequence": cap ρ_i = Π_t r_it
    cap: float = 2.0
    advantage: str = "group_normalized"
    choices: ClassVar[dict[str, tuple]] = {"level": ("token", "sequence")}


@dataclass
class IcePopConfig(RLLossConfig):
    """IcePop's token mask: keep r in [0.5, 5]."""

    ratio_low: float = 0.5
    ratio_high: float = 5.0
    advantage: str = "group_normalized"


@dataclass
class M2POConfig(RLLossConfig):
    """M2PO: second-moment trust region τ = 0.04, no clip."""

    m2_threshold: float = 0.04
    advantage: str = "group_normalized"


@dataclass
class CISPOConfig(RLLossConfig):
    """CISPO's defaults: no lower bound on the weight (1 − ε_low = 0); upper bound 1 + ε_high = 4.

    MiniMax-M1 sets ε_low large and tunes ε_high without publishing its value; the cap of 4 is
    Tinker's CISPO default. Both are fields: override them to match another run.
    """

    clip_eps_low: float = 1.0
    clip_eps_high: float = 3.0
    advantage: str = "group_normalized"


@dataclass
class GSPOConfig(RLLossConfig):
    """GSPO's defaults: sequence-ratio clip ε_low = 3e-4, ε_high = 4e-4 (the GEPO paper ran 0.2)."""

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    advantage: str = "group_normalized"


@dataclass
class GEPOConfig(RLLossConfig):
    """GEPO's defaults: clip ε = 0.2, group-centred advantages, groups = prompts, no KL term."""

    clip_eps: float = 0.2
    group_by: str = "prompt"  # "prompt": the paper's G rows of one prompt; "batch": the whole batch (authors' code)
    kl_beta: float = 0.0  # learner↔sampler KL weight; 0.005 in the paper's heterogeneous runs
    advantage: str = "group_centered"
    choices: ClassVar[dict[str, tuple]] = {"group_by": ("prompt", "batch")}


@dataclass
class GEPODefensiveConfig(GEPOConfig):
    """GEPO's defaults plus the defensive switch's KL threshold 0.002."""

    kl_threshold: float = 0.002


# the built-in losses (registered by gepo.losses) and their configs: their names are known before torch is imported
BUILTIN_LOSS_CONFIGS: dict[str, type] = {
    "cross_entropy": CrossEntropyConfig, "importance_sampling": ImportanceSamplingConfig, "grpo": GRPOConfig,
    "opsm": OPSMConfig, "dapo": DAPOConfig, "dr_grpo": DrGRPOConfig, "bnpo": BNPOConfig,
    "decoupled_ppo": DecoupledPPOConfig, "tis": TISConfig, "icepop": IcePopConfig, "m2po": M2POConfig,
    "cispo": CISPOConfig, "gspo": GSPOConfig, "gepo": GEPOConfig, "gepo_defensive": GEPODefensiveConfig,
}
