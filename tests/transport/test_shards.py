"""A sharded learner's fan-out over real sockets: every rank serves its own slices, a worker assembles whole
versions from all of them (deltas per rank included), never a mix of two, and keeps its version when a rank is
gone or a slice does not fit."""

import dataclasses
import time

import pytest
import torch

from heterorl.config import TransportConfig
from heterorl.transport import LearnerServer, WorkerClient
from heterorl.transport.protocol import ProtocolError, decode, encode
from heterorl.transport.weights import pack_state_dict
from heterorl.transport.weights.reshard import SourceLayout
from heterorl.transport.weights.shards import ShardServer, describer
from tests.conftest import wait_until
from tests.transport.test_deltas import BF16, _cast, _equal, master_state, random_walk
from tests.transport.test_transport import FAST

CONFIG = TransportConfig(**{**FAST.__dict__, "weights_chunk_bytes": 4096, "fetch_timeout_s": 1.0})
WORLD = 3


def cut(state: dict, rank: int, world: int = WORLD) -> tuple[dict, dict, dict]:
    """Rank ``rank``'s slices of ``state`` as FSDP2 holds them (dim-0 chunks; 0-dim and empty tensors: rank 0)."""
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    layout = SourceLayout.fsdp(shapes, world)
    slices, full, boxes = {}, {}, {}
    for name, tensor in state.items():
        box = layout.box(name, shapes[name], rank)
        if tensor.numel() == 0 or any(b <= a for a, b in box):
            if rank == 0 and tensor.numel() == 0:
                slices[name], full[name], boxes[name] = tensor, shapes[name], box
            continue
        slices[name] = tensor[tuple(slice(a, b) for a, b in box)]
        full[name], boxes[name] = shapes[name], box
    return slices, full, boxes


class Fleet:
    """Rank 0's `LearnerServer` (told of WORLD ranks) and a `ShardServer` per other rank."""

    def __init__(self, address: str = "tcp://127.0.0.1:0", weights_address: str | None = None,
                 published_before: int = -1, config: TransportConfig = CONFIG) -> None:
        # the other ranks bind free ports first, and rank 0 is told them (as `launch.bind_shard_channels` does)
        self.shards = {r: ShardServer("tcp://127.0.0.1:0", r, WORLD, CONFIG) for r in range(1, WORLD)}
        ports = [int(self.shards[r].endpoint.rsplit(":", 1)[1]) for r in range(1, WORLD)]
        shapes = {name: tuple(t.shape) for name, t in master_state().items()}
        self.server = LearnerServer(address, config, weights_address=weights_address, shard_ranks=WORLD,
                                    shard_ports=ports, model_shapes=shapes, published_before=published_before)
        assert self.server.shard_ports == ports

    def publish(self, version: int, state: dict, ranks=range(WORLD)) -> None:
        for rank in ranks:
            slices, full, boxes = cut(state, rank)
            if rank == 0:
                self.server.publish(version, slices, dtype=BF16, describe=describer(0, WORLD, full, boxes))
            else:
                self.shards[rank].publish(version, slices, full, boxes, dtype=BF16,
                                          needed=self.server.needed_versions())

    def publish_for(self, version: int, state: dict, layout) -> None:
        """Every rank's pieces of ``version`` for the workers of ``layout`` (before `publish` notifies them)."""
        from heterorl.transport.weights.reshard import layout_key, plan, take

        shapes = {name: tuple(t.shape) for name, t in state.items()}
        pieces = plan(shapes, SourceLayout.fsdp(shapes, WORLD), {"w": layout})
        for rank in range(WORLD):
            owned = cut(state, rank)[0]
            mine = pieces.pieces_from(rank).get("w", [])
            slices = {p.name: take(owned[p.name], p) for p in mine}
            full = {p.name: shapes[p.name] for p in mine}
            boxes = {p.name: p.global_box for p in mine}
            if rank == 0:
                self.server.publish_layout(layout_key(layout), version, slices, dtype=BF16,
                                           describe=describer(0, WORLD, full, boxes))
            else:
                self.shards[rank].publish(version, slices, full, boxes, dtype=BF16, layout=layout_key(layout))

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()
        self.server.close()


@pytest.fixture
def fleet():
    made = Fleet()
    yield made
    made.close()


def _client(fleet: Fleet, worker_id: str = "w") -> WorkerClient:
    client = WorkerClient(fleet.server.control_endpoint, worker_id, CONFIG)
    client.wait_ready(10)
    return client


def _client_on_version_1(fleet: Fleet, state: dict) -> WorkerClient:
    """A worker that holds version 1 of ``state``, assembled from every rank."""
    client = _client(fleet)
    fleet.publish(1, state)
    assert client.wait_weights(0, timeout_s=10)[0] == 1
    return client


