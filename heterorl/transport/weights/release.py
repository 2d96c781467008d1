"""Weights release at the learner's end: the versions published (`WeightsStore`, one per layout a sharded learner
packs), when each worker hears of a new one (its weights link's delay, in a `DelayQueue` of notices), which
version is released to it, and the answer to its weights requests.

Weights are pulled: a ``weights_notice`` on the control channel says a version is out; the worker asks for the
header of the newest version released to it, then for its chunks. A worker that joins late or misses notices
always gets the newest whole version. A version is kept while some worker may still be given it (`needed`), at
most ``max_retained_versions``. Not thread-safe: the server's lock guards every call but `WeightsStore.pack`.

Serving is bounded (docs/RELIABILITY.md, "Weights serving"): a request is answered only when it carries the token
of its worker's current session (`in_session`); a chunk is sent only while that worker's replies not yet sent, and
every worker's, stay under their bounds (`inflight.BytesInFlight`; else its transfer's header goes back and the
worker asks again); a sharded learner packs at most ``max_layouts`` layouts each publish (`layout_refusal`).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import Counter
from typing import Any, Callable

from heterorl.config import TransportConfig
from heterorl.transport.protocol import WeightsNotice, WeightsRequest
from heterorl.transport.registry import WorkerInfo, WorkerRegistry
from heterorl.transport.weights.inflight import BytesInFlight
from heterorl.transport.weights.pack import PackedWeights
from heterorl.transport.weights.reshard import DestLayout, ReshardError, layout_key
from heterorl.transport.weights.store import WeightsStore


class WeightsRelease:
    """``store``: the whole-model versions; ``stores``: by `reshard.layout_key`, a sharded learner's packs for
    workers that declared their own slices ("" is ``store``). ``weights_delay(worker_id)``: a worker's weights
    link (`schedule_notice`; None: notices go out at once)."""

    def __init__(self, config: TransportConfig, stats: Counter, registry: WorkerRegistry, published_before: int,
                 weights_delay: Callable[[str], Any] | None, shard_ranks: int, shard_ports: list[int] | None,
                 model_shapes: dict[str, tuple[int, ...]] | None) -> None:
        if len(shard_ports or []) != shard_ranks - 1:
            raise ValueError(f"a learner of {shard_ranks} ranks that each send their own slices needs the weights "
                             f"ports of ranks 1..{shard_ranks - 1} (shard_ports), not {shard_ports}")
        self.config, self.registry = config, registry
        # the versions published (the newest: the contract's version bound; a resumed learner's starts above the
        # newest an earlier learner of this run published), their delta chain
        self.store = WeightsStore(config, stats, newest=published_before)
        self.stats = stats
        self.stores: dict[str, WeightsStore] = {"": self.store}
        self.shard_ports = list(shard_ports or [])  # a sharded learner's other ranks' weights ports (told in Ready)
        self._model_shapes = dict(model_shapes) if model_shapes else None  # what a worker's layout must fit
        self._weights_delay = weights_delay
        self._delay_links: dict[str, Any] = {}  # worker id → its weights link (`schedule_notice`)
        self._sessions: dict[str, str] = {}  # worker id → the token of its current session (`start_session`)
        self.in_flight = BytesInFlight.of(config, stats)  # chunk replies not yet handed to the network

    def shard_settings(self) -> dict[str, str]:
        """What ``ready`` tells a worker of a sharded learner: its other ranks' weights ports ({} when not)."""
        return {"shard_ports": ",".join(map(str, self.shard_ports))} if self.shard_ports else {}

    def layouts(self) -> dict[str, dict]:
        return {w.layout_key: w.layout for w in self.registry.workers.values() if w.layout_key and w.alive}

    def layout_refusal(self, layout: dict) -> str | None:
        """Why the slices a hello asks for (``layout``) cannot be sent (None: they can, or it asks for the whole
        model). Every rank packs each layout every publish, so at most ``max_layouts`` are held: those of the
        workers in the registry (a place frees when the last worker of a layout leaves it)."""
        if not layout:
            return None
        if not self.shard_ports or self._model_shapes is None:
            return "the learner is not sharded: it sends whole versions only (declare no layout)"
        try:
            wanted = DestLayout.from_dict(layout)
            wanted.validate(self._model_shapes)
        except ReshardError as exc:
            return f"its layout does not fit the model: {exc}"
        held = {w.layout_key for w in self.registry.workers.values() if w.layout_key}
        if layout_key(wanted) not in held and len(held) >= self.config.max_layouts:
            return (f"the learner already packs {len(held)} distinct layouts each publish (transport.max_layouts); "
                    "declare the layout of a worker already joined, or raise transport.max_layouts")
        return None

    def start_session(self, worker: WorkerInfo) -> None:
        """A (re)joining worker gets the newest version held at once (none before the first publish): its link's
        next transfer is the steps from there."""
        worker.pending_notices.clear()
        worker.released_version = max(self.store.versions, default=-1)
        worker.noticed_version, worker.waiting_version = worker.released_version, -1
        self._sessions[worker.worker_id] = secrets.token_hex(16)

    def session_settings(self, worker: WorkerInfo) -> dict[str, str]:
        """What ``ready`` tells a worker of its session: the token its weights requests must carry."""
        return {"weights_session": self._sessions[worker.worker_id]}

    def in_session(self, worker: WorkerInfo, token: str) -> bool:
        """Whether ``token`` is that of ``worker``'s current session: requests from a connection of another
        session (an earlier one, or one that only names the worker) are not answered."""
        current = self._sessions.get(worker.worker_id, "")
        return bool(token) and hmac.compare_digest(current, token)

    def forget(self, worker_id: str) -> None:
        """A worker left the registry: its link and its session go (a worker of that id later gets fresh ones)."""
        self._delay_links.pop(worker_id, None)
        self._sessions.pop(worker_id, None)

    def notice(self, worker: WorkerInfo) -> WeightsNotice:
        """The notice of the version released to ``worker``, with when it was published."""
        packed = self.store.versions.get(worker.released_version)
        return WeightsNotice(worker.released_version, packed.published_at if packed is not None else 0.0)

    def layout_store(self, key: str) -> WeightsStore:
        return self.stores.setdefault(key, WeightsStore(self.config, Counter()))

    def add(self, version: int, packed: PackedWeights, step, now: float) -> None:
        """``version`` is packed (`WeightsStore.pack`): keep it and schedule every worker's notice of it."""
        packed.published_at = time.time()  # said in its notices: a worker measures its weights' arrival from it
        self.store.add(version, packed, step)
        for worker in self.registry.workers.values():
            self.schedule_notice(worker, version, now, packed.header.total_bytes)
        self.trim()

    def reply(self, request: WeightsRequest, worker: WorkerInfo) -> tuple[list, int] | None:
        """The frames answering ``request`` from the version released to ``worker``, and the payload bytes they
        carry (0: a header); None while nothing is released to it (it asks again on the next notice)."""
        store = self.stores.get(worker.layout_key)
        released = store.versions.get(worker.released_version) if store is not None else None
        if released is None:
            return None
        return store.reply(request, released, self.in_flight, worker.public_key or worker.worker_id)

    # -- notices ----------------------------------------------------------------------------------
    def schedule_notice(self, worker: WorkerInfo, version: int, now: float, size: int) -> None:
        """Hold back the notice of ``version`` (``size`` bytes whole) by the worker's weights link: a
        `DelaySchedule`, or an object with one as ``schedule`` (a `heterorl.delay.DelayLink`). What the link
        carries is the steps since the version noticed before, where those are kept, else the whole version. A
        link that says when it is ``free_at`` (a bandwidth limit) sends one version at a time: one published
        while it transmits waits (`_send_waiting`), replacing any older one waiting, as a worker fetches only
        the newest version released to it."""
        if worker.worker_id not in self._delay_links:
            self._delay_links[worker.worker_id] = self._weights_delay(worker.worker_id) if self._weights_delay else None
        link = self._delay_links[worker.worker_id]
        if link is None:
            worker.noticed_version = version
            worker.pending_notices.put(now, version)
            return
        free_at = getattr(link, "free_at", None)
        if free_at is not None and now < free_at:
            self.stats["weights/link_skipped"] += worker.waiting_version >= 0  # an older one waited: never sent
            worker.waiting_version = version
            return
        steps = (self.store.chain.bytes_between(worker.noticed_version, version) if self.config.weights_deltas
                 else None)
        carried = size if steps is None else steps
        self.stats["weights/link_transfers"] += 1
        self.stats["weights/link_bytes"] += carried
        due = getattr(link, "schedule", link)(now, carried)
        if due is None:
            self.stats["weights/notices_lost"] += 1
            return
        worker.noticed_version = version
        worker.pending_notices.put(due, version)

    def _send_waiting(self, worker: WorkerInfo, clock_now: float) -> None:
        """Once the worker's link has finished transmitting, send the version that waited for it then."""
        link = self._delay_links.get(worker.worker_id)
        free_at = getattr(link, "free_at", None)
        if worker.waiting_version < 0 or free_at is None or clock_now < free_at:
            return
        version, worker.waiting_version = worker.waiting_version, -1
        packed = self.store.versions.get(version) or self.store.versions[self.store.newest]
        self.schedule_notice(worker, packed.header.version, free_at, packed.header.total_bytes)

    def release_due(self, worker: WorkerInfo, clock_now: float) -> bool:
        """Release the versions whose notices are due; True when the worker's released version moved."""
        self._send_waiting(worker, clock_now)
        released = False
        for _, _, version in worker.pending_notices.pop_due(clock_now):
            if version in self.store.versions:
                worker.released_version = max(worker.released_version, version)
                released = True
            else:  # dropped from retention: the next retained version stands in
                newer = [v for v in self.store.versions if v > version]
                if newer:
                    worker.released_version = max(worker.released_version, newer[0])
                    released = True
        return released

    # -- retention --------------------------------------------------------------------------------
    def needed(self) -> set[int]:
        """The versions a worker may still be given: released to it, or noticed and due, or waiting for its
        link."""
        workers = self.registry.workers.values()
        needed = {w.released_version for w in workers}
        needed |= {v for w in workers for v in w.pending_notices}
        return needed | {w.waiting_version for w in workers}

    def trim(self) -> None:
        needed = self.needed()
        for store in self.stores.values():
            store.trim(needed)
        kept = {w.layout_key for w in self.registry.workers.values()}
        for key in [key for key in self.stores if key not in kept and key]:
            del self.stores[key]  # no worker of that layout is left: its packs (its newest one too) go
