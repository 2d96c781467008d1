"""How each policy version leaves the learner: rank 0 publishes the whole weights (or a LoRA adapter alone), or,
when a sharded learner reshards, every rank publishes its own slices on its own weights channel
(heterorl.transport.weights.shards). Each version is written down as the newest published before any worker can
see it (`checkpoints.record_published`), so that a learner resumed from an older checkpoint publishes above it."""

from __future__ import annotations

import time
from pathlib import Path

from heterorl.config import Config
from heterorl.errors import HeteroRLError
from heterorl.runtime.checkpoints import CHECKPOINTS, record_published
from heterorl.transport.weights import wire_dtype_for
from heterorl.transport.weights.reshard import DestLayout
from heterorl.transport.weights.shards import describer, slices_for, slices_of


class Publisher:
    """The learner's publishing, for every rank (``ranks``: the learner's `Ranks`). ``server``: rank 0's
    `LearnerServer`; ``shard_server``: a rank > 0's weights channel when the learner reshards (set by
    `Learner.follow`); ``since_checkpoint``: version → wall time of the versions published since the last
    checkpoint (cleared by each checkpoint, set by a resume)."""

    def __init__(self, cfg: Config, training, ranks, run_dir: str | Path, server=None) -> None:
        self.cfg, self.training, self.ranks, self.server = cfg, training, ranks, server
        self.folder = Path(run_dir) / CHECKPOINTS
        # a sharded learner's every rank sends its own slices of each version
        self.reshard = training is not None and training.sharded and cfg.runtime.weights_fanout == "reshard"
        self.shard_server = None
        self.since_checkpoint: dict[str, float] = {}

    def publish(self, wall_times: dict[str, float]) -> int:
        """Rank 0: publish the next version; its wall time goes into ``wall_times`` (the learner state's
        ``publish_wall_s``). Returns the version."""
        if self.reshard:
            return self._publish_slices(wall_times)
        if self.training.sharded:
            self.ranks.share(("export",))  # every rank takes part in the gather
        adapter = self.training.adapter_meta if self.cfg.lora.publish == "adapter" else None
        version, state = self.training.save_weights_for_sampler("adapter" if adapter else "whole").result()
        self._record(version, wall_times)
        if adapter:  # the adapter alone, stamped with its base (heterorl.training.lora), at its own wire dtype
            dtype = wire_dtype_for(self.cfg.runtime.weights_dtype, state)
            self.server.publish(version, state, dtype=dtype, describe=lambda header: setattr(header, "adapter",
                                                                                                adapter))
        else:
            self.server.publish(version, state, dtype=self._wire_dtype())
        return version

    def publish_own_slices(self, needed: list[int], layouts: dict[str, dict]) -> None:
        """Ranks > 0: this rank's slices of the new version, on its weights channel (bound at setup, its port
        told to rank 0: `launch.bind_shard_channels`), for every layout workers declared and the whole model."""
        rank, world = self.ranks.rank, self.ranks.world
        if self.shard_server is None:
            raise HeteroRLError(f"learner rank {rank} was asked for its slices but has no weights channel: a learner "
                                "that reshards binds one on every rank at setup (heterorl.runtime.launch)")
        version, state = self.training.save_shards_for_sampler().result()
        self.shard_server.keep_layouts(set(layouts))
        for key, layout in layouts.items():
            slices, shapes, boxes = slices_for(state, rank, world, DestLayout.from_dict(layout))
            self.shard_server.publish(version, slices, shapes, boxes, dtype=self._wire_dtype(), needed=set(needed),
                                      layout=key)
        slices, shapes, boxes = slices_of(state, rank, world)
        self.shard_server.publish(version, slices, shapes, boxes, dtype=self._wire_dtype(), needed=set(needed))

    def _publish_slices(self, wall_times: dict[str, float]) -> int:
        """Every rank publishes its own slices of the new version: rank 0 on its weights channel, the others on
        theirs, keeping the versions rank 0 may still release to a worker."""
        layouts = self.server.layouts()  # the slices workers declared (tensor-parallel engines' ranks)
        self.ranks.share(("slices", sorted(self.server.needed_versions()), layouts))
        version, state = self.training.save_shards_for_sampler().result()
        world = self.ranks.world
        for key, layout in layouts.items():  # first: `publish` below notifies every worker
            slices, shapes, boxes = slices_for(state, 0, world, DestLayout.from_dict(layout))
            self.server.publish_layout(key, version, slices, dtype=self._wire_dtype(),
                                       describe=describer(0, world, shapes, boxes))
        slices, shapes, boxes = slices_of(state, 0, world)
        self._record(version, wall_times)
        self.server.publish(version, slices, dtype=self._wire_dtype(), describe=describer(0, world, shapes, boxes))
        return version

    def _wire_dtype(self):
        return wire_dtype_for(self.cfg.runtime.weights_dtype, self.training.model)

    def _record(self, version: int, wall_times: dict[str, float]) -> None:
        """Note when ``version`` was published and write it down as the newest before any worker can see it."""
        wall_s = wall_times[str(version)] = time.time()
        self.since_checkpoint[str(version)] = wall_s
        record_published(self.folder, version, self.since_checkpoint)


__all__ = ["Publisher"]
