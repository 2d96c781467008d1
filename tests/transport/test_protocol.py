"""Wire protocol: every message round-trips; every malformed frame is one ProtocolError naming the field; the
trajectory contract names every trajectory that breaks it."""

import dataclasses
import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterorl.errors import HeteroRLError
from heterorl.transport.protocol import (
    BYE_RUN_FINISHED,
    BYE_WORKER_FAILED,
    DEFAULT_LIMITS,
    MIN_LOGPROB,
    SCHEMA_VERSION,
    Ack,
    BatchExtremes,
    Breach,
    Bye,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    Ready,
    Trajectory,
    TrajectoryBatch,
    TrajectoryContract,
    WeightsChunk,
    WeightsNotice,
    WeightsRequest,
    chunk_checksum,
    decode,
    encode,
)
from heterorl.transport.weights import pack_state_dict, unpack_state_dict
from tests.conftest import trajectory


def header_of(message) -> dict:
    return msgpack.unpackb(encode(message)[0], raw=False)


def frames_of(body: dict) -> list[bytes]:
    return [msgpack.packb(body, use_bin_type=True)]


def rejects(frames, field, reason=None, limits=DEFAULT_LIMITS):
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    assert info.value.field == field, str(info.value)
    if reason:
        assert info.value.reason == reason, str(info.value)
    assert f"`{field}`" in str(info.value)
    return info.value


