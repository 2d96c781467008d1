"""The learner's end of the transport: `LearnerServer`, the thread-safe API the learner calls, over four rooms,
each in its own module:

- `registry` (`WorkerRegistry`, `WorkerInfo`): who is connected, alive, allowed (CURVE keys, revocation);
- `intake` (`Intake`): trajectories in under credit, checked, assembled into whole groups (`groups`:
  `GroupAssembler`) and queued for the learner's consumer (`get_groups`, `get`);
- `admission` (`Admission`): how many groups the fleet may start, each worker's share of the permits;
- `release` (`WeightsRelease`): the versions published, each worker's notices after its weights link's delay,
  the answers to weights requests;

and `membership` (`Membership`), a worker joining, timing out and leaving, which touches all four. `rooms`
(`Rooms`) makes and wires them, with the one lock, a `threading.Condition`, that guards them all; the public
methods take it. `learner_io` (`LearnerIO`) is the I/O thread: it owns both sockets, hands what arrives to the
rooms and sends everything (the rooms return what is to be sent).

Dependencies point one way: this module → `learner_io` → `rooms` → `membership` → `intake` → `admission` →
`registry`, and `membership` → `release` → `registry`; `intake` also uses `groups`, and `registry` none of the
others. Channels, credit, bounds and refusals: docs/TRANSPORT.md and docs/RELIABILITY.md.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from heterorl.config import TransportConfig
from heterorl.transport.learner_io import LearnerIO
from heterorl.transport.protocol import (
    BYE_LEARNER_STOPPING,
    DEFAULT_LIMITS,
    Limits,
    Trajectory,
    TrajectoryContract,
)
from heterorl.transport.registry import WorkerInfo
from heterorl.transport.rooms import Rooms
from heterorl.transport.sockets import CurveConfig, Endpoint, require_security
from heterorl.transport.weights.store import WeightsStore


class LearnerServer(Endpoint):
    """The learner's end: accepts trajectories, tracks workers, publishes weights. Thread-safe public API."""

    def __init__(self, address: str, config: TransportConfig | None = None, curve: CurveConfig | None = None,
                 limits: Limits = DEFAULT_LIMITS, weights_address: str | None = None,
                 weights_delay: Callable[[str], Any] | None = None,
                 settings: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 contract: TrajectoryContract | None = None, published_before: int = -1,
                 shard_ranks: int = 1, shard_ports: list[int] | None = None,
                 model_shapes: dict[str, tuple[int, ...]] | None = None, admission_control: bool = False) -> None:
        """``admission_control``: the learner will hand out admission permits (`set_admission`); until it does,
        a worker that joins may start nothing, rather than everything (told it has no limit, it would start groups
        uncounted, and refused once the limit came, lose them). ``contract``: what every trajectory must satisfy
        to be buffered (`set_contract`); None checks only that frames are well formed. ``published_before``: the
        newest version an earlier learner of this run published (a resumed learner's, docs/RELIABILITY.md "Crash
        and resume"): workers may hold it, so the contract takes trajectories stamped up to it before this server
        publishes anything, and `publish` goes above it. An incomplete group is dropped ``config.group_timeout_s``
        after its first member arrived. ``weights_delay``: `WeightsRelease.schedule_notice`; ``clock``: the
        delays' clock. ``shard_ranks`` > 1: a sharded learner whose ranks each send their own slices
        (heterorl.transport.weights.shards); rank r's weights channel is at ``shard_ports[r - 1]`` (the port it
        bound, on this host), and every worker is told so when it joins; a worker may then declare the slices it
        wants (its hello's ``layout``), checked against ``model_shapes``."""
        self.config = config or TransportConfig()
        self.config.validate()
        require_security(address, curve, self.config, (
            f"refusing plaintext on {address}: give CURVE keys (`heterorl keys`, then --curve-secret/--allow-keys) "
            "or set allow_plaintext=True if this network is trusted"))
        self.limits = limits
        self._rooms = Rooms.build(self.config, curve.allowed_keys_dir if curve else None, contract, published_before,
                                  weights_delay, shard_ranks, shard_ports, model_shapes)
        self.stats = self._rooms.stats
        self._clock = clock
        if admission_control:
            self._rooms.admission.set(0, ahead=1)
        self._io = LearnerIO(self._rooms, address, weights_address, self.config, limits, curve, dict(settings or {}),
                             clock)
        self._io.start()

    @property
    def control_endpoint(self) -> str:
        """The control channel's endpoint, as bound (a port 0 asked for: the one chosen)."""
        return self._io.control_endpoint

    @property
    def weights_endpoint(self) -> str:
        """The weights channel's endpoint, as bound."""
        return self._io.weights_endpoint

    # -- public API (any thread) ------------------------------------------------------------------
    def get_groups(self, max_items: int, timeout_s: float) -> list[list[Trajectory]]:
        """Whole groups in the order they completed, of up to ``max_items`` trajectories in all (the first one
        even if larger); waits up to ``timeout_s`` for the first one. Taking them frees their senders' credit."""
        return self._wait_for(lambda: self._rooms.intake.pop_groups(max_items), timeout_s)

    def get(self, max_items: int, timeout_s: float) -> list[Trajectory]:
        """Up to ``max_items`` trajectories, in the order their groups completed (a group's members together; one
        cut at ``max_items`` comes first in the next call); waits up to ``timeout_s`` for the first one."""
        return self._wait_for(lambda: self._rooms.intake.pop(max_items), timeout_s)

    def _wait_for(self, pop: Callable[[], list], timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        with self._rooms.lock:
            while not self._rooms.intake.queued:
                left = deadline - time.monotonic()
                if left <= 0 or self._io.stopping:
                    return []
                self._rooms.lock.wait(left)
            taken = pop()
        if taken:
            self._io.wake()  # the freed credits go out now, not at the next poll timeout
        return taken

    def buffered(self) -> int:
        """Trajectories accepted and not yet taken: queued, or held until their group is complete."""
        with self._rooms.lock:
            return self._rooms.intake.held

    @property
    def store(self) -> WeightsStore:
        """The whole-model versions published (`WeightsStore`)."""
        return self._rooms.release.store

    @property
    def stores(self) -> dict[str, WeightsStore]:
        """By layout key: a sharded learner's packs for workers that declared their own slices ("": `store`)."""
        return self._rooms.release.stores

    @property
    def shard_ports(self) -> list[int]:
        """A sharded learner's other ranks' weights ports (told to workers in ``ready``)."""
        return self._rooms.release.shard_ports

    @property
    def last_step(self):
        """The newest version's step from the one before it (`EncodedStep`), or None."""
        return self.store.last_step

    @property
    def weights_dtype(self) -> str:
        """The dtype of the published versions' floating-point tensors."""
        return self.store.weights_dtype

    def layouts(self) -> dict[str, dict]:
        """{key: layout} of the live workers that declared their own slices (a sharded learner packs each)."""
        with self._rooms.lock:
            return self._rooms.release.layouts()

    def publish_layout(self, key: str, version: int, state: dict, dtype: torch.dtype | None = None,
                       describe: Callable | None = None) -> None:
        """A sharded learner's pack of ``version`` for the workers of layout ``key``; publish it before the
        whole-model pack of the same version (`publish`, which notifies every worker)."""
        with self._rooms.lock:
            store = self._rooms.release.layout_store(key)
            spare, previous = store.begin(version)
        packed, step = store.pack(state, version, spare, previous, dtype, describe)
        with self._rooms.lock:
            store.add(version, packed, step)

    def publish(self, version: int, state: dict, dtype: torch.dtype | None = None,
                describe: Callable | None = None) -> None:
        """Make ``state`` available as ``version`` (strictly increasing), its floating-point tensors cast to
        ``dtype`` (the workers' inference dtype; None: as they are); workers are notified after their delay.
        The tensors are copied once, into the buffer of a retired version when one is free; with
        ``transport.weights_deltas`` the step from the previous version is encoded here too (`last_step`).
        ``describe(header)``: what a sharded learner's rank 0 adds to the header (`WeightsStore.pack`)."""
        with self._rooms.lock:
            spare, previous = self.store.begin(version)
        packed, step = self.store.pack(state, version, spare, previous, dtype, describe)
        with self._rooms.lock:
            self._rooms.release.add(version, packed, step, self._clock())

    def needed_versions(self) -> set[int]:
        """The versions a worker may still be given: released to it, or noticed and due, or waiting for its
        link (a sharded learner's other ranks keep their slices of these)."""
        with self._rooms.lock:
            return self._rooms.release.needed()

    def set_contract(self, contract: TrajectoryContract | None) -> None:
        """From now on, refuse every trajectory that breaks ``contract`` (None: check only the wire format)."""
        with self._rooms.lock:
            self._rooms.intake.contract = contract

    def set_admission(self, cap: int | None, ahead: int = 1, max_lag: int | None = None) -> None:
        """Admission control (`Admission`): at most ``cap`` groups started in all (None: no limit), ``ahead``
        unused permits per worker, none while its weights lag by more than ``max_lag`` versions (None: any)."""
        with self._rooms.lock:
            self._rooms.admission.set(cap, ahead, max_lag)

    def await_version(self, version: int) -> None:
        """Sync mode: every worker waits for weights ``version`` before it samples again (`Admission.await_version`:
        meanwhile their permits' leases stand still)."""
        with self._rooms.lock:
            self._rooms.admission.await_version(version)

    def advise_local_threads(self, threads: int) -> None:
        """Advise the workers on this machine (their hello named its host) to use ``threads`` torch threads, in
        their next acks (`heterorl train` shares one machine's cores: heterorl.runtime.cores)."""
        with self._rooms.lock:
            self._rooms.admission.local_threads = threads

    def permits_left(self) -> int | None:
        """Groups the fleet may still start under admission control: permits not yet granted plus those its live
        workers hold unused — by their heartbeats' count of permits used, which includes groups still on their
        way (None: no admission control). 0 while the learner waits: the pace holds it back."""
        with self._rooms.lock:
            return self._rooms.admission.permits_left(time.monotonic())

    def admission_state(self) -> str:
        """One line on the admission permits (for a learner that waits long for data)."""
        with self._rooms.lock:
            return self._rooms.admission.state_line(time.monotonic())

    def workers(self) -> list[WorkerInfo]:
        """A snapshot of the worker registry."""
        with self._rooms.lock:
            return self._rooms.registry.snapshot(self._rooms.intake.groups.open_bytes)

    def reward_outcomes(self) -> dict[str, int]:
        """The programs the workers' rewards ran, by outcome (the code task's sandbox: ok, wrong_answer, timeout,
        forbidden:socket, ...), over every worker this server has known, as their latest heartbeats said."""
        with self._rooms.lock:
            return self._rooms.registry.reward_outcomes()

    def fleet_totals(self) -> dict[str, float]:
        """Over every worker this server has known, those removed from the registry included: trajectories
        accepted, duplicates, seconds generating (busy_s) and waiting (idle_s)."""
        with self._rooms.lock:
            return self._rooms.registry.fleet_totals()

    def close(self, reason: str = BYE_LEARNER_STOPPING) -> None:
        """Say bye to every live worker with ``reason`` and stop the I/O thread. `BYE_RUN_FINISHED` ends the
        workers' loops; any other reason (the default) tells them this learner is stopping before the run is
        over, and they keep saying hello until a restarted learner answers."""
        self._io.close(reason)
