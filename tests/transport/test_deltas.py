"""Weights in the inference dtype, sent as deltas: exact after many steps, and every doubtful delta resynced."""

import dataclasses

import numpy as np
import pytest
import torch
import zstandard

from heterorl.config import TransportConfig
from heterorl.transport import LearnerServer, WorkerClient
from heterorl.transport.protocol import ProtocolError, WeightsRequest, decode, encode
from heterorl.transport.weights import pack_state_dict, wire_dtype
from heterorl.transport.weights.deltas import (
    FULL,
    SPARSE,
    SPARSE_ZSTD,
    XOR_ZSTD,
    DeltaChain,
    Layout,
    apply_steps,
    encode_step,
    tensor_checksums,
)
from tests.conftest import wait_until
from tests.transport.test_transport import FAST

BF16 = torch.bfloat16


def master_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 master weights of a small model, with an integer buffer and an empty tensor besides."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(64, 96, generator=gen) * 0.05 for i in range(4)}
    state.update({"norm.weight": torch.ones(96), "positions": torch.arange(10), "empty": torch.zeros(0)})
    return state


def random_walk(state: dict, gen: torch.Generator, lr: float) -> None:
    """One optimizer-like step: every float element moves by about ``lr`` (Adam's first steps are ±lr)."""
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.add_(torch.randn(tensor.shape, generator=gen) * lr)


def packed(state: dict, version: int) -> np.ndarray:
    return pack_state_dict(state, version, dtype=BF16).buffer


def test_fifty_random_walk_steps_through_deltas_stay_bit_equal_to_the_cast_of_the_master():
    state, gen, rng = master_state(), torch.Generator().manual_seed(1), np.random.default_rng(2)
    layout = Layout.of(pack_state_dict(state, 0, dtype=BF16).header)
    chain, previous = DeltaChain(), packed(state, 0)
    held, held_version, applied = previous.copy(), 0, 0
    for version in range(1, 51):
        random_walk(state, gen, lr=2e-5)
        current = packed(state, version)
        chain.add(version, encode_step(layout, previous, current, version - 1, version), len(current))
        if rng.random() < 0.5 or version == 50:  # the worker fetches now and then: payloads of 1 to several steps
            out = np.empty_like(held)
            apply_steps(layout, held, held_version, chain.payload(held_version, version), version, out,
                        tensor_checksums(layout, current))
            held, held_version, applied = out, version, applied + 1
        previous = current
    cast = {k: v.to(BF16) if v.is_floating_point() else v for k, v in state.items()}
    assert applied > 10 and np.array_equal(held, pack_state_dict(cast, 50).buffer)
    assert chain.bytes_between(49, 50) < len(current) / 2  # most bf16 elements did not change in one step


def test_each_tensor_takes_the_cheapest_encoding_measured():
    gen = torch.Generator().manual_seed(0)
    old = {"few": torch.randn(4096, generator=gen), "smooth": torch.randn(4096, generator=gen),
           "some": torch.randn(4096, generator=gen),
           "noise": torch.randint(-128, 128, (8192,), dtype=torch.int8, generator=gen),
           "same": torch.randn(4096, generator=gen)}
    new = {k: v.clone() for k, v in old.items()}
    new["few"][[3, 1000, 4000]] += 1.0  # three elements: a sparse patch
    new["some"][::20] += 0.1  # one in twenty: gap-coded indices and the XORs, compressed
    new["smooth"] += 1e-2 * new["smooth"].abs()  # most elements, a few low bits each: XOR + zstd
    new["noise"] = torch.randint(-128, 128, (8192,), dtype=torch.int8, generator=gen)  # random bits: whole
    a, b = pack_state_dict(old, 0, dtype=BF16), pack_state_dict(new, 1, dtype=BF16)
    layout = Layout.of(a.header)
    step = encode_step(layout, a.buffer, b.buffer, 0, 1)
    assert step.methods == {"sparse": 1, "sparse_zstd": 1, "xor_zstd": 1, "full": 1}  # "same" has no record
    by_name = {a.header.names[r["tensor"]]: int(r["method"]) for r in _record_table(step.blob)}
    assert by_name == {"few": SPARSE, "some": SPARSE_ZSTD, "smooth": XOR_ZSTD, "noise": FULL}
    assert step.method_bytes["sparse_zstd"] < 205 * (4 + 2) / 2  # under half the bytes of a plain sparse patch
    out = np.empty_like(a.buffer)
    apply_steps(layout, a.buffer, 0, step.blob, 1, out, tensor_checksums(layout, b.buffer))
    assert np.array_equal(out, b.buffer)
    assert step.method_bytes["sparse"] == 3 * 6 and step.method_bytes["full"] == 8192