def test_trajectory_round_trip_keeps_every_stamp():
    sent = trajectory()
    got = decode(encode(sent))
    assert isinstance(got, Trajectory)
    for name in ("trajectory_id", "group_id", "prompt_id", "sampler_id", "group_size", "reward",
                 "generation_start", "generation_end", "sent_at", "stop_reason"):
        assert getattr(got, name) == getattr(sent, name)
    for name in ("prompt_tokens", "completion_tokens", "behaviour_logprobs", "policy_versions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))
    assert got.policy_versions.tolist() == [3, 3, 4]  # one trajectory may span a weight update


def test_arrays_are_little_endian_raw_buffers_and_decoded_as_views():
    body = header_of(trajectory())
    assert body["v"] == SCHEMA_VERSION and body["kind"] == "trajectory"
    assert body["completion_tokens"] == np.array([9, 10, 1], dtype="<i4").tobytes()
    got = decode(encode(trajectory()))
    assert not got.behaviour_logprobs.flags.owndata  # a view of the received buffer, not a copy


@pytest.mark.parametrize("message", [
    Hello("w0", "host-a", 123, 4, 1.5),
    Hello("w1", "host-b", 9, -1, 2.5, engine="vllm"),
    Ready("w0", credits=64, newest_version=3, heartbeat_interval_s=1.0, settings={"weights_port": 5556, "x": "y"}),
    Heartbeat("w0", 7, 2.0, 3.5, 0.25),
    Heartbeat("w0", 7, 2.0, 3.5, 0.25, groups_started=40),
    Heartbeat("w0", 7, 2.0, 3.5, 0.25, groups_started=40, reward_outcomes={"ok": 3, "forbidden:socket": 1}),
    Ack(["a", "b"], ["c: bad"], 70, 12),
    Ack(["a"], [], 70, 12, threads=2),
    Heartbeat("w0", 7, 2.0, 3.5, 0.25, groups_started=40, weights_arrived=3, weights_arrival_s=1.5,
              weights_arrival_max_s=0.75),
    WeightsNotice(9),
    WeightsNotice(9, published_at=1.7e9),
    WeightsRequest("w0", have_version=3, version=9, chunk=2),
    Bye("w0", "shutting down"),
])
def test_control_messages_round_trip(message):
    assert decode(encode(message)) == message


def test_fields_added_since_the_schema_may_be_left_out_by_an_earlier_peer():
    beat = header_of(Heartbeat("w0", 1, 2.0, groups_started=5))
    del beat["groups_started"]  # a worker of an earlier version: its permits used are not reported
    assert decode([msgpack.packb(beat)]).groups_started == -1
    rejects([msgpack.packb(beat | {"groups_started": -2})], "groups_started", "bounds")
    assert "reward_outcomes" not in beat  # none to tell: left out, so that a learner of an earlier version takes it
    assert decode([msgpack.packb(beat)]).reward_outcomes == {}
    assert "weights_arrived" not in beat  # none timed yet: left out too
    rejects([msgpack.packb(beat | {"weights_arrived": -1})], "weights_arrived", "bounds")
    rejects([msgpack.packb(beat | {"weights_arrival_s": float("nan")})], "weights_arrival_s", "not_finite")
    notice = header_of(WeightsNotice(4, published_at=1.7e9))
    del notice["published_at"]  # a learner of an earlier version: the worker does not time that version
    assert decode([msgpack.packb(notice)]).published_at == 0.0
    ack = header_of(Ack(["a"], [], 3, 4, threads=2))
    del ack["threads"]  # a learner of an earlier version advises nothing
    assert decode([msgpack.packb(ack)]).threads == 0
    rejects([msgpack.packb(ack | {"threads": 10**6})], "threads", "bounds")


def test_a_heartbeats_reward_outcomes_are_a_short_map_of_names_to_counts():
    beat = header_of(Heartbeat("w0", 1, 2.0))
    for outcomes, culprit, reason in (([1], "reward_outcomes", "type"), ({"ok": -1}, "reward_outcomes.ok", "bounds"),
                                      ({"ok": 1.5}, "reward_outcomes.ok", "type"),
                                      ({"a reason": 1}, "reward_outcomes key", "bounds"),
                                      ({"x" * 65: 1}, "reward_outcomes key", "bounds"),
                                      ({f"r{i}": 1 for i in range(65)}, "reward_outcomes", "too_large")):
        rejects([msgpack.packb(beat | {"reward_outcomes": outcomes})], culprit, reason)


def test_a_hello_without_an_engine_is_a_torch_workers_and_a_bad_engine_is_named():
    body = header_of(Hello("w0", "h", 1, -1, 1.0, engine="vllm"))
    del body["engine"]  # a worker of an earlier version
    assert decode([msgpack.packb(body)]).engine == "torch"
    rejects([msgpack.packb(body | {"engine": "v llm"})], "engine", "bounds")
    rejects([msgpack.packb(body | {"engine": 3})], "engine", "type")


def test_a_worker_that_failed_says_so_in_its_bye():
    assert decode(encode(Bye("w0", f"{BYE_WORKER_FAILED}weights do not fit"))).failed
    assert not Bye("w0", "done").failed and not Bye("learner", BYE_RUN_FINISHED).failed


def test_id_lists_are_checked_in_bulk_and_the_culprit_named():
    body = header_of(Ack(["a", "b", "c"], [], 3, -1))
    for accepted, culprit, reason in ((["a", 5, "c"], "accepted[1]", "type"), (["a", "b", ""], "accepted[2]", "bounds"),
                                      (["x" * 257, "b"], "accepted[0]", "bounds")):
        rejects([msgpack.packb(body | {"accepted": accepted})], culprit, reason)
    assert decode([msgpack.packb(body | {"accepted": ["a" * 256]})]).accepted == ["a" * 256]


def test_weights_round_trip_through_chunks_with_checksums():
    state = {"w": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int64),
             "h": torch.randn(4, 4).to(torch.bfloat16), "m": torch.tensor([True, False])}
    packed = pack_state_dict(state, version=5, chunk_bytes=1000)
    header = decode(encode(packed.header))
    assert header == packed.header and header.num_chunks == math.ceil(header.total_bytes / 1000) > 1
    buffer = bytearray(header.total_bytes)
    for i in range(header.num_chunks):
        data = packed.chunk(i)
        chunk = decode(encode(WeightsChunk(5, i, chunk_checksum(data), data)))
        assert chunk.data.obj is data.obj  # the chunk frame is viewed, not copied
        buffer[i * 1000:i * 1000 + len(chunk.data)] = chunk.data
    got = unpack_state_dict(header, buffer)
    assert set(got) == set(state)
    for name in state:
        assert got[name].dtype == state[name].dtype and torch.equal(got[name], state[name])


