"""The weights fan-out of a sharded learner (the reshard collective on the project's transport): every rank sends
the slices of the weights it owns straight to the workers, in parallel, instead of gathering the whole model on
rank 0 first.

- **Slices.** Each rank publishes its own slices of each version (`slices_of`: the rows of every parameter its
  FSDP shard holds) as an ordinary packed version whose header says where each slice lies in the whole tensor
  (``shard``, ``full_shapes``, ``boxes``: `heterorl.transport.weights.reshard` computes them). Chunking, checksums,
  credit flow (one request, one chunk), deltas between a rank's consecutive versions and CURVE are those of
  rank 0's weights channel (`heterorl.transport.weights.store.WeightsStore`).
- **Rank 0** (`LearnerServer`) keeps the control channel, the worker registry, the delays and the notices, and
  serves its own slices on its weights channel; it tells workers the other ranks' weights ports (``Ready``).
- **The other ranks** run a `ShardServer`: a weights channel (on a free port of rank 0's host, bound at setup
  and told to rank 0: `heterorl.runtime.launch.bind_shard_channels`) and nothing else. A worker asks it for
  the version rank 0 released to it, by number; a version not published there yet is answered with the newest
  one it has, and the worker asks again shortly. Such a rank does not check the session token rank 0 gave the
  worker (`WeightsRelease.in_session`): it hears from rank 0 only at each publish (the versions still needed, the
  layouts), and a worker that joins between two publishes asks it at once. What a peer can make it hold is
  bounded all the same: chunks go as copies, and their bytes not yet sent are held under
  ``weights_bytes_in_flight_per_worker`` for each CURVE key (whatever worker ids its requests name; without CURVE,
  for each worker id) and ``weights_bytes_in_flight`` in all (`heterorl.transport.weights.inflight`); under CURVE
  only allowed keys reach it.
- **The worker** (`heterorl.transport.client`) fetches the version from every rank and places the slices with
  an all-or-nothing `reshard.Assembler`: it loads version v only when every rank's slices of v arrived and were
  verified, never a mix of two versions; a rank that does not answer leaves it on the version it has.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from heterorl.addresses import parse_host_port
from heterorl.config import TransportConfig
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.transport.protocol import DEFAULT_LIMITS, Limits, ProtocolError, WeightsHeader, WeightsRequest, decode
from heterorl.transport.sockets import (
    CurveConfig,
    Endpoint,
    TransportError,
    Wakeup,
    make_socket,
    receive_waiting,
    require_security,
    send_frames,
)
from heterorl.transport.weights.inflight import BytesInFlight
from heterorl.transport.weights.reshard import DestLayout, Placement, SourceLayout, plan, take
from heterorl.transport.weights.store import WeightsStore

log = logging.getLogger("heterorl.transport")


def slices_of(state: dict[str, torch.Tensor], rank: int, world: int) -> tuple[dict, dict, dict]:
    """A sharded model's state dict (DTensors, sharded along dim 0 over ``world`` ranks, FSDP2) as this rank's
    slices: ({name: local tensor}, {name: whole shape}, {name: box}); a tensor that is not a DTensor (a buffer,
    the same on every rank) is sent whole by rank 0 only. Tied names keep one tensor (their slices are one)."""
    from torch.distributed.tensor import DTensor

    shapes = {name: tuple(t.shape) for name, t in state.items()}
    layout = SourceLayout.fsdp(shapes, world)
    slices, full_shapes, boxes = {}, {}, {}
    locals_by_id: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            box = layout.box(name, shapes[name], rank)
            if id(tensor) not in locals_by_id:
                locals_by_id[id(tensor)] = tensor.to_local()
            local = locals_by_id[id(tensor)]
            if tuple(local.shape) != tuple(b - a for a, b in box):
                raise HeteroRLError(f"{name}: rank {rank} holds a slice of shape {tuple(local.shape)}, not the "
                                    f"dim-0 chunk {box} of {shapes[name]} the fan-out expects (FSDP2's Shard(0))")
        elif rank == 0:
            local, box = tensor, tuple((0, size) for size in shapes[name])
        else:
            continue
        if local.numel() == 0:
            continue  # (a rank past the end of a short tensor owns nothing of it)
        slices[name], full_shapes[name], boxes[name] = local.detach(), shapes[name], box
    return slices, full_shapes, boxes


def slices_for(state: dict[str, torch.Tensor], rank: int, world: int, layout: DestLayout) -> tuple[dict, dict, dict]:
    """`slices_of` for workers that want their own slices (``layout``, a tensor-parallel engine's rank): the
    pieces of the plan (`reshard.plan`) this rank sends them, as ({name: tensor}, {name: whole shape},
    {name: box})."""
    from torch.distributed.tensor import DTensor

    if not layout.placements:
        return slices_of(state, rank, world)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    source = SourceLayout(world, {name: Placement.shard(0, world) if isinstance(t, DTensor) and shapes[name]
                                  else Placement.replicate() for name, t in state.items()})
    slices, full_shapes, boxes = {}, {}, {}
    for piece in plan(shapes, source, {"worker": layout}).pieces_from(rank).get("worker", []):
        tensor = state[piece.name]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        slices[piece.name] = take(local.detach(), piece)
        full_shapes[piece.name], boxes[piece.name] = shapes[piece.name], piece.global_box
    return slices, full_shapes, boxes


def describer(rank: int, world: int, full_shapes: dict, boxes: dict):
    """The ``describe`` of `WeightsStore.pack` for one rank's slices: the header's ``shard``, ``full_shapes`` and
    ``boxes`` in the order of its names."""
    def describe(header: WeightsHeader) -> None:
        header.shard = [rank, world]
        header.full_shapes = [list(full_shapes[name]) for name in header.names]
        header.boxes = [[list(pair) for pair in boxes[name]] for name in header.names]
    return describe


class ShardServer(Endpoint):
    """A sharded learner's rank > 0: its slices of each version, on a weights channel of its own. Thread-safe
    `publish`; an I/O thread answers the workers."""

    def __init__(self, address: str, rank: int, world: int, config: TransportConfig | None = None,
                 curve: CurveConfig | None = None, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config or TransportConfig()
        require_security(address, curve, self.config, (
            f"learner rank {rank}: refusing plaintext on {address}: give CURVE keys or allow_plaintext"))
        self.rank, self.world, self.limits, self._curve = rank, world, limits, curve
        self._address = address
        self.stats: Counter = Counter()
        self.store = WeightsStore(self.config, self.stats)
        self.stores: dict[str, WeightsStore] = {"": self.store}  # by `reshard.layout_key` ("": whole tensors)
        self.in_flight = BytesInFlight.of(self.config, self.stats)  # chunk replies not yet handed to the network
        self._lock = threading.Lock()
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name=f"heterorl-shard-{rank}", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    def publish(self, version: int, state: dict[str, torch.Tensor], full_shapes: dict, boxes: dict,
                dtype: torch.dtype | None = None, needed: set[int] | None = None, layout: str = "") -> None:
        """This rank's slices of ``version`` (`slices_of`), cast to ``dtype``. ``needed``: the versions rank 0
        may still release to a worker (`LearnerServer.needed_versions`); the others are retired (None: keep the
        newest ``max_retained_versions``). ``layout``: the key of the workers' layout these slices are for."""
        with self._lock:
            store = self.stores.setdefault(layout, WeightsStore(self.config, Counter()))
            spare, previous = store.begin(version)
        packed, step = store.pack(state, version, spare, previous, dtype,
                                  describer(self.rank, self.world, full_shapes, boxes))
        with self._lock:
            store.add(version, packed, step)
            # workers ask by number for the version rank 0 released to them, which a delayed link can hold back
            # behind newer ones (a retired one is answered with the newest)
            if needed is None:
                needed = set(list(store.versions)[-self.config.max_retained_versions:])
            store.trim(set(needed))

    def keep_layouts(self, keys: set[str]) -> None:
        """Drop the packs of every layout but ``keys`` (the live workers' layouts rank 0 told this rank)."""
        with self._lock:
            for key in [key for key in self.stores if key not in keys and key]:
                del self.stores[key]

    def close(self, reason: str = "") -> None:
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=10)

    # -- I/O thread -----------------------------------------------------------------------------
    def _bind(self, ctx: zmq.Context) -> tuple[ThreadAuthenticator | None, zmq.Socket]:
        auth = None
        sock = make_socket(ctx, zmq.ROUTER, self.config.weights_hwm, self.config, self.limits)
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self._curve is not None:
                allowed = self._curve.allowed_keys_dir
                if not allowed or not Path(allowed).is_dir():
                    raise ConfigError(f"allowed_keys_dir {allowed!r} is not a folder of worker public keys")
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("heterorl.auth"))
                auth.start()
                auth.configure_curve(domain="*", location=str(allowed))
                public, secret = self._curve.keypair()
                sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
            host, port = parse_host_port(self._address, f"learner rank {self.rank}'s weights address",
                                         "tcp://127.0.0.1:0")
            if port == 0:
                self._address = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
            else:
                sock.bind(self._address)
        except BaseException as exc:
            sock.close(0)
            if auth is not None:
                auth.stop()
            if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EADDRINUSE:
                raise TransportError(f"learner rank {self.rank}: {self._address} is in use by another process "
                                     "(bind this rank's weights channel on port 0 for a free one)") from None
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self._address
        return auth, sock

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            auth, sock = self._bind(ctx)
        except BaseException as exc:
            self._error = exc if isinstance(exc, HeteroRLError) else TransportError(f"cannot bind {self._address}: "
                                                                                    f"{exc}")
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))
                if self._wakeup.read_fd in events:
                    self._wakeup.drain()
                if sock in events:
                    receive_waiting(sock, self._on_request)
        finally:
            sock.close(self.config.linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()
            self._wakeup.close()

    def _on_request(self, sock: zmq.Socket, frames: list) -> None:
        routing_id = frames[0].bytes
        try:
            request = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            self.stats[f"rejected/{exc.reason}"] += 1
            return
        if not isinstance(request, WeightsRequest):
            self.stats["rejected/unexpected_kind"] += 1
            return
        with self._lock:
            store = self.stores.get(request.layout)
            if store is None:
                return  # nothing published for this layout yet: the worker's fetch asks again
            # the version asked for, else the newest (older: the worker asks again; newer: it moves on to it)
            released = store.versions.get(request.version) or store.versions.get(store.newest)
            if released is None:
                return
            # held as rank 0 holds them: a CURVE key's, whatever ids its requests name; else the id's
            holder = frames[1].get("User-Id") if self._curve is not None else None
            frames, carried = store.reply(request, released, self.in_flight, holder or request.worker_id)
        if send_frames(sock, [routing_id, *frames], self.stats, "weights_chunk" if carried else "weights_header"):
            self.stats["weights/bytes_sent"] += carried


__all__ = ["ShardServer", "describer", "slices_for", "slices_of"]
