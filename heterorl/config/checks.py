"""The checks every config section runs in its ``validate(key)``: each raises `ConfigError` naming the full key,
its value and what it must be."""

from __future__ import annotations

from typing import Any, Sequence

from heterorl.errors import ConfigError


def fail(key: str, value: Any, requirement: str) -> None:
    raise ConfigError(f"config key `{key}` = {value!r}: {requirement}")


def one_of(key: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        fail(key, value, f"must be one of {', '.join(choices)}")


def positive(section: Any, key: str, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            fail(f"{key}.{name}", getattr(section, name), "must be > 0")


def optional_positive(section: Any, key: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:
            fail(f"{key}.{name}", value, "must be > 0 (or null for the default)")
