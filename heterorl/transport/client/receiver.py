"""A worker's pull of weights from a learner, on its I/O thread: `WeightsReceiver` holds the weights channel (to
rank 0 of a sharded learner) and the newest version delivered; a sharded learner's other ranks are each asked for
the same version on their own channel and their slices assembled (`ShardedFetch`, `assemble`) before the version
is handed over.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import zmq

from heterorl.config import TransportConfig
from heterorl.transport.client.fetch import WeightsFetch
from heterorl.transport.protocol import Message, WeightsHeader
from heterorl.transport.sockets import receive_waiting
from heterorl.transport.weights.reshard import Assembler, DestLayout, Piece, ReshardError, local

log = logging.getLogger("heterorl.transport")


class WeightsReceiver:
    """A worker's weights side, run by its I/O thread: the weights channel to the learner (to its rank 0 when it
    is sharded, and then one to each other rank: `ShardedFetch`), the fetch under way on it (`WeightsFetch`) and
    the newest version delivered (``fetched_version``). A whole, verified version goes to ``deliver_to(version,
    state)``; a reply that does not decode is counted by ``decode``, which returns None for it."""

    def __init__(self, worker_id: str, config: TransportConfig, layout: DestLayout, layout_key: str,
                 version_held: int, stats: Counter, connect: Callable[[str, int], zmq.Socket], poller: zmq.Poller,
                 decode: Callable[[list, str], Message | None], deliver_to: Callable[[int, dict], None]) -> None:
        self.worker_id, self.config, self.stats = worker_id, config, stats
        self.layout, self.layout_key = layout, layout_key  # the slices this worker wants; named in each request
        self.fetched_version = version_held
        self.sock: zmq.Socket | None = None  # the weights channel, once a ready names its port
        self.fetch = WeightsFetch()
        self.newer_offered = False  # a newer version was offered while a transfer was under way (`offer`)
        self.shards: ShardedFetch | None = None  # a sharded learner's other ranks (a ready names their ports)
        self._connect, self._poller, self._decode, self._deliver_to = connect, poller, decode, deliver_to

    def join(self, host: str, settings: dict) -> None:
        """A learner's ready: connect to the weights port it names and to a sharded learner's other ranks
        (``shard_ports``), or, when a restarted learner's ranks bound other ports, drop the old sockets (and the
        slices being gathered) and connect to the new ones."""
        if self.sock is None:
            self.sock = self._connect(f"{host}:{settings['weights_port']}", self.config.weights_hwm)
        ports = [int(p) for p in str(settings.get("shard_ports") or "").split(",") if p.isdigit()]
        if ports == (self.shards.ports if self.shards is not None else []):
            return
        if self.shards is not None:
            for sock in self.shards.sockets.values():
                self._poller.unregister(sock)
            self.shards.close()
            self.shards = None
        self.fetch.deliver = None
        if ports:
            self.shards = ShardedFetch(self, [self._connect(f"{host}:{port}", self.config.weights_hwm)
                                              for port in ports], ports)
            self.fetch.deliver = self.shards.part_of(0)

    def offer(self, version: int, now: float) -> None:
        """The learner has ``version`` (its ready's newest, a notice): when that is newer than what this worker
        has, ask for the newest version released to it. A transfer under way is finished first, and the newest
        asked for after it (`poll`): on a link slower than the learner's steps, a transfer restarted at every
        notice would never finish, and the worker would sample with its first version for ever."""
        if version > self.fetched_version and self.sock is not None:
            if self.fetch.active and self.fetch.header is not None:
                self.newer_offered = True
                return
            self.fetch.start(self.sock, self, now)

    def poll(self, events: dict, now: float) -> None:
        """The I/O loop's turn: take the replies, give up a silent fetch, ask a sharded learner's ranks."""
        sock = self.sock
        if sock is not None and sock in events:
            receive_waiting(sock, lambda s, frames: self.on_frames(s, self.fetch, frames, now))
        if sock is not None:
            self.fetch.check_timeout(sock, self, now)
            if self.newer_offered and not self.fetch.active:
                self.newer_offered = False
                self.fetch.start(sock, self, now)
        if self.shards is not None:
            self.shards.poll(self, events, now)

    def on_frames(self, sock: zmq.Socket, fetch: WeightsFetch, frames: list, now: float) -> None:
        """One reply for ``fetch``; one that does not decode (a corrupted chunk) has the version fetched whole."""
        message = self._decode(frames, "weights")
        if message is not None:
            fetch.on_message(sock, self, message, now)
        elif fetch.active:
            fetch.resync(sock, self, now)

    def deliver(self, version: int, state: dict) -> None:
        self.fetched_version = version
        self._deliver_to(version, state)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        if self.shards is not None:
            self.shards.close()


SHARD_RETRY_S = 0.05  # how soon a worker asks a rank again for a version it has not published yet


class ShardedFetch:
    """A sharded learner's fan-out on the worker (heterorl.transport.weights.shards): rank 0's fetch (the weights
    channel) names the version released to this worker; every other rank is asked for that same version on its own
    socket, and the version is delivered once every rank's verified slices of it are placed by an
    all-or-nothing `reshard.Assembler`. A newer version from rank 0 replaces the one being gathered (its slices
    are dropped): a worker never loads a mix of two versions. A rank that does not answer within
    ``fetch_timeout_s`` is counted (``weights/shard_timeouts/RANK``) and asked again; meanwhile the worker keeps
    the version it has. Slices that do not fit (a wrong shape or offset, two ranks claiming one element, one
    missing) are counted under ``weights/rejected/<reason>`` and every rank's version fetched whole again."""

    def __init__(self, receiver: WeightsReceiver, sockets: list[zmq.Socket], ports: list[int]) -> None:
        self.sockets = {rank: sock for rank, sock in enumerate(sockets, start=1)}
        self.ports = list(ports)
        self.fetches = {rank: WeightsFetch() for rank in self.sockets}
        for rank, fetch in self.fetches.items():
            fetch.deliver = self.part_of(rank)
        self.world = len(sockets) + 1
        self.target = -1
        self.parts: dict[int, tuple[WeightsHeader, dict]] = {}
        self.retry_at: dict[int, float] = {}
        self._receiver = receiver

    def part_of(self, rank: int) -> Callable[[WeightsHeader, dict, float], None]:
        return lambda header, state, now: self.on_part(rank, header, state, now)

    def on_part(self, rank: int, header: WeightsHeader, state: dict, now: float) -> None:
        receiver = self._receiver
        if header.version < self.target or header.version <= receiver.fetched_version:
            return  # a slice of a version given up on, or delivered already
        if header.shard != [rank, self.world]:
            receiver.stats["weights/rejected/shard"] += 1
            log.warning("learner rank %d sent slices marked %s, not [%d, %d]", rank, header.shard, rank, self.world)
            return
        if header.version > self.target:  # (only rank 0's can be: the others are asked for the target)
            self.target, self.parts = header.version, {}
            for other in self.fetches:
                self.retry_at[other] = now  # ask now
        self.parts[rank] = (header, state)
        if len(self.parts) == self.world:
            self._deliver(now)

    def poll(self, receiver: WeightsReceiver, events: dict, now: float) -> None:
        """The I/O loop's turn: take the ranks' replies, ask again where a rank's slices are due."""
        for rank, sock in self.sockets.items():
            fetch = self.fetches[rank]
            if sock in events:
                receive_waiting(sock, lambda s, frames, f=fetch: receiver.on_frames(s, f, frames, now))
            if fetch.active and now - fetch.last_progress > receiver.config.fetch_timeout_s:
                receiver.stats[f"weights/shard_timeouts/{rank}"] += 1
                log.warning("learner rank %d sent nothing of version %d for %.0f s; the worker keeps version %d",
                            rank, self.target, receiver.config.fetch_timeout_s, receiver.fetched_version)
                fetch.active = False
            if (self.target > receiver.fetched_version and rank not in self.parts and not fetch.active
                    and now >= self.retry_at.get(rank, 0.0)):
                self.retry_at[rank] = now + SHARD_RETRY_S
                fetch.start(sock, receiver, now, self.target)

    def _deliver(self, now: float) -> None:
        receiver, version = self._receiver, self.target
        try:
            state = assemble(version, [self.parts[rank] for rank in range(self.world)], receiver.layout)
        except ReshardError as exc:
            receiver.stats[f"weights/rejected/{exc.reason}"] += 1
            log.warning("the slices of weights version %d do not fit together (%s); fetching them whole", version,
                        exc)
            self.parts = {}
            receiver.fetch.resync(receiver.sock, receiver, now)
            for fetch in self.fetches.values():
                fetch.held = None
            return
        receiver.stats["weights/shard_versions_assembled"] += 1
        self.parts = {}
        receiver.deliver(version, state)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(0)


def assemble(version: int, parts: list[tuple[WeightsHeader, dict]], layout: DestLayout | None = None) -> dict:
    """The state dict of ``version`` from every rank's (header, slices), placed by a `reshard.Assembler`
    (`ReshardError` when they do not tile every tensor exactly once): whole tensors, or the worker's own slices
    of them (``layout``); tied names share one tensor."""
    layout = layout or DestLayout()
    shapes, dtypes, aliases = {}, {}, {}
    for header, state in parts:
        for name, full in zip(header.names, header.full_shapes):
            if shapes.setdefault(name, tuple(full)) != tuple(full):
                raise ReshardError(f"ranks disagree on the shape of {name!r}: {shapes[name]} and {tuple(full)}",
                                   "shape")
            dtypes[name] = state[name].dtype
        aliases.update(dict(header.aliases))
    assembler = Assembler(version, shapes, layout, dtypes)
    for rank, (header, state) in enumerate(parts):
        for name, box in zip(header.names, header.boxes):
            box = tuple((start, stop) for start, stop in box)
            wanted = layout.box(name, shapes[name])
            if any(start < low or stop > high for (start, stop), (low, high) in zip(box, wanted)):
                raise ReshardError(f"rank {rank} sent {name!r} at {box}, outside this worker's {wanted}", "offset")
            piece = Piece(name, rank, "", box, tuple((0, stop - start) for start, stop in box),
                          local(box, wanted), tuple(state[name].shape))
            assembler.add(version, piece, state[name])
    whole = assembler.tensors()
    for alias, source in aliases.items():
        if source in whole:
            whole[alias] = whole[source]
    return whole
