"""What has reached the live learner and waits to be trained (`LearnerInbox`).

An ingest thread moves whole groups from the `LearnerServer` into the staleness-aware `GroupBuffer` while the
learner trains, so workers get their credits back at once; a full buffer (``buffer.max_groups``) stops the
pulling, and the data then waits in the transport, whose credits hold the workers back (back-pressure). The ids
of every trajectory trained are kept here (one that arrives again, after a restart, is dropped: none is trained
twice), with the per-engine tallies, under the one lock the buffer is read under. The learner's wait for its next
batch is here too, with its exits: a stop, a dead ingest thread, a fleet silent for ``runtime.worker_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from heterorl.config import Config
from heterorl.errors import HeteroRLError
from heterorl.runtime.buffer import Group, GroupBuffer, sampling_order
from heterorl.runtime.engine_stats import FleetEngines
from heterorl.transport import LearnerServer

log = logging.getLogger("heterorl.runtime.learner")


class LearnerInbox:
    """The buffer of a live learner, fed by its ingest thread (`start`, `stop`), read by `next_batch`; ``lock``
    guards the buffer, the trained ids and the engine tallies."""

    def __init__(self, cfg: Config, server: LearnerServer, stopped_by: Callable[[], str]) -> None:
        """``stopped_by``: why the learner is stopping ("": it is not); a wait for a batch ends when it is set."""
        self.cfg, self.server, self._stopped_by = cfg, server, stopped_by
        self.buffer = GroupBuffer(cfg.buffer)
        self.lock = threading.Condition()
        self.trained: set[str] = set()  # the keys of every trajectory trained (a resumed learner's from its checkpoint)
        self.dropped_trained = 0  # trajectories that arrived after being trained (before a restart): never twice
        self.engines = FleetEngines(lambda: self.server.workers())  # tallies by engine
        self.starved = False  # during the last wait for a batch the fleet could start no group (out of permits)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._ingest, name="heterorl-learner-ingest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def mark_trained(self, groups: list[Group]) -> None:
        with self.lock:
            for g in groups:
                self.trained.update(t.key for t in g.trajectories)

    def _ingest(self) -> None:
        try:
            self._ingest_loop()
        except BaseException as exc:  # surfaced by next_batch: a learner must not wait on a dead thread
            self._error = exc
            with self.lock:
                self.lock.notify_all()

    def _ingest_loop(self) -> None:
        cfg = self.cfg
        while not self._stop.is_set():
            with self.lock:
                room = cfg.buffer.max_groups - len(self.buffer)
            if room <= 0:
                self._stop.wait(0.01)
                continue
            arrived = self.server.get_groups(room * cfg.rollout.group_size, timeout_s=0.05)  # whole groups
            now = time.monotonic()
            with self.lock:
                for group in arrived:
                    fresh = [traj for traj in group if traj.key not in self.trained]
                    self.dropped_trained += len(group) - len(fresh)  # already trained before a restart: never twice
                    for traj in fresh:
                        self.engines.tally(traj.sampler_id).received += 1
                    if len(fresh) == len(group):
                        self.buffer.add_group(fresh, now)
                    elif fresh:  # (groups are trained whole: the rest of one trained in part can never complete)
                        self.buffer.count_unassembled("partial", len(fresh))
                self.lock.notify_all()

    def next_batch(self, version: int) -> tuple[list[Group] | None, float]:
        """Block until the buffer policy hands out a batch: (the batch, or None when a stop was requested
        meanwhile; the seconds waited)."""
        cfg = self.cfg
        silent_since, waiting_since, reported = None, time.monotonic(), 0
        self.starved = False
        with self.lock:
            while True:
                groups = self.buffer.take(cfg.rl.prompts_per_step, version)
                if groups is not None:
                    if cfg.runtime.mode == "sync":  # one seed, one result: sums run in the same order every run
                        groups.sort(key=sampling_order)
                    return groups, time.monotonic() - waiting_since
                if self._stopped_by():
                    return None, time.monotonic() - waiting_since
                if self._error is not None:
                    raise HeteroRLError(f"the learner's ingest thread failed: {self._error!r}")
                self.lock.wait(0.05)
                self.starved = self.starved or self.server.permits_left() == 0
                now = time.monotonic()
                if now - waiting_since > 30 * (reported + 1):
                    reported += 1
                    alive = sum(w.alive for w in self.server.workers())
                    log.info("waiting %.0f s for a batch of %d groups at version %d: %d groups buffered, %d "
                             "trajectories at the transport, %d live workers, %s", now - waiting_since,
                             cfg.rl.prompts_per_step, version, len(self.buffer), self.server.buffered(), alive,
                             self.server.admission_state())
                if any(w.alive for w in self.server.workers()):
                    silent_since = None
                elif silent_since is None:
                    silent_since = now
                elif now - silent_since > cfg.runtime.worker_timeout_s:
                    raise HeteroRLError(
                        f"no live rollout worker for {cfg.runtime.worker_timeout_s:.0f} s and no data; "
                        f"start workers with `heterorl rollout --connect {self.server.control_endpoint}`")


__all__ = ["LearnerInbox"]
