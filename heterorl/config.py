"""Typed run configuration: dataclasses, loaded from YAML with dotted overrides.

    cfg = load_config("my.yaml", ["loss.name=grpo", "rollout.temperature=0.7"])

Built on OmegaConf structured configs, so an unknown key or a value of the
wrong type is an error that names the full key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import gepo
from heterorl.buffer import BufferConfig
from heterorl.delay import DelayConfig
from heterorl.errors import ConfigError
from heterorl.policies.tiny import TinyModelConfig
from heterorl.transport import TransportConfig


@dataclass
class TaskConfig:
    name: str = "maze"  # maze | arithmetic | jsonl
    options: Dict[str, Any] = field(default_factory=dict)  # fields of the task's config dataclass
    reward_fn: Optional[str] = None  # "my_pkg.rewards:score" replaces the task's reward


@dataclass
class PolicyConfig:
    model: str = "tiny"  # tiny | smollm2 | path to a local Hugging Face folder
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    device: str = "cpu"


@dataclass
class RolloutConfig:
    group_size: int = 8  # completions per prompt
    temperature: float = 1.0  # the learner scores log-probs at the same temperature (0: greedy, scored at 1)
    top_p: float = 1.0  # truncation the learner cannot reproduce: importance weights then drift from 1
    top_k: int = 0
    max_tokens: int = 32


@dataclass
class LossConfig:
    name: str = "grpo"
    # auto = the loss's own default estimator (its config's `advantage`); a name overrides it
    advantage: str = "auto"  # auto | group_normalized | group_centered | bnpo
    options: Dict[str, Any] = field(default_factory=dict)  # fields of the loss's own config dataclass


@dataclass
class OptimConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio


@dataclass
class SFTConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    eval_every: int = 100
    stop_success: Optional[float] = None  # stop as soon as greedy eval success reaches this
    output: str = "runs/sft-base"


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


@dataclass
class DelaysConfig:
    """The network-delay injector, per worker link (docs/DELAY.md)."""

    up: DelayConfig = field(default_factory=DelayConfig)  # trajectories, worker → learner
    down: DelayConfig = field(default_factory=DelayConfig)  # weights, learner → worker
    time_scale: float = 1.0  # simulated seconds per real second: 100 lets 1,800 s of delay pass in 18 s
    seconds_per_step: Optional[float] = None  # stated mapping of seconds to learner steps, for reports


@dataclass
class RuntimeConfig:
    """The learner + rollout workers system (`heterorl train`, `heterorl learner`, `heterorl rollout`)."""

    mode: str = "async"  # async: workers never wait for new weights | sync: each batch uses the newest version
    # live: real processes over ZeroMQ | simulated: one process on a virtual clock (heterorl/simulate.py)
    execution: str = "live"
    workers: int = 2  # rollout worker processes `heterorl train` starts
    address: str = "tcp://127.0.0.1:0"  # learner control address (weights on port + 1); port 0 = pick free ports
    groups_per_call: int = 4  # groups a worker samples per engine call
    throttle: List[float] = field(default_factory=list)  # slowdown factor of worker i = throttle[i % len]; 1 = full
    threads: int = 1  # torch threads per learner / worker / simulated process (`sft` and `rl` use torch's default)
    learner_ranks: int = 1  # > 1: `heterorl train` runs the learner under torchrun as this many DDP ranks
    checkpoint_every: int = 25  # learner steps between checkpoints (0: only at the end)
    worker_timeout_s: float = 300.0  # learner fails if no data arrives and no worker is alive for this long
    # before its first step the learner waits up to this long for `workers` workers to hold its weights, so
    # a run does not start on whichever worker loaded its model first (0: start on the first data)
    fleet_wait_s: float = 120.0
    learner_timeout_s: float = 300.0  # a worker exits if the learner stays silent this long


@dataclass
class SimulateConfig:
    """Virtual durations of the simulated execution (``runtime.execution=simulated``; docs/EXPERIMENTS.md)."""

    step_s: Optional[float] = None  # virtual seconds per learner step; None: delay.seconds_per_step, else 1.0
    # virtual seconds of one worker engine call (runtime.groups_per_call groups) at throttle 1; None: the fleet
    # makes exactly one batch per learner step (step_s · workers · groups_per_call / prompts_per_step)
    call_s: Optional[float] = None


@dataclass
class LoggingConfig:
    run_dir: str = "runs/demo"
    wandb_project: Optional[str] = None  # None: log to an offline wandb run in run_dir
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_group: Optional[str] = None  # runs of one sweep share a group
    progress: bool = True
    save_policy: bool = True  # save the trained policy folder in the run dir at the end


@dataclass
class Config:
    seed: int = 0
    task: TaskConfig = field(default_factory=TaskConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    delay: DelaysConfig = field(default_factory=DelaysConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)


_CHOICES = {
    "loss.advantage": ("auto", *gepo.ADVANTAGE_ESTIMATORS),
    "optim.schedule": ("constant", "cosine"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "runtime.mode": ("async", "sync"),
    "runtime.execution": ("live", "simulated"),
}


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    message = str(exc).split("\n")[0]
    if "not in" in message or "Key '" in message and "not" in message:
        hint = "unknown key: check its spelling against `heterorl <command> --dry-run`"
    else:
        hint = message
    return ConfigError(f"config key `{key}` ({source}): {hint}")


def _check(cfg: Config) -> None:
    for dotted, choices in _CHOICES.items():
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"config key `{dotted}` = {value!r}: must be one of {', '.join(choices)}")
    positive = {
        "rollout.group_size": cfg.rollout.group_size, "rollout.max_tokens": cfg.rollout.max_tokens,
        "rl.steps": cfg.rl.steps, "rl.prompts_per_step": cfg.rl.prompts_per_step,
        "rl.updates_per_batch": cfg.rl.updates_per_batch, "rl.eval_every": cfg.rl.eval_every,
        "sft.steps": cfg.sft.steps, "sft.batch_size": cfg.sft.batch_size, "sft.eval_every": cfg.sft.eval_every,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key `{key}` = {value}: must be > 0")
    chosen = cfg.loss.options.get("advantage")
    if cfg.loss.advantage != "auto" and chosen is not None and chosen != cfg.loss.advantage:
        raise ConfigError(f"config keys `loss.advantage` = {cfg.loss.advantage!r} and `loss.options.advantage` = "
                          f"{chosen!r} disagree: set only one")
    if cfg.rollout.temperature < 0:
        raise ConfigError(f"config key `rollout.temperature` = {cfg.rollout.temperature}: must be >= 0")
    if cfg.optim.lr <= 0 or cfg.sft.lr <= 0:
        raise ConfigError("config keys `optim.lr` and `sft.lr` must be > 0")
    runtime = {"runtime.workers": cfg.runtime.workers, "runtime.groups_per_call": cfg.runtime.groups_per_call,
               "runtime.threads": cfg.runtime.threads, "runtime.learner_ranks": cfg.runtime.learner_ranks,
               "delay.time_scale": cfg.delay.time_scale}
    for key, value in runtime.items():
        if value <= 0:
            raise ConfigError(f"config key `{key}` = {value}: must be > 0")
    if any(f < 1 for f in cfg.runtime.throttle):
        raise ConfigError(f"config key `runtime.throttle` = {cfg.runtime.throttle}: factors must be >= 1 "
                          "(2 = a device half as fast)")
    if cfg.runtime.mode == "sync" and cfg.rl.prompts_per_step % cfg.runtime.workers:
        raise ConfigError(f"config key `rl.prompts_per_step` = {cfg.rl.prompts_per_step}: in sync mode it must be "
                          f"a multiple of `runtime.workers` = {cfg.runtime.workers} (each worker makes an equal share)")
    cfg.buffer.validate("buffer")
    if cfg.buffer.max_groups < cfg.rl.prompts_per_step:
        raise ConfigError(f"config key `buffer.max_groups` = {cfg.buffer.max_groups}: must hold at least one batch "
                          f"(`rl.prompts_per_step` = {cfg.rl.prompts_per_step})")
    for key, value in (("simulate.step_s", cfg.simulate.step_s), ("simulate.call_s", cfg.simulate.call_s),
                       ("delay.seconds_per_step", cfg.delay.seconds_per_step)):
        if value is not None and not value > 0:
            raise ConfigError(f"config key `{key}` = {value}: must be > 0 (or null for the default)")
    cfg.delay.up.validate("delay.up")
    cfg.delay.down.validate("delay.down")


def loss_options(cfg: Config) -> dict:
    """The options of the loss's config dataclass, with ``loss.advantage`` applied unless it is "auto"."""
    options = dict(cfg.loss.options)
    if cfg.loss.advantage != "auto":
        options["advantage"] = cfg.loss.advantage
    return options


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), text: str | None = None) -> Config:
    """Defaults ← YAML file (or YAML ``text``) ← ``key=value`` overrides, validated into a ``Config``."""
    merged = OmegaConf.structured(Config)
    try:
        if text is not None:
            merged = OmegaConf.merge(merged, OmegaConf.create(text))
        elif path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise _explain(exc, str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path or '(text)'} is not valid YAML: {' '.join(str(exc).split())}") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. loss.name=gepo)")
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, "command line") from None
    _check(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


__all__ = ["Config", "ConfigError", "load_config", "loss_options", "to_dict", "to_yaml"]
