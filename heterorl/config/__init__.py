"""Typed run configuration: every section of a run's config and its validation, loaded from YAML with dotted
overrides. A leaf: it imports no other part of heterorl but its errors (and gepo, for the loss choices), so
every part can read it.

    cfg = load_config("my.yaml", ["loss.name=grpo", "rollout.temperature=0.7"])

Built on OmegaConf structured configs, so an unknown key or a value of the wrong type is an error that names
the full key. Every section validates itself the same way: ``section.validate(key)`` raises `ConfigError`
naming ``key.field``, its value and the fix; `Config.validate` runs each section's and then the checks that
span sections. Code that builds a section by hand (a `TransportConfig` for a test or a benchmark) calls its
``validate()`` where it is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from heterorl.config.checks import fail
from heterorl.config.cluster import ClusterConfig
from heterorl.config.learning import (
    LORA_TARGETS,
    SFT_BASE,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    PolicyConfig,
    RLConfig,
    RolloutConfig,
    SFTConfig,
    TaskConfig,
    TinyModelConfig,
)
from heterorl.config.scope import for_workers, learner_only
from heterorl.config.system import (
    BUFFER_POLICIES,
    DELAY_KINDS,
    ENGINES,
    BufferConfig,
    DelayConfig,
    LinkDelayConfig,
    RuntimeConfig,
    SimulateConfig,
    TransportConfig,
    load_trace,
    worker_command_word,
)
from heterorl.errors import ConfigError, HeteroRLError

log = logging.getLogger("heterorl.config")


def packaged(name: str) -> Path:
    """Path of a file shipped inside the package (configs/ or assets/)."""
    for folder in ("configs", "assets"):
        candidate = Path(str(resources.files("heterorl"))) / folder / name
        if candidate.exists():
            return candidate
    raise HeteroRLError(f"packaged file {name} is missing: reinstall heterorl")


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
    delay: DelayConfig = field(default_factory=DelayConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    cluster: ClusterConfig = learner_only(default_factory=ClusterConfig)  # on a cluster engine (docs/DEPLOY.md)

    def validate(self) -> None:
        """Every section's own checks, then those that span sections; raises ConfigError naming the key."""
        self._read_deprecated_keys()
        for name in self.__dataclass_fields__:
            section = getattr(self, name)
            if hasattr(section, "validate"):
                section.validate(name)
        if self.runtime.mode == "sync" and self.rl.prompts_per_step % self.runtime.workers:
            fail("rl.prompts_per_step", self.rl.prompts_per_step,
                  f"in sync mode it must be a multiple of `runtime.workers` = {self.runtime.workers} (each worker "
                  "makes an equal share)")
        if self.delay.fixed_lag_steps is not None and self.runtime.execution != "simulated":
            fail("delay.fixed_lag_steps", self.delay.fixed_lag_steps,
                  "needs `runtime.execution=simulated` (a live fleet's staleness follows its delays)")
        if self.transport.credits_per_worker < self.rollout.group_size:
            fail("transport.credits_per_worker", self.transport.credits_per_worker,
                  f"must be at least `rollout.group_size` = {self.rollout.group_size}: the learner holds a group's "
                  "members on the worker's credit until the group is complete")
        if self.lora.enabled and self.runtime.learner_sharding == "fsdp":
            fail("lora.rank", self.lora.rank, "a LoRA learner is not sharded: set runtime.learner_sharding=ddp "
                  "(the adapter and its optimizer state are small; the frozen base is all that is large)")
        if self.lora.enabled and (self.rl.base or self.policy.model) == "tiny":
            fail("lora.rank", self.lora.rank, "an adapter needs a base every worker loads bit for bit (a shipped "
                  "policy, smollm2 or a folder: rl.base or policy.model), not a fresh tiny model")
        if self.buffer.max_groups < self.rl.prompts_per_step:
            fail("buffer.max_groups", self.buffer.max_groups,
                  f"must hold at least one batch (`rl.prompts_per_step` = {self.rl.prompts_per_step})")


    def _read_deprecated_keys(self) -> None:
        """``buffer.partial_group_timeout_s`` (the transport enforces it) is read as ``transport.group_timeout_s``:
        a value set there only is copied, with a warning; two values set that differ are an error. The old key
        then mirrors the new one."""
        old, new = self.buffer.partial_group_timeout_s, self.transport.group_timeout_s
        default = TransportConfig.group_timeout_s
        if old != new and new != default and old != default:
            raise ConfigError(f"config keys `buffer.partial_group_timeout_s` = {old!r} (deprecated) and "
                              f"`transport.group_timeout_s` = {new!r} disagree: set only `transport.group_timeout_s`")
        if old != new and new == default:
            log.warning("config key `buffer.partial_group_timeout_s` is deprecated: its value %r is used as "
                        "`transport.group_timeout_s`; set that key instead", old)
            self.transport.group_timeout_s = old
        self.buffer.partial_group_timeout_s = self.transport.group_timeout_s


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    message = str(exc).split("\n")[0]
    if "not in" in message or "Key '" in message and "not" in message:
        hint = "unknown key: check its spelling against `heterorl <command> --dry-run`"
    else:
        hint = message
    return ConfigError(f"config key `{key}` ({source}): {hint}")


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
    cfg.validate()
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_worker_dict(cfg: Config) -> dict:
    """The run config as its rollout workers receive it: `to_dict` less the keys whose fields keep them from the
    workers (`heterorl.config.scope`: the learner's own, and new keys left at their defaults)."""
    return for_workers(cfg, to_dict(cfg))


__all__ = ["BUFFER_POLICIES", "DELAY_KINDS", "ENGINES", "LORA_TARGETS", "SFT_BASE", "BufferConfig", "ClusterConfig",
           "Config", "ConfigError", "DelayConfig", "LinkDelayConfig", "LoggingConfig", "LoraConfig", "LossConfig",
           "OptimConfig", "PolicyConfig", "RLConfig", "RolloutConfig", "RuntimeConfig", "SFTConfig", "SimulateConfig",
           "TaskConfig", "TinyModelConfig", "TransportConfig", "load_config", "load_trace", "packaged", "to_dict",
           "to_worker_dict", "to_yaml", "worker_command_word"]