def test_a_worker_assembles_every_ranks_slices_into_the_whole_model_then_takes_deltas(fleet):
    state, gen = master_state(), torch.Generator().manual_seed(1)
    client = _client(fleet)
    try:
        for version in range(1, 6):
            random_walk(state, gen, 2e-5)
            fleet.publish(version, state)
            got = client.wait_weights(version - 1, timeout_s=10)
            assert got is not None and got[0] == version
            assert _equal(got[1], state)  # bit-equal to the bf16 cast of the whole master
        assert client.stats["weights/shard_versions_assembled"] == 5
        assert client.stats["weights/deltas_applied"] >= 4 * WORLD - 1  # every rank's later versions as steps
        whole = pack_state_dict(_cast(state), 5).header.total_bytes
        sent = fleet.server.stats["weights/bytes_sent"] + sum(s.stats["weights/bytes_sent"]
                                                                for s in fleet.shards.values())
        assert fleet.server.stats["weights/bytes_sent"] < 0.6 * sent < whole  # rank 0 sent only its share
    finally:
        client.close()


def test_a_version_is_loaded_only_once_every_rank_has_sent_it_never_a_mix(fleet):
    state, gen = master_state(), torch.Generator().manual_seed(2)
    client = _client(fleet)
    try:
        fleet.publish(1, state)
        assert client.wait_weights(0, timeout_s=10)[0] == 1
        random_walk(state, gen, 1e-2)
        fleet.publish(2, state, ranks=[0, 1])  # rank 2 has not published version 2 yet
        assert client.wait_weights(1, timeout_s=1.5) is None  # so the worker stays on version 1
        assert client.stats["weights/shard_not_ready"] > 0
        fleet.publish(2, state, ranks=[2])
        got = client.wait_weights(1, timeout_s=10)
        assert got[0] == 2 and _equal(got[1], state)
    finally:
        client.close()


