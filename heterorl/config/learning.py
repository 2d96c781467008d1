"""The config sections of what is learned and how: the task, the policy and its tiny model, LoRA, rollouts, the loss,
the optimizer, SFT, RL and logging."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import gepo
from heterorl.config.checks import fail, one_of, optional_positive, positive
from heterorl.config.scope import learner_only, sent_when_set
from heterorl.errors import ConfigError

SFT_BASE = "maze-sft-base"  # the shipped SFT base of the 5x5 maze (heterorl/assets/)


@dataclass
class TinyModelConfig:
    """Shape of the tiny Qwen2-style model (defaults: ~1.6M parameters)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 256
    rope_theta: float = 10000.0
    seed: int = 0


@dataclass
class TaskConfig:
    name: str = "maze"  # maze | arithmetic | jsonl | code | reasoning_gym | verifiers (`heterorl tasks`)
    options: Dict[str, Any] = field(default_factory=dict)  # fields of the task's config dataclass
    # "my_pkg.rewards:score" replaces the task's reward; several, comma-separated, are summed with reward_weights
    reward_fn: Optional[str] = None
    reward_weights: Optional[List[float]] = None  # one per reward_fn (default: 1 each), as TRL's reward_weights
    # render each prompt as a user message with the tokenizer's chat template (chat models), everywhere prompts
    # are encoded; false: the prompt text with the tokenizer's own special tokens
    chat_template: bool = False
    # a reward_fn call that has not returned after this long is an error that stops the run (it runs in a
    # helper thread for this); null: no limit, and the call runs in the caller's thread (a function that uses
    # signals needs that)
    reward_timeout_s: Optional[float] = 60.0

    def validate(self, key: str = "task") -> None:
        if self.reward_weights is not None:
            count = len(self.reward_fn.split(",")) if self.reward_fn else 0
            if len(self.reward_weights) != count:
                fail(f"{key}.reward_weights", list(self.reward_weights),
                      f"give one weight per reward function ({count} in {key}.reward_fn)")
        timeout = self.reward_timeout_s
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            fail(f"{key}.reward_timeout_s", timeout, "must be a finite number of seconds > 0, or null for no limit")


@dataclass
class PolicyConfig:
    model: str = "tiny"  # tiny | smollm2 | path to a local Hugging Face folder
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    device: str = "cpu"
    # the learner's memory (heterorl/training/precision.py): recompute each layer's activations in the backward,
    # and run its forward and backward in bfloat16 under autocast (weights and Adam's state stay float32)
    activation_checkpointing: bool = False
    train_dtype: str = "float32"  # float32 | bfloat16

    def validate(self, key: str = "policy") -> None:
        one_of(f"{key}.train_dtype", self.train_dtype, ("float32", "bfloat16"))


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a Llama's linears


@dataclass
class LoraConfig:
    """Train a low-rank adapter instead of the whole model (``rank`` > 0; heterorl.training.lora): the base
    stays frozen, and each version the learner publishes is the adapter alone (``publish: adapter``) or the
    merged weights (``merged``). ``target_modules``: names (last part) of the linear layers to adapt. ``apply``:
    how a torch worker uses an adapter version: ``merged`` into its weights (as fast to sample as the base) or
    kept ``unmerged`` beside them (no merge per version, a few more matmuls per token)."""

    rank: int = 0  # 0: off (full fine-tuning)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    publish: str = "adapter"  # adapter | merged
    apply: str = "merged"  # merged | unmerged

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, key: str = "lora") -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            fail(f"{key}.rank", self.rank, "must be an integer >= 0 (0: train the whole model)")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            fail(f"{key}.alpha", self.alpha, "must be a finite number > 0 (the update is scaled by alpha / rank)")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            fail(f"{key}.dropout", self.dropout, "must be in [0, 1)")
        names = list(self.target_modules)
        if self.enabled and (not names or not all(isinstance(n, str) and n for n in names)):
            fail(f"{key}.target_modules", names, "must name at least one linear layer (e.g. q_proj, v_proj)")
        one_of(f"{key}.publish", self.publish, ("adapter", "merged"))
        one_of(f"{key}.apply", self.apply, ("merged", "unmerged"))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": float(self.alpha), "dropout": float(self.dropout),
                "target_modules": sorted(self.target_modules)}


@dataclass
class RolloutConfig:
    group_size: int = 8  # completions per prompt
    temperature: float = 1.0  # the learner scores log-probs at the same temperature (0: greedy, scored at 1)
    top_p: float = 1.0  # truncation the learner cannot reproduce: importance weights then drift from 1
    top_k: int = 0
    max_tokens: int = 32  # per generation: a multi-turn task's per policy turn
    # multi-turn tasks (tasks/environment.py, docs/ENVIRONMENTS.md): at most max_turns policy turns an episode; its
    # completion, the environment's answers included, at most max_episode_tokens (null: what the context
    # leaves); an environment call that has not returned after env_step_timeout_s ends its episode with reward 0
    max_turns: int = sent_when_set(16)
    max_episode_tokens: Optional[int] = sent_when_set(None)
    env_step_timeout_s: Optional[float] = sent_when_set(30.0)

    def validate(self, key: str = "rollout") -> None:
        positive(self, key, "group_size", "max_tokens", "max_turns")
        if self.temperature < 0:
            fail(f"{key}.temperature", self.temperature, "must be >= 0")
        optional_positive(self, key, "max_episode_tokens")
        timeout = self.env_step_timeout_s
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            fail(f"{key}.env_step_timeout_s", timeout, "must be a finite number of seconds > 0, or null for no limit")