def _one_step(lr: float = 1e-3):
    """(layout, old bytes, new bytes, the step's blob, the new checksums) of one random-walk step."""
    state = master_state()
    old = packed(state, 0)
    random_walk(state, torch.Generator().manual_seed(3), lr)
    new = packed(state, 1)
    layout = Layout.of(pack_state_dict(state, 1, dtype=BF16).header)
    return layout, old, new, encode_step(layout, old, new, 0, 1).blob, tensor_checksums(layout, new)


def _record_table(blob: np.ndarray) -> np.ndarray:
    count = int(blob[16:20].view("<u4")[0])
    return blob[20:20 + 21 * count].view([("tensor", "<u4"), ("method", "u1"), ("count", "<u8"), ("nbytes", "<u8")])


def _corrupt(case: str, blob: np.ndarray) -> np.ndarray:
    blob = blob.copy()
    table = _record_table(blob)
    data_start = 20 + 21 * len(table)
    if case == "flipped_bit":  # a bit in the middle of the data: decodes, but a tensor comes out wrong
        blob[data_start + (len(blob) - data_start) // 2] ^= 0x10
    elif case == "truncated":
        blob = blob[:-7]
    elif case == "truncated_zstd":  # a zstd frame cut short, its record shortened to match
        i = int(np.flatnonzero(table["method"] == XOR_ZSTD)[0])
        at = data_start + int(table["nbytes"][:i].sum())
        cut = int(table["nbytes"][i]) // 2
        blob = np.concatenate([blob[:at + cut], blob[at + int(table["nbytes"][i]):]])
        _record_table(blob)["nbytes"][i] = cut
    elif case == "element_count":  # a record for more elements than its tensor has
        _record_table(blob)["count"][0] += 1
    elif case == "bad_magic":
        blob[:4] = np.frombuffer(b"XXXX", np.uint8)
    elif case == "unknown_tensor":
        _record_table(blob)["tensor"][0] = 999
    return blob


@pytest.mark.parametrize("case, reason", [
    ("flipped_bit", {"delta_checksum", "delta_zstd", "delta_count"}), ("truncated", {"delta_truncated"}),
    ("truncated_zstd", {"delta_zstd", "delta_count"}), ("element_count", {"delta_count"}),
    ("bad_magic", {"delta_corrupt"}), ("unknown_tensor", {"delta_corrupt"}),
])
def test_a_corrupted_delta_is_refused_with_its_reason_and_the_held_bytes_stay_intact(case, reason):
    layout, old, new, blob, checksums = _one_step(lr=3e-3)  # a step dense enough to have an XOR record
    assert XOR_ZSTD in _record_table(blob)["method"]
    kept = old.copy()
    with pytest.raises(ProtocolError) as info:
        apply_steps(layout, old, 0, _corrupt(case, blob), 1, np.empty_like(old), checksums)
    assert info.value.reason in reason
    assert np.array_equal(old, kept)  # the worker still has the version it held


def test_a_delta_from_another_version_or_to_another_version_is_refused():
    layout, old, new, blob, checksums = _one_step()
    out = np.empty_like(old)
    for held, target in ((3, 1), (0, 2)):
        with pytest.raises(ProtocolError) as info:
            apply_steps(layout, old, held, blob, target, out, checksums)
        assert info.value.reason == "delta_base"
    apply_steps(layout, old, 0, blob, 1, out, checksums)
    assert np.array_equal(out, new)


def test_the_chain_keeps_at_most_one_versions_bytes_and_a_gap_means_no_payload():
    layout, old, new, blob, _ = _one_step()
    chain = DeltaChain(max_steps=4)
    step = encode_step(layout, old, new, 0, 1)
    for version in range(1, 8):
        chain.add(version, dataclasses.replace(step), full_bytes=3 * len(step.blob))
    assert chain.bytes_between(4, 7) == 3 * len(step.blob) and chain.bytes_between(3, 7) is None
    assert chain.payload(3, 7) is None and len(chain.payload(5, 7)) == 2 * len(step.blob)
    chain.add(9, dataclasses.replace(step), full_bytes=3 * len(step.blob))  # version 8 never came: a new chain
    assert chain.bytes_between(7, 9) is None and chain.bytes_between(8, 9) == len(step.blob)


def test_weights_dtype_auto_is_bf16_from_ten_million_parameters():
    assert wire_dtype("auto", 9_999_999) == torch.float32 and wire_dtype("auto", 10_000_000) == BF16
    assert wire_dtype("float32", 10**9) == torch.float32
    with pytest.raises(ValueError, match="weights_dtype"):
        wire_dtype("int8", 1)


def test_a_delta_header_round_trips_and_one_without_checksums_is_refused():
    header = pack_state_dict(master_state(), 3, chunk_bytes=1000, dtype=BF16).header
    delta = dataclasses.replace(header, base_version=2, payload_bytes=2500, num_chunks=3, checksums=[7] * 7)
    assert decode(encode(delta)) == delta
    assert decode(encode(header)).transfer_bytes == header.total_bytes  # a full header, as earlier learners send
    with pytest.raises(ProtocolError, match="checksums"):
        decode(encode(dataclasses.replace(delta, checksums=[])))
    with pytest.raises(ProtocolError, match="num_chunks"):
        decode(encode(dataclasses.replace(delta, num_chunks=2)))
    request = WeightsRequest("w", have_version=2, delta_base=2)
    assert decode(encode(request)) == request


# -- over real sockets ------------------------------------------------------------------------------------

SMALL_CHUNKS = TransportConfig(**{**FAST.__dict__, "weights_chunk_bytes": 4096})


def _cast(state: dict) -> dict:
    return {k: v.to(BF16) if v.is_floating_point() else v.clone() for k, v in state.items()}


def _equal(got: dict, state: dict) -> bool:
    want = _cast(state)
    return set(got) == set(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
                                         for k in want)


@pytest.fixture
def server():
    learner = LearnerServer("tcp://127.0.0.1:0", SMALL_CHUNKS)
    yield learner
    learner.close()


def _client(server, worker_id: str) -> WorkerClient:
    client = WorkerClient(server.control_endpoint, worker_id, SMALL_CHUNKS)
    client.wait_ready(10)
    return client


def _publish_and_fetch(server, client, state, gen, versions, lr=2e-5):
    for version in versions:
        random_walk(state, gen, lr)
        server.publish(version, state, dtype=BF16)
        got = client.wait_weights(version - 1, timeout_s=10)
        assert got is not None and got[0] == version
    return got[1]


def test_a_worker_gets_one_snapshot_then_deltas_bit_equal_to_the_cast_and_a_late_joiner_likewise(server):
    state, gen = master_state(), torch.Generator().manual_seed(4)
    early = _client(server, "early")
    try:
        got = _publish_and_fetch(server, early, state, gen, range(1, 6))
        assert _equal(got, state)
        assert (early.stats["weights/full_received"], early.stats["weights/deltas_applied"]) == (1, 4)
        full_bytes = server.store.versions[5].header.total_bytes
        assert early.stats["weights/bytes_received"] < full_bytes + 4 * full_bytes / 2
        late = _client(server, "late")  # joins at version 5: a snapshot first, never a delta from nothing
        try:
            assert _equal(late.wait_weights(-1, timeout_s=10)[1], state)
            got = _publish_and_fetch(server, late, state, gen, range(6, 9))
            assert _equal(got, state)
            assert (late.stats["weights/full_received"], late.stats["weights/deltas_applied"]) == (1, 3)
        finally:
            late.close()
    finally:
        early.close()


def test_a_restarted_worker_starts_from_a_snapshot(server):
    state, gen = master_state(), torch.Generator().manual_seed(5)
    first = _client(server, "w")
    _publish_and_fetch(server, first, state, gen, range(1, 4))
    first.close()
    again = _client(server, "w")  # same id, new process: it holds nothing
    try:
        assert _equal(again.wait_weights(-1, timeout_s=10)[1], state)
        _publish_and_fetch(server, again, state, gen, range(4, 6))
        assert (again.stats["weights/full_received"], again.stats["weights/deltas_applied"]) == (1, 2)
    finally:
        again.close()


def _sabotage(server, how):
    """Make the server's next delta payload go wrong ``how`` (once)."""
    original, done = server.store.delta_payload, []

    def wrapped(base, released):
        found = original(base, released)
        if found is None or done:
            return found
        done.append(True)
        server.store.payloads[(base, released.header.version)] = bad = how(found)  # what the chunk requests read
        return bad
    server.store.delta_payload = wrapped
    return done


def _in_transit(found):  # a chunk whose checksum no longer matches: the worker's decoder refuses it
    found.chunk_checksum(0)
    found.checksums[0] ^= 1
    return found


def _in_payload(found):  # bytes changed before checksumming: only the rebuilt tensors' checksums catch it
    from heterorl.transport.weights import PackedWeights
    payload = found.buffer.copy()
    payload[len(payload) // 2] ^= 0x40
    return PackedWeights(found.header, payload)


def _wrong_base(found):  # a delta from a version the worker does not hold
    return dataclasses.replace(found, header=dataclasses.replace(found.header, base_version=found.header.version - 2))


@pytest.mark.parametrize("how, reason", [(_in_transit, "rejected/checksum"),
                                         (_in_payload, "weights/rejected/delta_"),
                                         (_wrong_base, "weights/rejected/delta_base")])
def test_a_bad_delta_is_counted_and_answered_by_a_full_resync(server, how, reason):
    state, gen = master_state(), torch.Generator().manual_seed(6)
    client = _client(server, "w")
    try:
        _publish_and_fetch(server, client, state, gen, range(1, 4))
        done = _sabotage(server, how)
        got = _publish_and_fetch(server, client, state, gen, [4])
        assert done and _equal(got, state)  # the resync's snapshot, exact
        assert client.stats["weights/resyncs"] == 1 and client.stats["weights/full_received"] == 2
        assert sum(n for k, n in client.stats.items() if k.startswith(reason)) == 1
        got = _publish_and_fetch(server, client, state, gen, [5])  # and deltas resume from the snapshot
        assert _equal(got, state) and client.stats["weights/deltas_applied"] == 3
    finally:
        client.close()


def test_a_slow_link_carries_the_delta_not_the_whole_version():
    sizes = []
    server = LearnerServer("tcp://127.0.0.1:0", SMALL_CHUNKS,
                           weights_delay=lambda wid: (lambda t, size: sizes.append(size) or t))
    try:
        client = _client(server, "w")
        state, gen = master_state(), torch.Generator().manual_seed(7)
        _publish_and_fetch(server, client, state, gen, range(1, 4))
        full = server.store.versions[3].header.total_bytes
        chain = server.store.chain
        assert sizes[0] == full and all(s == chain.bytes_between(v - 1, v) for s, v in zip(sizes[1:], (2, 3)))
        assert max(sizes[1:]) < full / 2
        client.close()
    finally:
        server.close()


def test_with_deltas_off_every_version_travels_whole():
    config = TransportConfig(**{**SMALL_CHUNKS.__dict__, "weights_deltas": False})
    server = LearnerServer("tcp://127.0.0.1:0", config)
    client = WorkerClient(server.control_endpoint, "w", config)
    try:
        client.wait_ready(10)
        state, gen = master_state(), torch.Generator().manual_seed(8)
        got = _publish_and_fetch(server, client, state, gen, range(1, 4))
        assert _equal(got, state) and client.stats["weights/full_received"] == 3
        assert "weights/deltas_applied" not in client.stats and server.last_step is None
    finally:
        client.close()
        server.close()


def test_zstd_frames_claiming_more_than_their_tensor_are_refused_before_decompressing():
    layout = Layout((0,), (8,), (2,), 8)
    head = np.array([(b"HRWD", 1, 0, 1, 1)], [("magic", "S4"), ("format", "<u4"), ("base", "<i4"), ("target", "<i4"),
                                               ("records", "<u4")]).view(np.uint8)
    bomb = np.frombuffer(zstandard.ZstdCompressor().compress(bytes(1 << 20)), np.uint8)
    record = np.array([(0, XOR_ZSTD, 4, len(bomb))], [("tensor", "<u4"), ("method", "u1"), ("count", "<u8"),
                                                      ("nbytes", "<u8")]).view(np.uint8)
    with pytest.raises(ProtocolError) as info:
        apply_steps(layout, np.zeros(8, np.uint8), 0, np.concatenate([head, record, bomb]), 1, np.empty(8, np.uint8),
                    [0])
    assert info.value.reason == "delta_count"


@pytest.mark.parametrize("deltas", [False, True])
def test_a_bandwidth_limited_link_sends_only_the_newest_of_the_versions_published_while_it_was_busy(deltas):
    """Virtual clock: each whole version takes 10 s on the link. Versions 2 and 3 are published while version 1
    is on the wire: only 3 follows it (a worker fetches the newest version released to it), costing the steps
    from 1 to 3 with deltas, the whole version without."""
    from heterorl.config import LinkDelayConfig
    from heterorl.delay.links import DelayLink

    config = TransportConfig(**{**SMALL_CHUNKS.__dict__, "weights_deltas": deltas})
    state, gen, clock = master_state(), torch.Generator().manual_seed(9), [0.0]
    full = len(pack_state_dict(state, 0, dtype=BF16).buffer)
    link = DelayLink(LinkDelayConfig(kind="constant", constant_s=0.0, bandwidth_bytes_per_s=full / 10), "w/weights")
    server = LearnerServer("tcp://127.0.0.1:0", config, weights_delay=lambda wid: link, clock=lambda: clock[0])
    client = WorkerClient(server.control_endpoint, "w", config)
    try:
        client.wait_ready(10)
        for version, at in ((1, 0.0), (2, 1.0), (3, 2.0)):
            clock[0] = at
            random_walk(state, gen, 2e-5)
            server.publish(version, state, dtype=BF16)
        clock[0] = 10.0  # version 1 has arrived; version 3 starts
        assert client.wait_weights(-1, timeout_s=10)[0] == 1
        step_bytes = server.store.chain.bytes_between(1, 3)
        assert link.free_at == pytest.approx(10.0 + (step_bytes if deltas else full) / (full / 10))
        assert client.wait_weights(1, timeout_s=0.5) is None  # not before it has crossed the link
        clock[0] = 20.0
        version, got = client.wait_weights(1, timeout_s=10)
        assert version == 3 and _equal(got, state) and link.sent == 2  # version 2 never crossed the link
        assert client.stats["weights/deltas_applied"] == (1 if deltas else 0)
    finally:
        client.close()
        server.close()


def test_tied_weights_travel_once_and_arrive_as_one_tensor_under_both_names(server):
    embedding = torch.randn(50, 8)
    state = {"embed.weight": embedding, "head.weight": embedding, "norm.weight": torch.ones(8)}
    packed_state = pack_state_dict(state, 0, dtype=BF16)
    assert packed_state.header.names == ["embed.weight", "norm.weight"]
    assert packed_state.header.aliases == [["head.weight", "embed.weight"]]
    assert packed_state.header.total_bytes == (50 * 8 + 8) * 2
    client = _client(server, "w")
    try:
        gen = torch.Generator().manual_seed(10)
        got = _publish_and_fetch(server, client, state, gen, range(1, 3))  # the random walk moves the one tensor
        assert got["head.weight"] is got["embed.weight"] and _equal(got, state)
        assert client.stats["weights/deltas_applied"] == 1
    finally:
        client.close()


def test_an_alias_must_name_a_tensor_and_be_new():
    header = pack_state_dict({"a": torch.zeros(2), "b": torch.ones(2)}, 0).header
    assert decode(encode(dataclasses.replace(header, aliases=[["c", "a"]]))).aliases == [["c", "a"]]
    for bad in ([["c", "x"]], [["b", "a"]], [["c", "a"], ["c", "b"]], [["c"]]):
        with pytest.raises(ProtocolError, match="aliases"):
            decode(encode(dataclasses.replace(header, aliases=bad)))


def test_a_training_clients_export_keeps_tied_weights_one_tensor():
    from heterorl.policies.tiny import build_tiny_policy
    from heterorl.training.session import TrainingClient

    model, tokenizer = build_tiny_policy("0123456789+=")
    model.lm_head.weight = model.get_input_embeddings().weight  # tie them
    training = TrainingClient(model, tokenizer)
    _, state = training.save_weights_for_sampler().result()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert len(pack_state_dict(state, 1).header.aliases) == 1


@pytest.mark.parametrize("gaps, why", [([3, 0, 2], "an index given twice"), ([3, 2, 4000], "past the tensor")])
def test_a_sparse_zstd_record_with_indices_that_repeat_or_run_past_the_tensor_is_refused(gaps, why):
    layout = Layout((0,), (2 * 100,), (2,), 200)
    head = np.array([(b"HRWD", 1, 0, 1, 1)], [("magic", "S4"), ("format", "<u4"), ("base", "<i4"), ("target", "<i4"),
                                               ("records", "<u4")]).view(np.uint8)
    data = np.frombuffer(zstandard.ZstdCompressor().compress(
        np.concatenate([np.array(gaps, "<u4").view(np.uint8), np.ones(3, "<u2").view(np.uint8)]).tobytes()), np.uint8)
    record = np.array([(0, SPARSE_ZSTD, 3, len(data))], [("tensor", "<u4"), ("method", "u1"), ("count", "<u8"),
                                                         ("nbytes", "<u8")]).view(np.uint8)
    with pytest.raises(ProtocolError) as info:
        apply_steps(layout, np.zeros(200, np.uint8), 0, np.concatenate([head, record, data]), 1,
                    np.empty(200, np.uint8), [0])
    assert info.value.reason == "delta_count", why


def test_resyncs_that_keep_failing_back_off_and_the_version_comes_once_the_link_is_sound(server):
    """A link that corrupts every transfer: the first resync asks at once, each later one waits twice as long as
    the one before (0.5 s, 1 s, ...); once the transfers are sound again the worker gets the version, exact."""
    state, gen = master_state(), torch.Generator().manual_seed(8)
    client = _client(server, "w")
    try:
        random_walk(state, gen, 2e-5)
        server.publish(1, state, dtype=BF16)
        packed = server.store.versions[1]
        packed.header.checksums[0] ^= 1  # every transfer of version 1 now fails verification
        try:
            wait_until(lambda: client.stats["weights/resyncs"] >= 3, 30, lambda: dict(client.stats))
        finally:
            packed.header.checksums[0] ^= 1  # sound again
        got = client.wait_weights(0, timeout_s=30)
        assert got is not None and got[0] == 1 and _equal(got[1], state)
        resyncs = client.stats["weights/resyncs"]
        assert client.stats["weights/resync_backoffs"] == resyncs - 1 >= 2  # all but the first waited
        assert client.stats["weights/rejected/checksum"] == resyncs
    finally:
        client.close()
