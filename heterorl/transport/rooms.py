"""The rooms of the learner's end, made and wired together in one place (`Rooms`), with the one lock that guards
them all: `LearnerServer`'s public methods and its I/O thread (`LearnerIO`) both take it before they touch a room.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from heterorl.config import TransportConfig
from heterorl.transport.admission import Admission
from heterorl.transport.intake import Intake
from heterorl.transport.membership import Membership
from heterorl.transport.protocol import TrajectoryContract
from heterorl.transport.registry import Rejections, WorkerRegistry
from heterorl.transport.throttle import PeerThrottle
from heterorl.transport.weights.release import WeightsRelease


@dataclass
class Rooms:
    """Who is connected (`registry`), what comes in (`intake`), how much may start (`admission`), which weights go
    out (`release`), refusals counted per connection (`throttle`), a worker's joins and departures over them all
    (`membership`); ``stats`` counts for all, ``reject`` counts and logs a refusal. Not thread-safe: hold ``lock``."""

    lock: threading.Condition
    stats: Counter
    reject: Rejections
    registry: WorkerRegistry
    admission: Admission
    intake: Intake
    release: WeightsRelease
    throttle: PeerThrottle
    membership: Membership

    @classmethod
    def build(cls, config: TransportConfig, allowed_keys_dir: str | None, contract: TrajectoryContract | None,
              published_before: int, weights_delay: Callable[[str], Any] | None, shard_ranks: int,
              shard_ports: list[int] | None, model_shapes: dict[str, tuple[int, ...]] | None) -> Rooms:
        """The rooms for one server (`LearnerServer` documents the arguments)."""
        stats: Counter = Counter()
        reject = Rejections(stats)
        registry = WorkerRegistry(config, stats, allowed_keys_dir)
        admission = Admission(registry, config, stats)
        intake = Intake(config, stats, registry, admission, reject, contract)
        release = WeightsRelease(config, stats, registry, published_before, weights_delay, shard_ranks, shard_ports,
                                 model_shapes)
        throttle = PeerThrottle(config.max_refusals_per_s, config.throttle_s, config.throttles_before_disconnect)
        membership = Membership(config, registry, intake, admission, release, reject, throttle)
        return cls(threading.Condition(), stats, reject, registry, admission, intake, release, throttle, membership)
