"""What peers sent the learner and it has not handled yet, and the work their messages cost it: one budget per
peer (docs/RELIABILITY.md, "Budgets per peer").

The learner's I/O thread reads its control socket as fast as messages come (a read is a pointer move: ZeroMQ
already holds the bytes), so ZeroMQ's own queues stay short, and keeps each message here, in its peer's queue,
until it is handled. A peer is who can be held to account: its CURVE key, else its registered worker id; every
connection that has not said hello yet shares one peer, `PROBATION`. A reconnect is the same peer, so nothing
a peer spends comes back by dialling again.

Per peer:

- **bytes**: its queued messages hold at most ``peer_bytes``; a message that would pass it is dropped unread
  (``over_budget``), one larger than the whole budget is dropped as ``too_large``. All peers together hold at
  most ``total_bytes``: a message that would pass it takes room from the peer that holds the most, dropping
  that peer's newest messages first (the arriving one when it is that peer's);
- **work**: the I/O thread's CPU seconds its messages took to read, decode, check and take in (measured: each
  message's handling charged after it, the reads of a batch shared by count) come out of a bucket refilled at
  ``work_s_per_s`` seconds a second, holding at most ``burst_s``. A peer whose bucket is empty is not handled
  until it refills: what it had queued waits, and what it sends meanwhile is dropped as it is read
  (``work_spent``).

Among the peers whose bucket is not empty, the next message handled is that of the peer that has used the least
work (start-time fair queueing: a peer's tag grows by each message's cost, and a peer that was idle starts at the
tag of the last message served, with no credit saved up). A cheap honest message therefore waits at most for the
message being handled, however expensive a flood of other peers' messages is. A connection's messages are handled
in the order they came: while some of them wait, the next joins them under their peer (so those read before its
hello was handled stay with probation's, and its repeated hello is never taken after its first heartbeat).

Pure: every time and cost is passed in; not thread-safe (the I/O thread alone calls it). The map of peers is
bounded (`MAX_PEERS`, idle ones forgotten, least recently active first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from heterorl.config import TransportConfig
from heterorl.transport.protocol import Limits, TrajectoryContract, max_trajectory_wire_bytes

PROBATION = "probation"  # the one peer of every connection that has not said hello (plaintext)
MAX_PEERS = 8192
TELL_EVERY_S = 1.0  # a peer is told of its dropped messages at most this often


def peer_budget_bytes(config: TransportConfig, contract: TrajectoryContract | None, limits: Limits) -> int:
    """The bytes one peer's messages may hold at the learner before they are handled: ``peer_inbound_bytes``, or
    (0) what an honest worker can have in flight, so it never meets the bound — its credit's worth
    (``credits_per_worker``) of the contract's longest trajectories, and 1 MiB for its other messages (64 MiB
    without a contract) — at most ``inbound_bytes``."""
    if config.peer_inbound_bytes:
        return config.peer_inbound_bytes
    if contract is None:
        return min(64 * 2**20, config.inbound_bytes)
    in_flight = config.credits_per_worker * max_trajectory_wire_bytes(contract.max_sequence_len, limits)
    return min(in_flight + 2**20, config.inbound_bytes)


@dataclass
class _Peer:
    tokens: float  # seconds of work it may use now (may go below 0 by the last message's cost)
    refilled: float
    tag: float = 0.0  # its virtual time: the work it has been served, from when it was last idle
    queue: deque = field(default_factory=deque)  # (size, item, connection), oldest first
    queued_bytes: int = 0
    told_at: float = float("-inf")


class PeerInbox:
    """Messages waiting to be handled, one queue and one budget per peer (see the module)."""

    def __init__(self, peer_bytes: int, total_bytes: int, work_s_per_s: float, burst_s: float) -> None:
        if not 0 < peer_bytes <= total_bytes:
            raise ValueError(f"peer_bytes ({peer_bytes}) must be > 0 and at most total_bytes ({total_bytes})")
        if work_s_per_s <= 0 or burst_s <= 0:
            raise ValueError("work_s_per_s and burst_s must be > 0")
        self.peer_bytes, self.total_bytes = peer_bytes, total_bytes
        self.work_s_per_s, self.burst_s = work_s_per_s, burst_s
        self.queued_bytes = 0
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently active first
        self._waiting: dict[str, _Peer] = {}  # the peers with a message queued
        self._connections: dict[Any, list] = {}  # a connection with messages queued: [its peer, how many]
        self._served_tag = 0.0  # the tag of the message served last

    def __len__(self) -> int:
        return sum(len(peer.queue) for peer in self._waiting.values())

    def _peer(self, name: str, now: float) -> _Peer:
        peer = self._peers.pop(name, None)
        if peer is None:
            peer = _Peer(tokens=self.burst_s, refilled=now)
            self._forget_idle(now)
        self._peers[name] = peer  # most recently active last
        return peer

    def _forget_idle(self, now: float) -> None:
        """Bound the map: forget the least recently active peers that queue nothing and owe no work (a peer in
        debt is kept, or forgetting it would forgive the debt)."""
        if len(self._peers) < MAX_PEERS:
            return
        for name in list(self._peers):
            peer = self._peers[name]
            self._refill(peer, now)
            if not peer.queue and peer.tokens >= self.burst_s:
                del self._peers[name]
                if len(self._peers) < MAX_PEERS:
                    return

    def _refill(self, peer: _Peer, now: float) -> None:
        peer.tokens = min(self.burst_s, peer.tokens + self.work_s_per_s * max(0.0, now - peer.refilled))
        peer.refilled = max(peer.refilled, now)

    # -- in -------------------------------------------------------------------------------------
    def add(self, name: str, item: Any, size: int, now: float, connection: Any = None) -> list[tuple[str, Any, str]]:
        """Queue ``item`` (``size`` bytes) from peer ``name``; returns what was dropped for it, as
        (peer, item, reason) — the item itself (``too_large``, ``over_budget``, or ``work_spent`` while its
        peer's bucket is empty), or the newest messages of the peer holding the most when all peers together would
        pass ``total_bytes`` (``inbound_full``).
        ``connection``: while earlier messages of it wait, a message joins them, under their peer, whatever
        ``name`` says (a connection's messages are handled in the order they came, its hello's registration
        notwithstanding)."""
        if connection is not None and connection in self._connections:
            name = self._connections[connection][0]
        peer = self._peer(name, now)
        if size > self.peer_bytes:
            return [(name, item, "too_large")]
        if peer.queued_bytes + size > self.peer_bytes:
            return [(name, item, "over_budget")]
        self._refill(peer, now)
        if peer.tokens <= 0:
            return [(name, item, "work_spent")]
        if not peer.queue:  # idle until now: no credit for the time it was idle
            peer.tag = max(peer.tag, self._served_tag)
            self._waiting[name] = peer
        peer.queue.append((size, item, connection))
        if connection is not None:
            self._connections.setdefault(connection, [name, 0])[1] += 1
        peer.queued_bytes += size
        self.queued_bytes += size
        dropped = []
        while self.queued_bytes > self.total_bytes:
            holder_name, holder = max(self._waiting.items(), key=lambda kv: kv[1].queued_bytes)
            dropped.append((holder_name, self._take(holder_name, holder, newest=True), "inbound_full"))
        return dropped

    # -- out ------------------------------------------------------------------------------------
    def next(self, now: float) -> tuple[str, Any] | None:
        """The next message to handle, as (peer, item): from the peer with the least work served among those
        whose bucket is not empty; None when none may go now (`wait_s` says how long until one may)."""
        best: tuple[float, str, _Peer] | None = None
        for name, peer in self._waiting.items():
            self._refill(peer, now)
            if peer.tokens > 0 and (best is None or peer.tag < best[0]):
                best = (peer.tag, name, peer)
        if best is None:
            return None
        tag, name, peer = best
        self._served_tag = tag
        return name, self._take(name, peer, newest=False)

    def _take(self, name: str, peer: _Peer, newest: bool) -> Any:
        """Take the oldest (or ``newest``) message out of peer ``name``'s queue."""
        size, item, connection = peer.queue.pop() if newest else peer.queue.popleft()
        self._unqueued(connection)
        peer.queued_bytes -= size
        self.queued_bytes -= size
        if not peer.queue:
            del self._waiting[name]
        return item

    def _unqueued(self, connection: Any) -> None:
        if connection is not None:
            held = self._connections[connection]
            held[1] -= 1
            if not held[1]:
                del self._connections[connection]

    def charge(self, name: str, work_s: float, now: float) -> None:
        """Peer ``name``'s message just handled took ``work_s`` seconds of work."""
        peer = self._peer(name, now)
        self._refill(peer, now)
        peer.tokens -= work_s
        peer.tag += work_s

    def wait_s(self, now: float) -> float | None:
        """Seconds until a queued message may be handled: 0 when one may now, None when none is queued."""
        waits = []
        for peer in self._waiting.values():
            self._refill(peer, now)
            waits.append(0.0 if peer.tokens > 0 else -peer.tokens / self.work_s_per_s + 1e-6)
        return min(waits, default=None)

    # -- telling --------------------------------------------------------------------------------
    def may_tell(self, name: str, now: float) -> bool:
        """Whether peer ``name`` may be told of a refusal now: at most once every `TELL_EVERY_S`."""
        peer = self._peer(name, now)
        if now - peer.told_at < TELL_EVERY_S:
            return False
        peer.told_at = now
        return True

    def may_work(self, name: str, now: float) -> bool:
        """Whether peer ``name``'s bucket holds work now (for what is handled at once, never queued)."""
        peer = self._peer(name, now)
        self._refill(peer, now)
        return peer.tokens > 0

    def queued_of(self, name: str) -> int:
        """Bytes of peer ``name``'s messages queued."""
        peer = self._peers.get(name)
        return peer.queued_bytes if peer is not None else 0


class DiscardPace:
    """The I/O thread's time reading messages that no peer's queue takes — those of a throttled connection,
    discarded unread, and those dropped as they are read (`PeerInbox.add`) — at most ``s_per_s`` seconds a second,
    all peers together, in a bucket of ``burst_s`` (docs/RELIABILITY.md, "Budgets per peer").

    A peer's budget bounds what its messages take once read, but reading is work too, done at the sender's
    pace: a flood of tiny messages, all discarded, kept the thread reading as fast as they came. When the bucket
    is empty the control socket is not read until it refills: ZeroMQ holds what arrives meanwhile
    (``control_hwm`` messages a connection, then TCP holds the sender), and when reading resumes ZeroMQ takes
    one message from each connection in turn, so an honest worker's message waits one pause at most
    (``burst_s / s_per_s``). An honest worker's messages are never discarded or dropped, so they never spend it.
    Pure: every time is passed in."""

    def __init__(self, s_per_s: float, burst_s: float) -> None:
        if s_per_s <= 0 or burst_s <= 0:
            raise ValueError("s_per_s and burst_s must be > 0")
        self.s_per_s, self.burst_s = s_per_s, burst_s
        self._tokens, self._refilled = burst_s, float("-inf")

    def _refill(self, now: float) -> None:
        if self._refilled == float("-inf"):
            self._refilled = now
        self._tokens = min(self.burst_s, self._tokens + self.s_per_s * max(0.0, now - self._refilled))
        self._refilled = max(self._refilled, now)

    def spend(self, seconds: float, now: float) -> None:
        """``seconds`` of reading went to messages discarded or dropped."""
        self._refill(now)
        self._tokens -= seconds

    def left_s(self, now: float) -> float:
        """Seconds of reading left in the bucket (0 or less: empty)."""
        self._refill(now)
        return self._tokens

    def paused_s(self, now: float) -> float:
        """Seconds until the control socket may be read again: 0 when it may now."""
        self._refill(now)
        return 0.0 if self._tokens > 0 else -self._tokens / self.s_per_s + 1e-6
