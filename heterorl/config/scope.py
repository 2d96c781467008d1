"""Which of a run's config keys its rollout workers receive, declared on each key's field.

The learner sends its workers the whole run config in ``ready`` (`heterorl.runtime.learner.learner_settings`),
so a fleet cannot drift apart from its learner. Every key is sent unless its field says otherwise:

    group_deadline_min_s: float = learner_only(5.0)     # stays with the learner
    max_turns: int = sent_when_set(16)                  # sent only when it differs from its default

- `learner_only`: a key of the learner's (its admission, group deadlines, throttling, weights serving, the bounds
  on what it trains) or of a launcher's (worker restarts, the ``cluster`` section). A worker has no use for it, and
  a worker of the previous release, which refuses a config naming a key it does not know, could not join.
- `sent_when_set`: a key workers read that is new in this release: at its default it stays home, so that workers
  of the previous release still join a run that does not use it; set, it is sent (a run that needs it needs
  workers that read it).

`for_workers` derives what is sent from these declarations.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from dataclasses import field as dataclass_field
from typing import Any

SCOPE = "heterorl.config.scope"  # the key of a field's metadata that holds its scope
LEARNER_ONLY = "learner_only"
SENT_WHEN_SET = "sent_when_set"


def learner_only(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A field the learner keeps: never sent to its workers."""
    return dataclass_field(default=default, default_factory=default_factory, metadata={SCOPE: LEARNER_ONLY})


def sent_when_set(default: Any) -> Any:
    """A field sent to the workers only when its value differs from ``default``."""
    return dataclass_field(default=default, metadata={SCOPE: SENT_WHEN_SET})


def for_workers(section: Any, data: dict) -> dict:
    """``data`` (the dict of a config ``section``, as `heterorl.config.to_dict` makes it) without the keys its
    fields keep from the workers, in every nested section; returns ``data``, changed in place."""
    for f in fields(section):
        scope, value = f.metadata.get(SCOPE), getattr(section, f.name)
        if scope == LEARNER_ONLY or (scope == SENT_WHEN_SET and value == f.default):
            del data[f.name]
        elif is_dataclass(value):
            for_workers(value, data[f.name])
    return data


__all__ = ["LEARNER_ONLY", "SENT_WHEN_SET", "for_workers", "learner_only", "sent_when_set"]
