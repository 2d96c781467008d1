"""Exception types raised by heterorl. Each names what is wrong and how to fix it."""


class HeteroRLError(Exception):
    """Base class of every error heterorl raises on purpose."""


class ConfigError(HeteroRLError, ValueError):
    """A configuration key is unknown, has the wrong type or an invalid value."""


class PolicyLoadError(HeteroRLError):
    """A policy (model + tokenizer) could not be loaded or does not fit together."""


class TaskError(HeteroRLError, ValueError):
    """A task is unknown, or its data (a JSONL row, a reward function path) is malformed."""


class SamplingError(HeteroRLError, ValueError):
    """Sampling was asked for with invalid parameters or inputs."""


class DelayConfigError(ConfigError):
    """A delay-injector setting (``delay.*``) or its trace file is invalid."""


class ClockError(HeteroRLError, ValueError):
    """A clock was built or driven wrongly (a non-positive scale factor, a virtual clock moved backwards)."""