def test_corrupted_weights_fail_their_checksums():
    packed = pack_state_dict({"w": torch.ones(100)}, version=1, chunk_bytes=128)
    data = bytearray(packed.chunk(0))
    checksum = chunk_checksum(data)
    data[3] ^= 0xFF
    rejects(encode(WeightsChunk(1, 0, checksum, bytes(data))), "data", "checksum")
    assert packed.chunk_checksum(0) == checksum and packed.chunk_checksum(1) == chunk_checksum(packed.chunk(1))
    with pytest.raises(ProtocolError, match="total_bytes"):
        unpack_state_dict(packed.header, bytearray(packed.header.total_bytes - 1))


def test_unsupported_tensor_dtype_is_named():
    with pytest.raises(ValueError, match="complex64"):
        pack_state_dict({"z": torch.zeros(2, dtype=torch.complex64)}, version=1)


# -- malformed frames ------------------------------------------------------------------------

def test_frame_level_garbage_is_rejected():
    rejects([b"\x00\x01garbage"], "frame", "malformed")
    rejects([msgpack.packb([1, 2, 3])], "frame", "malformed")
    rejects([encode(trajectory())[0][:-5]], "frame", "malformed")  # truncated msgpack
    rejects([], "frame", "malformed")
    rejects([*encode(Heartbeat("w0")), b"extra"], "frame", "malformed")


def test_schema_version_kind_and_fields_are_checked():
    body = header_of(Heartbeat("w0", 1, 2.0))
    rejects(frames_of(body | {"v": SCHEMA_VERSION + 1}), "v", "schema_version")
    rejects(frames_of({k: v for k, v in body.items() if k != "v"}), "v", "schema_version")
    rejects(frames_of(body | {"kind": "pickle"}), "kind", "unknown_kind")
    rejects(frames_of({k: v for k, v in body.items() if k != "version_held"}), "version_held", "missing_field")
    rejects(frames_of(body | {"sneaky": 1}), "sneaky", "unknown_field")
    rejects(frames_of(body | {"version_held": "7"}), "version_held", "type")
    rejects(frames_of(body | {"version_held": True}), "version_held", "type")
    rejects(frames_of(body | {"sent_at": float("nan")}), "sent_at", "not_finite")
    rejects(frames_of(body | {"sender_id": "w0; rm -rf"}), "sender_id", "bounds")
    rejects(frames_of(body | {"sender_id": "x" * 500}), "sender_id", "bounds")


@pytest.mark.parametrize("field, value, reason", [
    ("behaviour_logprobs", np.array([-0.1, np.nan, -1], dtype="<f4").tobytes(), "not_finite"),
    ("behaviour_logprobs", np.array([-0.1, -np.inf, -1], dtype="<f4").tobytes(), "not_finite"),
    ("behaviour_logprobs", np.array([-0.1, 0.5, -1], dtype="<f4").tobytes(), "bounds"),
    ("behaviour_logprobs", np.array([-0.1, -1], dtype="<f4").tobytes(), "length_mismatch"),
    ("policy_versions", np.array([1, 1, 1, 1], dtype="<i4").tobytes(), "length_mismatch"),
    ("policy_versions", np.array([1, -1, 1], dtype="<i4").tobytes(), "bounds"),
    ("completion_tokens", b"\x01\x02\x03", "length"),  # not a whole int32
    ("completion_tokens", b"", "length"),
    ("prompt_tokens", np.array([1, 2**25], dtype="<i4").tobytes(), "bounds"),
    ("prompt_tokens", np.array([-3], dtype="<i4").tobytes(), "bounds"),
    ("prompt_tokens", [1, 2, 3], "type"),
    ("reward", float("inf"), "not_finite"),
    ("reward", 1e9, "bounds"),
    ("reward", "1.0", "type"),
    ("group_size", 0, "bounds"),
    ("generation_end", 9.0, "bounds"),  # before generation_start
])
def test_trajectory_fields_are_validated(field, value, reason):
    rejects(frames_of(header_of(trajectory()) | {field: value}), field, reason)


def test_size_limits_apply_before_allocation():
    limits = Limits(max_tokens=16, max_header_bytes=4096)
    big = trajectory(completion_tokens=np.zeros(20, np.int32), behaviour_logprobs=np.zeros(20, np.float32),
                     policy_versions=np.zeros(20, np.int32))
    rejects(encode(big), "completion_tokens", "too_large", limits)
    rejects([b"\x00" * 5000], "frame", "too_large", limits)