@dataclass
class LossConfig:
    name: str = "grpo"
    # auto = the loss's own default estimator (its config's `advantage`); a name overrides it
    advantage: str = "auto"  # auto | group_normalized | group_centered | bnpo
    options: Dict[str, Any] = field(default_factory=dict)  # fields of the loss's own config dataclass

    def validate(self, key: str = "loss") -> None:
        """The loss is a registered one and its options build its config, checked when the config loads (a typo
        is refused before any process starts, not at the learner's first step)."""
        if self.name not in gepo.loss_names():
            fail(f"{key}.name", self.name, f"is not a registered loss: choose one of {', '.join(gepo.loss_names())} "
                  "(a loss of your own is registered with gepo.register_loss before the config loads)")
        one_of(f"{key}.advantage", self.advantage, ("auto", *gepo.ADVANTAGE_NAMES))
        chosen = self.options.get("advantage")
        if self.advantage != "auto" and chosen is not None and chosen != self.advantage:
            raise ConfigError(f"config keys `{key}.advantage` = {self.advantage!r} and `{key}.options.advantage` = "
                              f"{chosen!r} disagree: set only one")
        try:
            gepo.make_loss_config(self.name, self.resolved_options())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config key `{key}.options` = {dict(self.options)!r}: {exc}") from None

    def resolved_options(self) -> dict:
        """The options of the loss's config dataclass, with ``advantage`` applied unless it is "auto"."""
        options = dict(self.options)
        if self.advantage != "auto":
            options["advantage"] = self.advantage
        return options


@dataclass
class OptimConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear (both decay to lr * min_lr_ratio at the last step)
    min_lr_ratio: float = 0.1  # cosine and linear decay to lr * min_lr_ratio (TRL's linear: 0)
    # the learner runs the model on micro-batches of at most this many tokens, the same gradient (one more forward
    # without gradients: heterorl/training/microbatches.py); its memory is then set by this number. 0: all at once
    tokens_per_microbatch: int = 0

    def validate(self, key: str = "optim") -> None:
        one_of(f"{key}.schedule", self.schedule, ("constant", "cosine", "linear"))
        positive(self, key, "lr")
        if self.tokens_per_microbatch < 0:
            fail(f"{key}.tokens_per_microbatch", self.tokens_per_microbatch,
                 "must be 0 (the whole minibatch at once) or a number of tokens > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail(f"{key}.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1] (the fraction of lr the decay ends at)")


@dataclass
class SFTConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    eval_every: int = 100
    stop_success: Optional[float] = None  # stop as soon as greedy eval success reaches this
    output: str = "runs/sft-base"

    def validate(self, key: str = "sft") -> None:
        positive(self, key, "steps", "batch_size", "eval_every", "lr")


@dataclass
class RLConfig:
    base: Optional[str] = None  # policy folder to start from (the SFT base); None = policy.model
    steps: int = 100
    prompts_per_step: int = 32
    updates_per_batch: int = 1  # optimizer steps on each sampled batch (minibatches)
    # train only on groups whose rewards differ (DAPO's dynamic-sampling filter, without re-sampling): a group
    # that scored alike has zero group-relative advantage, so this saves its compute, and the loss's mean over
    # sequences then runs over the groups that carry signal
    drop_uniform_groups: bool = False
    eval_every: int = 10
    eval_max_tokens: Optional[int] = None  # None = rollout.max_tokens
    # bounds on one group's weight in an update (docs/RELIABILITY.md, "Bounds on one group"): a group with a token
    # whose |log p − log q| exceeds max_log_ratio, or a reward with |r| > max_abs_reward, is dropped before the
    # loss and counted (optim/dropped_groups); null: no bound
    max_log_ratio: Optional[float] = learner_only(10.0)
    max_abs_reward: Optional[float] = learner_only(10.0)
    # a group whose effective importance weight (its gradient's coefficient mass over the same group's on the
    # behaviour policy's log-probs) exceeds this has its gradient scaled down to it (optim/capped_groups); null: no cap
    max_group_weight: Optional[float] = learner_only(32.0)

    def validate(self, key: str = "rl") -> None:
        positive(self, key, "steps", "prompts_per_step", "updates_per_batch", "eval_every")
        if self.max_group_weight is not None and not self.max_group_weight >= 1:
            fail(f"{key}.max_group_weight", self.max_group_weight, "must be >= 1 (an on-policy group's weight is 1), "
                 "or null for no cap")
        for name in ("max_log_ratio", "max_abs_reward"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                fail(f"{key}.{name}", getattr(self, name), "must be > 0, or null for no bound")


@dataclass
class LoggingConfig:
    run_dir: str = "runs/demo"
    wandb_project: Optional[str] = None  # None: log to an offline wandb run in run_dir
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_group: Optional[str] = None  # runs of one sweep share a group
    progress: bool = True
    save_policy: bool = True  # save the trained policy folder in the run dir at the end
    # the live learner writes RUN_DIR/groups.jsonl: a line per group trained (its worker, versions, and when it
    # was generated, arrived and trained); `heterorl bench elastic` reads it
    group_log: bool = False

    def validate(self, key: str = "logging") -> None:
        one_of(f"{key}.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
