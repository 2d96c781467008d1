"""The losses' config dataclasses, the built-in losses' names and the advantage estimators' names, without torch:
a run's config is checked against them (`heterorl.config`) by processes that never compute a loss (``heterorl
train``'s launcher, ``heterorl tasks``, a refused command line), so importing them costs no torch. The losses
themselves are in gepo.losses and gepo.trust_region_losses; the estimators in gepo.advantages.
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


# ---------------------------------------------------------------------------- trust-region losses of 2026
# (gepo.trust_region_losses; the defaults are those of each loss's authors, with where they were read)


@dataclass
class DPPOTVConfig(RLLossConfig):
    """DPPO-Binary-TV (Qi et al. 2026, arXiv 2602.04879): the authors' verl script (verl
    examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh) runs δ_low = δ_high = 0.15, a ratio cap of 1e4 and
    group-centred advantages (``norm_adv_by_std_in_grpo=False``). prime-rl's default loss is this mask at 0.2/0.2,
    uncapped, plus a squared-log-ratio KL term (weight 1e-3) that gepo does not include."""

    delta_low: float = 0.15  # mask a token with A < 0 once p − q < −δ_low
    delta_high: float = 0.15  # mask a token with A > 0 once p − q > δ_high
    ratio_cap: float = 1e4  # C of sg(min(r, C)); the authors' code defaults to 10, their published run to 1e4
    advantage: str = "group_centered"

    def __post_init__(self):
        super().__post_init__()
        if self.ratio_cap <= 0:
            raise ValueError(f"ratio_cap={self.ratio_cap}: must be > 0 (the largest importance weight kept)")


@dataclass
class DPPOKLConfig(DPPOTVConfig):
    """DPPO-Binary-KL: as DPPO-Binary-TV, with the binary KL's threshold δ = 0.05 of the authors' verl script."""

    delta_low: float = 0.05  # mask a token with A < 0 once p < q and KL_bin(q‖p) > δ_low
    delta_high: float = 0.05  # mask a token with A > 0 once p > q and KL_bin(q‖p) > δ_high


@dataclass
class VESPOConfig(RLLossConfig):
    """VESPO (Shen et al. 2026, arXiv 2602.10693): the gamma kernel's (k, λ) = (2, 3) for A ≥ 0 and (3, 2) for
    A < 0, as in the authors' run scripts (FloyedShen/VESPO recipe/vespo/run/, every staleness N) and TRL's
    GRPOConfig (``vespo_k_pos`` ...); GRPO's group-normalised advantages (their scripts: ``adv_estimator=grpo``)."""

    k_pos: float = 2.0  # the power k of φ(w) = w^k·e^{λ(1−w)} for A ≥ 0: how fast φ falls as w → 0
    lambda_pos: float = 3.0  # its decay λ for A ≥ 0: how fast φ falls as w grows past k/λ
    k_neg: float = 3.0  # k for A < 0
    lambda_neg: float = 2.0  # λ for A < 0
    advantage: str = "group_normalized"

    def __post_init__(self):
        super().__post_init__()
        for name in ("lambda_pos", "lambda_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (with λ = 0, φ(w) = w^k is unbounded)")


@dataclass
class SAPOConfig(RLLossConfig):
    """SAPO (Qwen team 2025, arXiv 2511.20347): temperatures τ_pos = 1.0, τ_neg = 1.05, the paper's
    recommendation as verl, TRL, AReaL, ms-swift and Trinity-RFT all default to; GRPO's advantages."""

    tau_pos: float = 1.0  # gate temperature for A > 0
    tau_neg: float = 1.05  # gate temperature for A ≤ 0 (larger: off-policy negative updates fade faster)
    advantage: str = "group_normalized"

    def __post_init__(self):
        super().__post_init__()
        for name in ("tau_pos", "tau_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (the gate is (4/τ)·σ(τ·(r − 1)))")


@dataclass
class TRMConfig(GRPOConfig):
    """Trust Region Masking (Li et al. 2025, arXiv 2512.23075) over GRPO's clipped surrogate (clip ε = 0.2, token
    mean). The paper's criterion is the largest token KL of a sequence; from sampled tokens alone its authors
    detect it with a symmetric per-token statistic (verl PR #4544, by the first author), here ½(log r)², verl's
    ``seq_max_k2`` at its documented threshold 2.5. Their average criterion, mean k3 (verl's TRM presets: 0.01), is
    off unless set. The paper's own thresholds could not be read here (no arXiv access)."""

    max_divergence: float | None = 2.5  # mask a sequence whose max_t ½(log r_t)² exceeds this; None: no max test
    mean_divergence: float | None = None  # mask one whose mean_t (r_t − 1 − log r_t) exceeds this; None: no test


# the built-in losses (registered by gepo.losses and gepo.trust_region_losses) and their configs: their names are
# known before torch is imported
BUILTIN_LOSS_CONFIGS: dict[str, type] = {
    "cross_entropy": CrossEntropyConfig, "importance_sampling": ImportanceSamplingConfig, "grpo": GRPOConfig,
    "opsm": OPSMConfig, "dapo": DAPOConfig, "dr_grpo": DrGRPOConfig, "bnpo": BNPOConfig,
    "decoupled_ppo": DecoupledPPOConfig, "tis": TISConfig, "icepop": IcePopConfig, "m2po": M2POConfig,
    "cispo": CISPOConfig, "gspo": GSPOConfig, "gepo": GEPOConfig, "gepo_defensive": GEPODefensiveConfig,
    "dppo_tv": DPPOTVConfig, "dppo_kl": DPPOKLConfig, "vespo": VESPOConfig, "sapo": SAPOConfig, "trm": TRMConfig,
}