def test_weights_header_consistency_is_checked():
    header = header_of(pack_state_dict({"w": torch.ones(10)}, version=2, chunk_bytes=16).header)
    rejects(frames_of(header | {"total_bytes": 41}), "total_bytes", "length_mismatch")
    rejects(frames_of(header | {"num_chunks": 2}), "num_chunks", "length_mismatch")
    rejects(frames_of(header | {"dtypes": ["complex64"]}), "dtypes[0]", "bounds")
    rejects(frames_of(header | {"shapes": [[10], [3]]}), "shapes", "length_mismatch")
    rejects(frames_of(header | {"chunk_bytes": 0}), "chunk_bytes", "bounds")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_raise_anything_but_protocol_error(data):
    try:
        decode([data])
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_frames_decode_or_fail_cleanly(data):
    frame = bytearray(encode(trajectory())[0])
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    try:
        message = decode([bytes(frame)])
    except ProtocolError:
        return
    # anything that still decodes passed every check
    assert isinstance(message, Trajectory)
    assert np.isfinite(message.behaviour_logprobs).all()
    assert len(message.behaviour_logprobs) == len(message.completion_tokens) == len(message.policy_versions)


def batch_frames(n: int = 3) -> list:
    return encode(TrajectoryBatch([trajectory(trajectory_id=f"t{i}", completion_tokens=np.arange(i + 1, dtype=np.int32),
                                              behaviour_logprobs=np.full(i + 1, -0.5, np.float32),
                                              policy_versions=np.full(i + 1, i, np.int32)) for i in range(n)]))


def test_a_batch_carries_its_arrays_in_one_frame_and_decodes_to_views():
    frames = batch_frames(3)
    assert len(frames) == 2  # header + the prompt, completion, log-prob and version arrays of all three
    assert len(memoryview(frames[1])) == 4 * (3 * 4 + 3 * (1 + 2 + 3))  # 4 prompt tokens each, 1..3 completion
    got = decode([bytes(memoryview(f)) for f in frames])
    assert [t.trajectory_id for t in got.trajectories] == ["t0", "t1", "t2"]
    assert [t.completion_tokens.tolist() for t in got.trajectories] == [[0], [0, 1], [0, 1, 2]]
    assert got.trajectories[2].policy_versions.tolist() == [2, 2, 2]
    assert got.trajectories[1].prompt_tokens.tolist() == [5, 6, 7, 8]
    assert not got.trajectories[1].behaviour_logprobs.flags.owndata  # views of the received frames


def test_a_batch_is_validated_as_a_whole_and_names_the_entry():
    header = msgpack.unpackb(batch_frames(3)[0], raw=False)
    data = bytes(memoryview(batch_frames(3)[1]))

    def with_header(**changes):
        return [msgpack.packb(header | changes, use_bin_type=True), data]

    rejects(with_header(reward=[1.0, float("nan"), 0.0]), "reward[1]", "not_finite")
    rejects(with_header(trajectory_id=["t0", "t 1", "t2"]), "trajectory_id[1]", "bounds")
    rejects(with_header(completion_len=[1, 2]), "completion_len", "length_mismatch")
    rejects(with_header(completion_len=[1, 2, 4]), "data", "length_mismatch")
    rejects(with_header(completion_len=[1, 0, 5]), "completion_len[1]", "bounds")  # bulk checks fall back to
    rejects(with_header(prompt_len=[4, True, 4]), "prompt_len[1]", "type")  # name the entry; no bool for int
    rejects(with_header(group_size=[4, 4.0, 4]), "group_size[1]", "type")
    rejects(with_header(trajectory_id=[]), "trajectory_id", "type")
    rejects(with_header()[:1], "frame", "malformed")  # the data frame missing
    rejects([*with_header(), data], "frame", "malformed")  # one too many
    rejects([with_header()[0], data[:-4]], "data", "length_mismatch")
    words = np.frombuffer(data, "<i4").copy()
    logprobs = words[12 + 6:12 + 12].view("<f4")  # after 3 x 4 prompt tokens and 6 completion tokens
    logprobs[1] = np.nan
    rejects(with_header()[:1] + [words.tobytes()], "behaviour_logprobs", "not_finite")
    logprobs[1] = 0.5
    rejects(with_header()[:1] + [words.tobytes()], "behaviour_logprobs", "bounds")
    logprobs[1] = -0.5
    versions = words[12 + 12:]
    versions[0] = -1
    rejects(with_header()[:1] + [words.tobytes()], "policy_versions", "bounds")