def test_a_rank_that_is_gone_leaves_the_worker_on_its_version_and_is_named(fleet):
    state = master_state()
    client = _client_on_version_1(fleet, state)
    try:
        fleet.shards.pop(2).close()  # rank 2 dies before version 2
        random_walk(state, torch.Generator().manual_seed(3), 1e-2)
        fleet.publish(2, state, ranks=[0, 1])
        deadline = time.monotonic() + 10
        while not client.stats["weights/shard_timeouts/2"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats["weights/shard_timeouts/2"] >= 1
        assert client.wait_weights(1, timeout_s=0.5) is None  # the worker stays on version 1
        assert client.stats["weights/shard_versions_assembled"] == 1
    finally:
        client.close()


def test_a_worker_follows_a_restarted_learner_whose_ranks_bound_other_ports(fleet):
    state = master_state()
    client = _client_on_version_1(fleet, state)
    try:
        old_ports = fleet.server.shard_ports
        control, weights = fleet.server.control_endpoint, fleet.server.weights_endpoint
        fleet.close()  # the learner stops; a resumed one binds rank 0's addresses again, its other ranks new ports
        fleet.__init__(control, weights, published_before=1)
        assert fleet.server.shard_ports != old_ports
        random_walk(state, torch.Generator().manual_seed(4), 1e-2)
        fleet.publish(2, state)
        got = client.wait_weights(1, timeout_s=15)
        assert got is not None and got[0] == 2 and _equal(got[1], state)
    finally:
        client.close()


def test_a_learner_that_reshards_must_be_told_its_ranks_ports():
    with pytest.raises(ValueError, match=r"ports of ranks 1..2 \(shard_ports\)"):
        LearnerServer("tcp://127.0.0.1:0", CONFIG, shard_ranks=3, shard_ports=[5000])


def test_slices_that_do_not_tile_the_model_are_refused_and_fetched_whole_again(fleet):
    state = master_state()
    client = _client(fleet)
    try:
        slices, full, boxes = cut(state, 1)
        name = "layer0.weight"  # rank 1 claims rank 0's rows of one tensor: two ranks for the same elements
        wrong = {**boxes, name: ((0, boxes[name][0][1] - boxes[name][0][0]),) + boxes[name][1:]}
        fleet.publish(1, state, ranks=[0, 2])
        fleet.shards[1].publish(1, slices, full, wrong, dtype=BF16)
        deadline = time.monotonic() + 10
        while not client.stats["weights/rejected/duplicate"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats["weights/rejected/duplicate"] >= 1
        assert client.latest_weights() is None  # nothing half-assembled was loaded
    finally:
        client.close()


def test_a_header_whose_boxes_do_not_fit_its_slices_is_refused_by_the_decoder():
    slices, full, boxes = cut(master_state(), 1)
    header = pack_state_dict(slices, 1).header
    describer(1, WORLD, full, boxes)(header)
    assert decode(encode(header)).boxes == header.boxes
    bad = dataclasses.replace(header, boxes=[[[0, 1]] + box[1:] for box in header.boxes])
    with pytest.raises(ProtocolError, match="boxes"):
        decode(encode(bad))
    with pytest.raises(ProtocolError, match="shard"):
        decode(encode(dataclasses.replace(header, shard=[])))  # boxes without a shard
    with pytest.raises(ProtocolError, match="shard"):
        decode(encode(dataclasses.replace(header, shard=[3, 3])))


def test_a_worker_that_was_not_told_of_other_ranks_never_loads_one_ranks_slices():
    server = LearnerServer("tcp://127.0.0.1:0", CONFIG)  # (told of no other ranks)
    client = WorkerClient(server.control_endpoint, "w", CONFIG)
    try:
        client.wait_ready(10)
        slices, full, boxes = cut(master_state(), 0)
        server.publish(1, slices, dtype=BF16, describe=describer(0, WORLD, full, boxes))
        deadline = time.monotonic() + 10
        while not client.stats["weights/rejected/shard"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats["weights/rejected/shard"] >= 1 and client.latest_weights() is None
    finally:
        client.close()
        server.close()


def test_a_worker_declares_the_slices_it_wants_in_its_hello_and_a_malformed_layout_is_refused():
    from heterorl.transport.protocol import Hello
    from heterorl.transport.weights.reshard import DestLayout, Placement, layout_key

    wanted = DestLayout({"layer0.weight": (Placement.shard(1, 4), 2)})
    hello = decode(encode(Hello("w", "host", 1, layout=wanted.to_dict())))
    assert DestLayout.from_dict(hello.layout) == wanted
    assert decode(encode(Hello("w", "host", 1))).layout == {}  # absent: the whole model
    assert layout_key(DestLayout()) == "" and len(layout_key(wanted)) == 16
    assert layout_key(wanted) == layout_key(DestLayout.from_dict(hello.layout))
    with pytest.raises(ProtocolError, match="layout.*parts 0"):
        decode(encode(Hello("w", "host", 1, layout={"a": {"kind": "shard", "dim": 0, "parts": 0, "index": 0}})))
    with pytest.raises(ProtocolError, match="layout"):
        decode(encode(Hello("w", "host", 1, layout={"a": {"kind": "diagonal"}})))


def test_a_worker_that_declares_its_slices_gets_exactly_those_from_every_rank(fleet):
    from heterorl.transport.weights.reshard import DestLayout, Placement

    layout = DestLayout({f"layer{i}.weight": (Placement.shard(1, 2), 1) for i in range(4)})
    tp = WorkerClient(fleet.server.control_endpoint, "tp1", CONFIG, layout=layout)
    whole = _client(fleet, "whole")
    state, gen = master_state(), torch.Generator().manual_seed(5)
    try:
        tp.wait_ready(10)
        assert fleet.server.layouts() == {tp.layout_key: layout.to_dict()}
        for version in (1, 2):
            random_walk(state, gen, 1e-2)
            fleet.publish_for(version, state, layout)
            fleet.publish(version, state)
            got = tp.wait_weights(version - 1, timeout_s=10)
            assert got is not None and got[0] == version
            cast = _cast(state)
            for name, tensor in got[1].items():
                want = cast[name][:, 48:] if name.startswith("layer") else cast[name]
                assert tensor.shape == want.shape and torch.equal(tensor, want), name
            assert _equal(whole.wait_weights(version - 1, timeout_s=10)[1], state)  # the others: whole
    finally:
        tp.close()
        whole.close()


def test_the_packs_of_a_layout_go_when_its_last_worker_leaves_the_registry():
    from heterorl.transport.weights.reshard import DestLayout, Placement

    fleet = Fleet(config=dataclasses.replace(CONFIG, worker_expiry_s=1.0))
    layout = DestLayout({f"layer{i}.weight": (Placement.shard(1, 2), 0) for i in range(4)})
    tp = WorkerClient(fleet.server.control_endpoint, "tp0", CONFIG, layout=layout)
    state = master_state()
    try:
        tp.wait_ready(10)
        fleet.publish_for(1, state, layout)
        fleet.publish(1, state)
        assert tp.wait_weights(0, timeout_s=10)[0] == 1
        assert set(fleet.server.stores) == {"", tp.layout_key}
        tp.close()
        wait_until(lambda: fleet.server.stats["workers_removed/expired"], 30, "the worker to leave the registry")
        fleet.publish(2, state)
        assert set(fleet.server.stores) == {""}  # its newest pack too, which trimming alone keeps
        fleet.shards[1].keep_layouts(set(fleet.server.layouts()))  # what a rank > 0 does before it publishes
        assert set(fleet.shards[1].stores) == {""}
    finally:
        tp.close()
        fleet.close()


def test_a_layout_that_does_not_fit_the_model_is_refused_with_the_reason(fleet):
    from heterorl.transport.weights.reshard import DestLayout, Placement

    bad = WorkerClient(fleet.server.control_endpoint, "tp-bad", CONFIG,
                       layout=DestLayout({"layer0.weight": (Placement.shard(1, 5), 0)}))  # 96 columns: not by 5
    try:
        assert bad.finished.wait(10)
        assert "does not fit the model" in bad.refused and "5 equal parts" in bad.refused
    finally:
        bad.close()
