"""The reward outcomes workers report in their heartbeats (``Heartbeat.reward_outcomes``: the programs their task's
reward ran, by outcome), kept to a bounded vocabulary, so that a peer cannot grow the learner, its checkpoint or its
summary by inventing names.

A heartbeat holds at most 64 names (`protocol.control.MAX_OUTCOMES`: the decoder refuses more, before any
work). The learner keeps every name of `KNOWN_OUTCOMES`, and the first `MAX_NEW_OUTCOMES` other names it is told,
at most `MAX_NEW_OUTCOMES_PER_WORKER` of them introduced by any one worker id; every other name is counted under
`FORBIDDEN_OTHER` when it starts with ``forbidden:`` (as the sandbox itself folds the kinds it does not know), else
under `OTHER`. Folding moves counts between names, never drops them. Once `MAX_NEW_OUTCOMES` are kept, no name
is kept that was not before.
"""

from __future__ import annotations

from collections import Counter

# The code task's sandbox's reasons (heterorl.tasks.sandbox_judge: OK ... SYNTAX, FORBIDDEN:FORBIDDEN_KINDS and its
# own fold, `forbidden:other`; heterorl.tasks.sandbox: `leftover`). tests/transport/test_peer_maps.py checks that
# the sandbox reports nothing outside them.
KNOWN_OUTCOMES = frozenset({
    "ok", "wrong_answer", "timeout", "not_started", "memory", "output_limit", "crashed", "syntax_error", "leftover",
    "forbidden:socket", "forbidden:open", "forbidden:process", "forbidden:ctypes", "forbidden:other", "other"})
OTHER, FORBIDDEN_OTHER = "other", "forbidden:other"  # where the names not kept are counted
MAX_NEW_OUTCOMES = 16  # names outside KNOWN_OUTCOMES kept, over every worker (a custom task's own reasons)
MAX_NEW_OUTCOMES_PER_WORKER = 4  # ... of which one worker id may introduce at most these


class OutcomeNames:
    """The names kept (`KNOWN_OUTCOMES` and the new ones admitted, with the worker that introduced each), and the
    fold of a heartbeat's counts onto them. Not thread-safe: the server's lock guards every call."""

    def __init__(self) -> None:
        self.new: dict[str, str] = {}  # name → the worker id that introduced it (at most MAX_NEW_OUTCOMES)
        self._introduced: Counter = Counter()  # worker id → names it introduced (keys: at most MAX_NEW_OUTCOMES)

    def name(self, name: str, worker_id: str) -> str:
        """``name`` when it is kept (known, or admitted now), else the name it is counted under."""
        if name in KNOWN_OUTCOMES or name in self.new:
            return name
        if len(self.new) < MAX_NEW_OUTCOMES and self._introduced[worker_id] < MAX_NEW_OUTCOMES_PER_WORKER:
            self.new[name] = worker_id
            self._introduced[worker_id] += 1
            return name
        return FORBIDDEN_OTHER if name.startswith("forbidden:") else OTHER

    def fold(self, counts: dict[str, int], worker_id: str) -> dict[str, int]:
        """``counts`` (a heartbeat's, from ``worker_id``) with every name not kept counted under its fold; the
        counts' sum is unchanged."""
        folded: Counter = Counter()
        for name, count in counts.items():
            folded[self.name(name, worker_id)] += count
        return dict(folded)