# -- the trajectory contract ------------------------------------------------------------------------
# conftest's trajectory: 4 prompt tokens (ids 5..8), 3 completion tokens (ids 9, 10, 1), log-probs down to -2.5,
# versions 3 and 4, group_size 8: 7 tokens in all
CONTRACT = TrajectoryContract(vocab_size=12, max_sequence_len=8, group_size=8)
NEWEST = 4


def received(*trajectories) -> TrajectoryBatch:
    """``trajectories`` as the learner receives them: encoded as one batch and decoded."""
    batch = TrajectoryBatch([dataclasses.replace(t, trajectory_id=f"t{i}") for i, t in enumerate(trajectories)])
    return decode([bytes(memoryview(f)) for f in encode(batch)])


def long_trajectory(prompt_len: int, completion_len: int):
    """A trajectory of ``prompt_len`` + ``completion_len`` tokens, every id inside a vocabulary of 12."""
    return trajectory(prompt_tokens=np.full(prompt_len, 5, np.int32),
                      completion_tokens=np.full(completion_len, 9, np.int32),
                      behaviour_logprobs=np.full(completion_len, -0.5, np.float32),
                      policy_versions=np.full(completion_len, 3, np.int32))


def test_a_batch_within_the_contract_is_passed_on_its_extremes_alone(monkeypatch):
    batch = received(trajectory(), trajectory(completion_len=4, version=NEWEST), trajectory(version=0))
    assert batch.extremes() == BatchExtremes.of(batch.trajectories)  # the decoder kept what its checks reduced
    assert batch.extremes().sequence_len_max == 8 and batch.extremes().version_max == NEWEST
    monkeypatch.setattr(BatchExtremes, "of", lambda *_: pytest.fail("went through the trajectories one by one"))
    assert CONTRACT.breaches(batch, NEWEST) == []
    # at every bound exactly, still within it
    edge = TrajectoryContract(vocab_size=11, max_sequence_len=8, min_logprob=-2.5, group_size=8)
    assert edge.breaches(batch, NEWEST) == []


@pytest.mark.parametrize("changes, reason, words", [
    ({"version": NEWEST + 1}, "version_ahead", ["policy_versions", "version 5 > 4"]),
    ({"version": 1001}, "version_ahead", ["policy_versions", "version 1001 > 4"]),
    ({"completion_tokens": np.array([9, 12, 1], np.int32)}, "token_out_of_vocab",
     ["completion_tokens", "token id 12 >= vocab_size 12"]),
    ({"prompt_tokens": np.array([5, 6, 7, 100], np.int32)}, "token_out_of_vocab",
     ["prompt_tokens", "token id 100 >= vocab_size 12"]),
    ({"completion_len": 5}, "too_long", ["prompt_tokens + completion_tokens", "9 tokens > max_sequence_len 8"]),
    (long_trajectory(8192, 8192), "too_long", ["16384 tokens > max_sequence_len 8"]),
    ({"behaviour_logprobs": np.array([-0.1, -1e30, -0.01], np.float32)}, "logprob_below_floor",
     ["behaviour_logprobs", "-1e+30 < min_logprob -50"]),
    ({"behaviour_logprobs": np.array([-0.1, -50.5, -0.01], np.float32)}, "logprob_below_floor",
     ["-50.5 < min_logprob -50"]),
    ({"group_size": 64}, "group_too_large", ["group_size 64 > 8"]),
])
def test_each_bound_of_the_contract_names_the_trajectory_the_field_the_value_and_the_bound(changes, reason, words):
    bad = changes if isinstance(changes, Trajectory) else trajectory(**changes)
    batch = received(trajectory(), bad, trajectory(version=0))
    (breach,) = CONTRACT.breaches(batch, NEWEST)
    assert (breach.index, breach.reason) == (1, reason)
    for word in words:
        assert word in breach.message, breach.message
    assert CONTRACT.breaches(TrajectoryBatch([bad]), NEWEST) == [Breach(0, reason, breach.message)]  # unsent too


