"""Where the environment's tokens lie in a multi-turn completion, and which tokens are the policy's.

A multi-turn trajectory is one token array: the prompt (the first observation), then the policy's turns and the
environment's answers, back to back. ``env_spans`` marks the environment's tokens as half-open ranges of
completion positions, flattened: ``(s0, e0, s1, e1, ...)`` with ``0 < s0 < e0 < s1 < e1 < ... <= len``. The
completion starts with the policy's first turn (``s0 > 0``) and two answers never touch (a policy turn lies
between), so every trajectory has a policy token and each tuple of spans has one meaning. An empty tuple is a
single-turn trajectory: every completion token is the policy's.
"""

from __future__ import annotations

import numpy as np

MAX_ENV_SPANS = 1024  # environment answers in one trajectory (the wire's bound: 2,048 integers)


def env_spans_problem(spans, length: int) -> str | None:
    """Why ``spans`` is not a valid tuple of environment spans for a completion of ``length`` tokens; None when
    it is (see the module's docstring)."""
    if len(spans) % 2:
        return f"has {len(spans)} entries; spans come in (start, end) pairs"
    if len(spans) > 2 * MAX_ENV_SPANS:
        return f"has {len(spans) // 2} spans, more than {MAX_ENV_SPANS} environment answers in one trajectory"
    if not spans:
        return None
    edges = np.asarray(spans, dtype=np.int64)
    if edges[0] < 1:
        return f"starts at {int(edges[0])}; the completion must start with a policy token (start >= 1)"
    if edges[-1] > length:
        return f"ends at {int(edges[-1])}, past the completion's {length} tokens"
    steps = np.diff(edges)
    if (steps <= 0).any():
        at = int(np.argmax(steps <= 0))
        return (f"is not strictly increasing at entries {at} and {at + 1} ({int(edges[at])}, {int(edges[at + 1])}):"
                " each span is non-empty and a policy turn lies between two spans")
    return None


def policy_token_mask(spans, length: int) -> np.ndarray:
    """(length,) bool: True on the policy's tokens, False on the environment's (``spans`` already valid)."""
    mask = np.ones(length, dtype=bool)
    for start, end in zip(spans[::2], spans[1::2]):
        mask[start:end] = False
    return mask


def policy_token_weights(spans, length: int) -> list[float] | None:
    """The per-token loss weights of a completion: None (every token counts, as a single-turn completion) without
    spans, else 1.0 on the policy's tokens and 0.0 on the environment's."""
    if not spans:
        return None
    return policy_token_mask(spans, length).astype(np.float64).tolist()


def policy_turns(spans, length: int) -> int:
    """How many turns the policy took in a completion of ``length`` tokens: one before each environment span,
    and one after the last span unless the completion ends with it."""
    if not spans:
        return 1
    return len(spans) // 2 + (spans[-1] < length)


def turn_metrics(episodes) -> dict:
    """``rollout/turns_mean`` and ``rollout/env_tokens_frac`` of ``episodes``, (env_spans, completion length)
    pairs; {} when none is multi-turn (a single-turn batch reports neither)."""
    episodes = list(episodes)
    if not any(spans for spans, _ in episodes):
        return {}
    tokens = sum(length for _, length in episodes)
    env_tokens = sum(sum(spans[1::2]) - sum(spans[::2]) for spans, _ in episodes)
    return {"rollout/turns_mean": sum(policy_turns(spans, length) for spans, length in episodes) / len(episodes),
            "rollout/env_tokens_frac": env_tokens / max(tokens, 1)}
