"""Peers refused at a high rate are throttled, then disconnected for a back-off (docs/RELIABILITY.md, "Work a
peer makes"). Every message the learner refuses costs it decoding and checking; an honest worker is refused
rarely (its credit, permits and the contract tell it what will be taken), so a connection whose messages are
refused more than ``max_refusals_per_s`` times within a second is *throttled*: its messages are discarded unread
(no decoding, no lock) for a back-off that doubles with each throttle (``throttle_s``, 2 ×, 4 × …, at most
`MAX_BACKOFF_S`). The ``throttles_before_disconnect``-th throttle in a row disconnects its worker: it leaves the
registry and its worker id (and, with CURVE, its key) is answered busy until the back-off ends.

Keyed by connection (a ZeroMQ routing id), so refusals of frames no worker can be named for (garbage, a peer
that never said hello) count too; the map is bounded (`MAX_PEERS_TRACKED`, least recently refused forgotten),
as is the map of the disconnected (`MAX_BANNED`). Pure: every time is passed in. Not thread-safe: the server's
I/O thread alone calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

MAX_BACKOFF_S = 300.0
MAX_PEERS_TRACKED = 8192
MAX_BANNED = 8192
_QUIET_S = 60.0  # a peer neither throttled nor refused at the rate for this long starts over


class Verdict(Enum):
    """What `PeerThrottle.count` decided for a connection."""

    OK = "ok"
    THROTTLED = "throttled"  # its messages are discarded unread for a while; tell it why
    DISCONNECT = "disconnect"  # throttled too often: remove its worker and refuse its hellos for a while


@dataclass
class _Peer:
    window_start: float
    refusals: int = 0  # in the window that began at window_start
    throttled_until: float = 0.0
    throttles: int = 0  # in a row (reset after _QUIET_S without one)
    last_throttle: float = 0.0


class PeerThrottle:
    def __init__(self, max_refusals_per_s: int, throttle_s: float, throttles_before_disconnect: int) -> None:
        self.max_refusals_per_s, self.throttle_s = max_refusals_per_s, throttle_s
        self.throttles_before_disconnect = throttles_before_disconnect
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()
        self._banned: OrderedDict[str, float] = OrderedDict()  # worker id or CURVE key → until when

    def discards(self, routing_id: bytes, now: float) -> bool:
        """Whether a message from connection ``routing_id`` is to be discarded unread (it is throttled)."""
        peer = self._peers.get(routing_id)
        return peer is not None and now < peer.throttled_until

    def backoff_s(self, routing_id: bytes) -> float:
        """The back-off of ``routing_id``'s latest throttle."""
        peer = self._peers.get(routing_id)
        return 0.0 if peer is None else min(MAX_BACKOFF_S, self.throttle_s * 2 ** max(0, peer.throttles - 1))

    def count(self, routing_id: bytes, refusals: int, now: float) -> Verdict:
        """``refusals`` more refusals of connection ``routing_id``'s messages, at ``now``."""
        if refusals <= 0:
            return Verdict.OK
        peer = self._peers.pop(routing_id, None) or _Peer(now)
        self._peers[routing_id] = peer  # most recently refused last
        while len(self._peers) > MAX_PEERS_TRACKED:
            self._peers.popitem(last=False)
        if now - peer.window_start >= 1.0:
            peer.window_start, peer.refusals = now, 0
        peer.refusals += refusals
        if peer.refusals <= self.max_refusals_per_s:
            return Verdict.OK
        if now - peer.last_throttle > _QUIET_S:
            peer.throttles = 0
        peer.throttles += 1
        peer.last_throttle, peer.refusals, peer.window_start = now, 0, now
        peer.throttled_until = now + self.backoff_s(routing_id)
        return Verdict.DISCONNECT if peer.throttles >= self.throttles_before_disconnect else Verdict.THROTTLED

    def ban(self, names: list[str], until: float) -> None:
        """Refuse hellos naming any of ``names`` (a worker id, a CURVE key) until ``until``."""
        for name in names:
            self._banned.pop(name, None)
            self._banned[name] = until
        while len(self._banned) > MAX_BANNED:
            self._banned.popitem(last=False)

    def banned_for(self, names: list[str], now: float) -> float:
        """Seconds left of the longest ban on any of ``names`` (0: none)."""
        left = max((self._banned.get(name, 0.0) - now for name in names if name), default=0.0)
        return max(0.0, left)