def test_the_contract_reports_every_offender_and_the_first_bound_each_breaks():
    batch = received(trajectory(version=9, group_size=64), trajectory(), trajectory(group_size=64),
                     trajectory(completion_tokens=np.array([50, 51, 52], np.int32)))
    assert [(b.index, b.reason) for b in CONTRACT.breaches(batch, NEWEST)] == [
        (0, "version_ahead"), (2, "group_too_large"), (3, "token_out_of_vocab")]
    # nothing published yet: no version is known, so every trajectory is ahead
    assert {b.reason for b in CONTRACT.breaches(received(trajectory(version=0)), -1)} == {"version_ahead"}


def test_negative_versions_break_the_contract_even_where_the_decoder_is_not_asked():
    batch = TrajectoryBatch([trajectory(version=-2)])  # the decoder refuses this; a hand-made batch may hold it
    assert [(b.reason, b.message) for b in CONTRACT.breaches(batch, NEWEST)] == [
        ("version_negative", "policy_versions holds version -2 < 0")]


def test_any_group_size_is_taken_without_a_bound_and_the_contract_travels_as_settings():
    assert TrajectoryContract(12, 8).breaches(received(trajectory(group_size=64)), NEWEST) == []
    settings = CONTRACT.settings()
    assert settings == {"contract.vocab_size": 12, "contract.max_sequence_len": 8,
                        "contract.min_logprob": MIN_LOGPROB, "contract.group_size": 8}
    assert TrajectoryContract.from_settings(decode(encode(Ready("w0", 1, 0, 1.0, settings))).settings) == CONTRACT
    assert TrajectoryContract.from_settings({"config": "..."}) is None
    for bad in ({"vocab_size": 0}, {"max_sequence_len": 2.5}, {"min_logprob": 0.0}, {"min_logprob": float("-inf")},
                {"group_size": 0}):
        with pytest.raises(HeteroRLError, match=next(iter(bad))):
            TrajectoryContract(**({"vocab_size": 12, "max_sequence_len": 8} | bad))


def test_an_episodes_environment_spans_travel_with_it_and_a_single_turn_batch_carries_none():
    episode = trajectory(completion_len=9, env_spans=(2, 5, 7, 9))
    single = trajectory(completion_len=3)
    assert "env_spans" not in header_of(TrajectoryBatch([single]))  # the single-turn wire is unchanged
    got = decode([bytes(memoryview(f)) for f in encode(TrajectoryBatch([single, episode]))])
    assert [t.env_spans for t in got.trajectories] == [(), (2, 5, 7, 9)]
    assert got.trajectories[1].policy_mask().tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert got.trajectories[1].policy_token_count == 4
    assert decode(encode(episode)).env_spans == (2, 5, 7, 9)
    body = header_of(single)
    del body["env_spans"]  # a sender of an earlier release: single-turn
    assert decode(frames_of(body)).env_spans == ()


@pytest.mark.parametrize("spans, words", [
    ([2, 5, 7], "pairs"), ([0, 2], "must start with a policy token"), ([2, 5, 5, 7], "strictly increasing"),
    ([2, 2], "strictly increasing"), ([2, 10], "past the completion's 9 tokens"), ([1.5, 3], "integers"),
    ("2,5", "list of integers"), ([1, 2] * 1025, "exceed the limit 2048"),
])
def test_environment_spans_that_do_not_match_the_completion_are_refused_with_the_reason(spans, words):
    body = header_of(trajectory(completion_len=9))
    error = rejects(frames_of(body | {"env_spans": spans}), "env_spans")
    assert words in str(error)
    frames = encode(TrajectoryBatch([trajectory(completion_len=9), trajectory(completion_len=9)]))
    header = msgpack.unpackb(frames[0], raw=False) | {"env_spans": [[], spans]}
    error = rejects([msgpack.packb(header, use_bin_type=True), bytes(memoryview(frames[1]))], "env_spans[1]")
    assert words in str(error)
