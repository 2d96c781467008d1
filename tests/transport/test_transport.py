"""ZeroMQ transport on real loopback sockets: flow control, weights, CURVE, fuzzing, a SIGKILLed worker."""

import dataclasses
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from heterorl.config import TransportConfig
from heterorl.errors import ConfigError
from heterorl.transport import CurveConfig, LearnerServer, TransportTimeout, WorkerClient, make_keypair
from heterorl.transport.admission import permit_share
from heterorl.transport.protocol import (
    SCHEMA_VERSION,
    Heartbeat,
    Hello,
    Limits,
    Ready,
    Trajectory,
    TrajectoryBatch,
    decode,
    encode,
)
from tests.conftest import ENV, trajectory, wait_until

FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, credits_per_worker=8, linger_ms=0)


def traj(worker: str, i: int, n: int = 3, size: int = 1) -> Trajectory:
    """Trajectory ``i`` of ``worker``: in groups of ``size`` (the learner passes a group on once it is whole:
    by default each trajectory is one), ``n`` completion tokens, version 0."""
    return trajectory(trajectory_id=f"{worker}-{i}", group_id=f"{worker}-g{i // size}", sampler_id=worker,
                      group_size=size, completion_len=n, version=0, reward=float(i % 2), sent_at=0.0)


@pytest.fixture
def learner():
    server = LearnerServer("tcp://127.0.0.1:0", FAST)
    yield server
    server.close()


@pytest.fixture
def worker(learner):
    client = WorkerClient(learner.control_endpoint, "w0", FAST)
    client.wait_ready(10)
    yield client
    client.close()


def test_trajectories_arrive_stamped_in_order(learner, worker):
    for i in range(6):
        worker.send(traj("w0", i), timeout_s=5)
    got = []
    while len(got) < 6:
        got += learner.get(6, timeout_s=5)
    assert [t.trajectory_id for t in got] == [f"w0-{i}" for i in range(6)]
    assert all(t.received_at >= t.sent_at > 0 for t in got)
    [info] = learner.workers()
    assert (info.worker_id, info.trajectories, info.alive) == ("w0", 6, True)


def test_reused_send_buffers_never_mix_up_trajectories(learner, worker):
    """The worker writes each batch into a recycled buffer: every trajectory must still arrive exactly."""
    rng = np.random.default_rng(0)
    sent, got = {}, []
    consumer = threading.Thread(target=lambda: [got.extend(learner.get(64, timeout_s=0.5)) for _ in range(40)
                                                if len(got) < 300], daemon=True)
    consumer.start()  # the learner consumes while the worker sends, so credit keeps coming back
    for i in range(300):
        n = int(rng.integers(1, 200))
        t = Trajectory(f"w0-{i}", f"g{i // 4}", "p", "w0", 4, rng.integers(0, 50, int(rng.integers(1, 50))),
                       rng.integers(0, 50, n), -rng.random(n), np.full(n, i % 7, dtype=np.int32), 1.0, 1.0, 2.0)
        sent[t.trajectory_id] = t
        worker.send(t, timeout_s=5)
    consumer.join(30)
    assert sorted(t.trajectory_id for t in got) == sorted(sent)
    for t in got:
        want = sent[t.trajectory_id]
        for name in ("prompt_tokens", "completion_tokens", "policy_versions"):
            assert np.array_equal(getattr(t, name), getattr(want, name)), (t.trajectory_id, name)
        assert np.allclose(t.behaviour_logprobs, want.behaviour_logprobs.astype(np.float32))
    # at most 8 trajectories in flight (credit), so 300 took dozens of messages: nearly all reused a buffer
    assert worker._send_buffers.allocated <= 8


def test_send_buffers_are_reused_only_once_zeromq_is_done_with_them():
    import zmq

    from heterorl.transport.client import _SendBuffers

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        pool = _SendBuffers(keep=2)
        first = pool.take(1 << 20)
        frame = zmq.Frame(first, copy=False, track=True)
        push.send(frame, copy=False)
        pool.sent(first, zmq.MessageTracker(frame))
        assert len(pull.recv(copy=False).buffer) == 1 << 20
        del frame
        tracker = pool._busy[0][1]
        tracker.wait(5)
        assert pool.take(1000) is first  # released by ZeroMQ: reused, even for a smaller batch
        second = pool.take(1000)
        assert second is not first and len(second) >= 1000  # the first is out again: a new one
        pool.unused(second)
        pool.unused(first)
        assert pool.take(1 << 21) is not first  # nothing big enough: a new buffer
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_a_slow_learner_applies_back_pressure_instead_of_dropping(learner, worker):
    for i in range(FAST.credits_per_worker):
        worker.send(traj("w0", i), timeout_s=5)
    with pytest.raises(TransportTimeout, match="no credit"):
        worker.send(traj("w0", 99), timeout_s=0.5)
    wait_until(lambda: learner.buffered() == FAST.credits_per_worker, 5, "a full credit's trajectories buffered")
    assert len(learner.get(3, timeout_s=1)) == 3  # consuming frees three credits
    for i in range(3):
        worker.send(traj("w0", 100 + i), timeout_s=5)
    wait_until(lambda: learner.buffered() == FAST.credits_per_worker, 5, "a full credit's trajectories buffered")
    assert learner.stats["accepted"] == FAST.credits_per_worker + 3 and learner.stats["rejected"] == 0


def test_send_many_queues_a_group_in_order_and_says_how_far_it_got_on_back_pressure(learner, worker):
    group = [traj("w0", i) for i in range(FAST.credits_per_worker + 4)]
    with pytest.raises(TransportTimeout, match="no credit") as info:
        worker.send_many(group, timeout_s=1.0)
    assert info.value.done == FAST.credits_per_worker  # the credit window went out; resend from there
    got = []
    while len(got) < FAST.credits_per_worker:
        got += learner.get(100, timeout_s=5)
    rest = group[info.value.done:]
    assert worker.send_many(rest, timeout_s=5) == len(rest)  # consuming freed the credits
    while len(got) < len(group):
        got += learner.get(100, timeout_s=5)
    assert [t.trajectory_id for t in got] == [t.trajectory_id for t in group]
    assert learner.stats["rejected"] == 0 and worker.send_many([], timeout_s=0.1) == 0


def test_the_consumer_takes_whole_groups_within_a_trajectory_count(learner, worker):
    """`get_groups` hands out whole groups, oldest first, of at most ``max_items`` trajectories in all (the first
    one whole even when larger); `get` cuts at ``max_items``, and the rest of a cut group comes first next."""
    def group(name: str, size: int) -> list[Trajectory]:  # smaller than the rollout's: empty completions left out
        return [trajectory(trajectory_id=f"{name}-{j}", group_id=name, sampler_id="w0", group_size=size,
                           completion_len=2, version=0) for j in range(size)]

    def ids(groups) -> list[list[str]]:
        return [[t.trajectory_id for t in g] for g in groups]

    worker.send_many(group("a", 3) + group("b", 2) + group("c", 1), timeout_s=5)
    wait_until(lambda: learner.buffered() == 6, 5, "three whole groups")
    assert ids(learner.get_groups(4, timeout_s=1)) == [["a-0", "a-1", "a-2"]]  # a and b: 5 > 4
    assert ids(learner.get_groups(1, timeout_s=1)) == [["b-0", "b-1"]]
    worker.send_many(group("d", 3), timeout_s=5)
    wait_until(lambda: learner.buffered() == 4, 5, "d whole")
    assert [t.trajectory_id for t in learner.get(2, timeout_s=1)] == ["c-0", "d-0"]
    assert ids(learner.get_groups(10, timeout_s=1)) == [["d-1", "d-2"]]
    assert learner.buffered() == 0 and learner.get_groups(10, timeout_s=0) == []


def test_duplicate_trajectory_is_accepted_once(learner, worker):
    for _ in range(3):
        worker.send(traj("w0", 7), timeout_s=5)
    wait_until(lambda: learner.stats["duplicates"] == 2, 5, "two duplicates counted")
    assert [t.trajectory_id for t in learner.get(10, timeout_s=1)] == ["w0-7"]
    wait_until(lambda: worker.stats["acked"] == 3, 5, "three acks")  # the sender hears all three were delivered


def test_weights_are_chunked_checksummed_and_late_joiners_get_the_newest(learner, worker):
    config = TransportConfig(**{**FAST.__dict__, "weights_chunk_bytes": 1000, "weights_pipeline": 3})
    learner.config = config
    states = {v: {"w": torch.full((700,), float(v)), "b": torch.arange(v, v + 3)} for v in (1, 2, 3)}
    learner.publish(1, states[1])
    version, state = worker.wait_weights(-1, timeout_s=10)
    assert version == 1 and torch.equal(state["w"], states[1]["w"])
    learner.publish(2, states[2])
    learner.publish(3, states[3])
    late = WorkerClient(learner.control_endpoint, "late", FAST)
    try:
        assert late.wait_ready(10).newest_version == 3
        version, state = late.wait_weights(-1, timeout_s=10)
        assert version == 3 and torch.equal(state["b"], states[3]["b"])  # the newest whole, nothing older
    finally:
        late.close()
    wait_until(lambda: (worker.latest_weights() or (0,))[0] == 3, 10, "version 3")  # the early worker catches up too


def test_workers_time_each_version_from_its_publish_and_the_learner_sums_them_across_processes(learner):
    first = WorkerClient(learner.control_endpoint, "w0", FAST)
    try:
        first.wait_ready(10)
        before = time.time()
        learner.publish(1, {"w": torch.zeros(10)})
        assert first.wait_weights(-1, 10)[0] == 1
        took = time.time() - before
        # the notice said when the version was published; the worker timed it to its delivery and said so
        assert first.arrivals.count == 1 and 0 <= first.arrivals.max_s <= took
        wait_until(lambda: learner.fleet_totals()["weights_arrived"] == 1, 10, learner.fleet_totals)
        learner.publish(2, {"w": torch.ones(10)})
        assert first.wait_weights(1, 10)[0] == 2
        wait_until(lambda: learner.fleet_totals()["weights_arrived"] == 2, 10, learner.fleet_totals)
    finally:
        first.close()
    again = WorkerClient(learner.control_endpoint, "w0", FAST)  # a new process under the same id: its counts from 0
    try:
        again.wait_ready(10)  # (given version 2 as it joins: no notice, so not timed)
        learner.publish(3, {"w": torch.full((10,), 3.0)})
        wait_until(lambda: (again.latest_weights() or (0,))[0] == 3, 10, "version 3")
        wait_until(lambda: learner.fleet_totals()["weights_arrived"] == 3, 10, learner.fleet_totals)
        totals = learner.fleet_totals()
        assert 0 <= totals["weights_arrival_s"] <= 3 * totals["weights_arrival_max_s"]
    finally:
        again.close()


def test_a_weights_receive_buffer_is_reused_only_once_nothing_views_it():
    from heterorl.transport.client import _ReceiveBuffers
    from heterorl.transport.weights import pack_state_dict, unpack_state_dict

    packed = pack_state_dict({"a": torch.arange(10.0), "b": torch.ones(3, 4)}, 1)
    n = len(packed.buffer)
    pool = _ReceiveBuffers(keep=1)
    first = pool.take(n)
    first[:] = packed.buffer
    address = first.ctypes.data
    state = unpack_state_dict(packed.header, first)
    pool.reuse_later(first)
    del first
    assert pool.take(n).ctypes.data != address and pool.allocated == 2  # the delivered tensors still view it
    view = state["b"][1:]
    del state
    assert pool.take(n).ctypes.data != address and pool.allocated == 3  # so does a view made of one of them
    del view
    assert pool.take(n).ctypes.data == address and pool.allocated == 3  # nothing does: reused


def test_weights_received_into_reused_buffers_never_change_a_version_still_held(learner, worker):
    """A worker that keeps every version it took must find each intact; one that drops them reuses buffers."""
    learner.config = TransportConfig(**{**FAST.__dict__, "weights_chunk_bytes": 4096})
    held = {}
    for version in range(1, 5):  # holds every state: each version needs its own buffer
        learner.publish(version, {"w": torch.full((5000,), float(version))})
        got_version, held[version] = worker.wait_weights(version - 1, timeout_s=10)
        assert got_version == version
    for version, state in held.items():
        assert torch.equal(state["w"], torch.full((5000,), float(version))), version
    assert worker.stats["weights/fresh_buffers"] == 4
    held.clear()
    for version in range(5, 9):  # drops each state once read: two buffers take turns
        learner.publish(version, {"w": torch.full((5000,), float(version))})
        got_version, state = worker.wait_weights(version - 1, timeout_s=10)
        assert got_version == version and torch.equal(state["w"], torch.full((5000,), float(version)))
        del state
    assert worker.stats["weights/fresh_buffers"] == 4  # versions 5-8 went into the buffers of 3 and 4


def test_weights_delay_holds_each_release_back():
    delays = {"slow": 2.0, "fast": 0.0}
    server = LearnerServer("tcp://127.0.0.1:0", FAST, weights_delay=lambda wid: (lambda t, size: t + delays[wid]))
    slow, fast = (WorkerClient(server.control_endpoint, wid, FAST) for wid in ("slow", "fast"))
    try:
        slow.wait_ready(10)
        fast.wait_ready(10)
        start = time.monotonic()
        server.publish(1, {"w": torch.ones(4)})
        assert fast.wait_weights(-1, 5)[0] == 1
        fast_s = time.monotonic() - start
        assert slow.wait_weights(-1, 5)[0] == 1
        slow_s = time.monotonic() - start
        # the held-back release is never early; the bound on the other only needs the machine not to stall 2 s
        assert fast_s < 2.0 <= slow_s < 7.0
    finally:
        slow.close()
        fast.close()
        server.close()


def test_plaintext_is_refused_off_loopback_unless_asked_for():
    with pytest.raises(ConfigError, match="refusing plaintext"):
        LearnerServer("tcp://0.0.0.0:0", FAST)
    with pytest.raises(ConfigError, match="refusing plaintext"):
        WorkerClient("tcp://10.1.2.3:5555", "w", FAST)
    hand_built = TransportConfig(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    with pytest.raises(ConfigError, match=r"`transport\.heartbeat_timeout_s`.*must exceed"):
        hand_built.validate()
    with pytest.raises(ConfigError, match=r"`transport\.heartbeat_timeout_s`"):  # both ends validate what they get
        LearnerServer("tcp://127.0.0.1:0", hand_built)
    with pytest.raises(ConfigError, match=r"`transport\.heartbeat_timeout_s`"):
        WorkerClient("tcp://127.0.0.1:5555", "w", hand_built)


def test_curve_lets_listed_workers_in_and_keeps_everyone_else_out(tmp_path, caplog):
    """Listed keys in, the rest out; each refused handshake is logged by the learner with its cause (a refused
    key with its fingerprint and address), and each refused worker's timeout names its own cause."""
    caplog.set_level(logging.WARNING, logger="heterorl.transport")
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    learner_pub, learner_secret = make_keypair(keys, "learner")
    good_pub, good_secret = make_keypair(keys, "good")
    _, bad_secret = make_keypair(keys, "stranger")
    (allowed / good_pub.name).write_bytes(good_pub.read_bytes())
    with pytest.raises(ConfigError, match="exists"):
        make_keypair(keys, "good")
    server = LearnerServer("tcp://127.0.0.1:0", FAST,
                           curve=CurveConfig(str(learner_secret), allowed_keys_dir=str(allowed)))
    clients = []
    try:
        good = WorkerClient(server.control_endpoint, "good", FAST,
                            curve=CurveConfig(str(good_secret), server_key_file=str(learner_pub)))
        clients.append(good)
        good.wait_ready(10)
        good.send(traj("good", 1), timeout_s=5)
        assert [t.trajectory_id for t in server.get(1, timeout_s=5)] == ["good-1"]
        server.publish(1, {"w": torch.ones(3)})
        assert good.wait_weights(-1, 5)[0] == 1
        stranger = WorkerClient(server.control_endpoint, "stranger", FAST,
                                curve=CurveConfig(str(bad_secret), server_key_file=str(learner_pub)))
        wrong_server = WorkerClient(server.control_endpoint, "liar", FAST,
                                    curve=CurveConfig(str(good_secret), server_key_file=str(good_pub)))
        plaintext = WorkerClient(server.control_endpoint, "plain", FAST)
        clients += [stranger, wrong_server, plaintext]
        causes = {stranger: "is not in the learner's allowed-keys folder",
                  wrong_server: "most likely --server-key is not the learner's public key",
                  plaintext: "one end speaks CURVE and the other plaintext"}
        for client, cause in causes.items():
            wait_until(lambda: client.handshake_refused, 10, f"{client.worker_id}'s handshake refused")
            with pytest.raises(TransportTimeout, match=cause):
                client.wait_ready(0.1)
            with pytest.raises(TransportTimeout):
                client.send(traj(client.worker_id, 1), timeout_s=0.2)
        assert [w.worker_id for w in server.workers()] == ["good"]
        assert server.stats["accepted"] == 1
        stranger_key = (keys / "stranger.key").read_text().split('public-key = "')[1][:8]
        # the learner reads its own monitor on its I/O thread: its lines come when they come, each within 10 s
        for said in (f"refused a CURVE handshake from 127.0.0.1: key {stranger_key}… is not in the allowed-keys "
                     f"folder {allowed}", "the worker's --server-key is not this learner's key",
                     "one end speaks CURVE and the other plaintext"):
            wait_until(lambda: any(said in r.getMessage() for r in caplog.records), 10,
                       lambda: f"the learner's line {said!r}; it logged: {[r.getMessage() for r in caplog.records]}")
        assert server.stats["handshakes_refused"] >= 3
    finally:
        for client in clients:
            client.close()
        server.close()
    with pytest.raises(ConfigError, match="secret"):
        CurveConfig(str(learner_pub)).keypair()  # a public key where the secret belongs


def test_refused_handshakes_are_logged_once_per_cause_every_ten_seconds_with_the_count_left_out(monkeypatch, caplog):
    """A worker dialling again every 100 ms with a wrong key is one line per 10 s, not ten a second."""
    from heterorl.transport import handshakes

    now = [0.0]
    monkeypatch.setattr(handshakes.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger="heterorl.transport")
    refusals = handshakes.RateLimitedLog(logging.getLogger("heterorl.transport"))
    logged = []
    for tick in range(250):  # 25 s of refusals, every 100 ms, of one cause, and one of another
        now[0] = tick / 10
        logged.append(refusals.warning("wrong key", "refused key A"))
    assert refusals.warning("plaintext", "refused plaintext")
    assert [i / 10 for i, said in enumerate(logged) if said] == [0.0, 10.0, 20.0]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1] == "refused key A (and 99 more like it in the last 10 s)" and len(messages) == 4


def _fuzz_frames(rng: random.Random, valid: bytes, registered: str) -> list[list[bytes]]:
    """One malformed message (as frames) of a randomly chosen kind."""
    body = msgpack.unpackb(valid, raw=False)
    kind = rng.randrange(13)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:
        return [valid[:rng.randrange(1, len(valid) - 1)]]
    if kind == 2:
        key = rng.choice([k for k in body if k not in ("v", "kind")])
        wrong = {str: [None, 7, [1], b"x"], bytes: [None, "x", [1], 3], int: [None, "x", [1], 1.5],
                 float: [None, "x", [1], b"x", True],
                 list: [None, "x", [1], [0, 1], [1.5, 2], [2, 1], [1, 2, 2, 3], [1, 99]]}[type(body[key])]
        return [msgpack.packb(body | {key: rng.choice(wrong)})]
    if kind == 3:
        return [msgpack.packb(body | {"behaviour_logprobs": np.array([np.nan, -1, -1], "<f4").tobytes()})]
    if kind == 4:
        return [msgpack.packb(body | {"policy_versions": np.zeros(rng.randrange(4, 9), "<i4").tobytes()})]
    if kind == 5:
        n = 5000
        return [msgpack.packb(body | {"completion_tokens": np.zeros(n, "<i4").tobytes(),
                                      "behaviour_logprobs": np.zeros(n, "<f4").tobytes(),
                                      "policy_versions": np.zeros(n, "<i4").tobytes()})]
    if kind == 6:
        return [msgpack.packb(body | {"v": rng.choice([0, SCHEMA_VERSION - 1, 99, str(SCHEMA_VERSION), None])})]
    if kind == 7:
        return [msgpack.packb(body | {"sampler_id": f"not-{registered}", "trajectory_id": f"f{rng.random()}"})]
    if kind == 8:
        return [msgpack.packb(body | {"kind": rng.choice(["pickle", "", "TRAJECTORY", 7])})]
    if kind == 9:
        return [valid, rng.randbytes(10)]
    if kind in (11, 12):  # a batch message: a frame missing, or lengths that do not add up
        frames = [bytes(memoryview(f)) for f in encode(TrajectoryBatch([traj(registered, 1), traj(registered, 2)]))]
        if kind == 11:
            return frames[:1] if rng.random() < 0.5 else [*frames, frames[1]]
        head = msgpack.unpackb(frames[0], raw=False)
        return [msgpack.packb(head | {"completion_len": [3, rng.randrange(4, 9)]}), *frames[1:]]
    return encode(Heartbeat("someone-else", 1, 0.0))


def test_ten_thousand_malformed_frames_are_all_rejected_while_valid_traffic_flows():
    # (not throttled: every malformed frame is to be decoded and named; throttling: test_peer_work.py)
    limits_learner = LearnerServer("tcp://127.0.0.1:0", dataclasses.replace(FAST, max_refusals_per_s=10**9),
                                   limits=Limits(max_tokens=4096))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.SNDTIMEO, 5000)
    raw.setsockopt(zmq.LINGER, 0)
    honest = WorkerClient(limits_learner.control_endpoint, "honest", FAST)
    try:
        raw.connect(limits_learner.control_endpoint)
        raw.send_multipart(encode(Hello("fuzzer", "h", 1)))
        assert raw.poll(5000)
        assert isinstance(decode(raw.recv_multipart()), Ready)
        honest.wait_ready(10)
        rss_before = _rss_mb()
        rng = random.Random(0)
        valid = encode(traj("fuzzer", 0))[0]
        received, sent_valid = [], 0
        for i in range(10_000):
            raw.send_multipart(_fuzz_frames(rng, valid, "fuzzer"))
            if i % 1000 == 999:
                honest.send(traj("honest", sent_valid), timeout_s=5)
                sent_valid += 1
                received += limits_learner.get(100, timeout_s=0)
        wait_until(lambda: limits_learner.stats["rejected"] >= 10_000, 30, "10,000 refusals")
        received += limits_learner.get(100, timeout_s=5)
        while len(received) < sent_valid:
            batch = limits_learner.get(100, timeout_s=5)
            assert batch, f"only {len(received)} of {sent_valid} valid trajectories arrived"
            received += batch
        stats = limits_learner.stats
        reasons = {k: v for k, v in stats.items() if k.startswith("rejected/")}
        assert stats["rejected"] == sum(reasons.values()) == 10_000, reasons
        assert stats["accepted"] == sent_valid == 10
        assert sorted(t.trajectory_id for t in received) == sorted(f"honest-{i}" for i in range(10))
        assert {"rejected/malformed", "rejected/not_finite", "rejected/length_mismatch", "rejected/too_large",
                "rejected/schema_version", "rejected/forged_id", "rejected/unknown_kind",
                "rejected/type"} <= set(reasons)
        assert _rss_mb() - rss_before < 100  # nothing of the rejected traffic is retained
        # the honest worker is still served (the fuzzer sends no heartbeats, so it may be marked dead)
        assert next(w for w in limits_learner.workers() if w.worker_id == "honest").alive
    finally:
        honest.close()
        raw.close()
        ctx.term()
        limits_learner.close()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Process:
    """A worker_process.py subprocess whose stdout lines arrive on a queue."""

    def __init__(self, address: str, worker_id: str) -> None:
        script = Path(__file__).with_name("worker_process.py")
        env = ENV  # the checkout under test, not an installed heterorl
        self.proc = subprocess.Popen([sys.executable, str(script), address, worker_id], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.lines.get(timeout=0.1) == text:
                    return
            except queue.Empty:
                pass
        raise AssertionError(f"worker never printed {text!r}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_a_sigkilled_worker_is_noticed_and_a_restarted_one_rejoins_with_the_newest_weights(learner):
    a, b = _Process(learner.control_endpoint, "w-a"), _Process(learner.control_endpoint, "w-b")
    try:
        a.expect("ready", 60)
        b.expect("ready", 60)
        learner.publish(1, {"w": torch.ones(8)})
        a.expect("weights 1", 20)
        b.expect("weights 1", 20)
        os.kill(a.proc.pid, signal.SIGKILL)
        alive = lambda wid: next(w.alive for w in learner.workers() if w.worker_id == wid)
        wait_until(lambda: not alive("w-a"), FAST.heartbeat_timeout_s + 9, "w-a dead")  # noticed by its silence
        learner.get(10_000, timeout_s=0)
        wait_until(lambda: any(t.sampler_id == "w-b" for t in learner.get(100, timeout_s=0.2)), 5, "w-b's data")
        assert alive("w-b")
        learner.publish(2, {"w": torch.full((8,), 2.0)})
        learner.publish(3, {"w": torch.full((8,), 3.0)})
        again = _Process(learner.control_endpoint, "w-a")
        try:
            again.expect("ready", 60)
            again.expect("weights 3", 20)  # the newest whole version, on rejoining
            wait_until(lambda: alive("w-a"), 5, "w-a back")
        finally:
            again.kill()
    finally:
        a.kill()
        b.kill()


def test_trajectory_delays_follow_the_configured_link_on_a_scaled_clock(learner):
    from heterorl.config import LinkDelayConfig
    from heterorl.delay.clock import ScaledClock
    from heterorl.delay.links import DelayLink

    clock = ScaledClock(20.0)  # 50 simulated seconds pass in 2.5 real seconds
    link = DelayLink(LinkDelayConfig(kind="uniform", low_s=30.0, high_s=50.0, seed=3), name="w0/trajectories")
    expected = DelayLink(LinkDelayConfig(kind="uniform", low_s=30.0, high_s=50.0, seed=3), name="w0/trajectories")
    client = WorkerClient(learner.control_endpoint, "w0", FAST, trajectory_delay=link.schedule, clock=clock)
    try:
        client.wait_ready(10)
        sent = []
        for i in range(4):
            sent.append(clock.now())
            client.send(traj("w0", i), timeout_s=5)
        arrivals = {}
        while len(arrivals) < 4:
            for t in learner.get(4, timeout_s=5):
                arrivals[t.trajectory_id] = clock.now()
        for i, t0 in enumerate(sent):
            due = expected.schedule(t0, traj("w0", i).nbytes)
            delay = arrivals[f"w0-{i}"] - t0
            # never early; late by at most 20 sim s = 1 real s (the test thread's polling under a loaded machine)
            assert due - t0 - 0.5 <= delay <= due - t0 + 20, (i, delay, due - t0)
    finally:
        client.close()


def _acquire(clients, wanted: int, timeout_s: float = 10) -> list[int]:
    """Permits each client acquired, one at a time in turn, until ``wanted`` in all or ``timeout_s``
    (permits ride on the learner's acks, a beat after it grants them)."""
    got, deadline = [0] * len(clients), time.monotonic() + timeout_s
    while sum(got) < wanted and time.monotonic() < deadline:
        for i, c in enumerate(clients):
            got[i] += c.acquire_starts(1, timeout_s=0.05)
    return got


def test_admission_control_caps_the_groups_the_fleet_may_start(learner):
    """Under a cap, a worker that has delivered nothing holds one probation permit; once it delivers a group
    it holds its share (``ahead``), and the fleet never more than the cap plus a probation permit granted beyond
    it while unused."""
    clients = [WorkerClient(learner.control_endpoint, f"a{i}", FAST) for i in range(2)]
    try:
        for c in clients:
            c.wait_ready(10)
        assert clients[0].acquire_starts(5, timeout_s=0.1) == 5  # no admission control: anything goes
        clients[0].return_starts(5)
        learner.set_admission(cap=3, ahead=2)
        wait_until(lambda: all(c.start_limit >= 0 for c in clients), 10, "every limit")  # they ride on the next acks
        assert _acquire(clients, 2) == [1, 1]  # on probation: one permit each
        assert clients[0].acquire_starts(1, timeout_s=0.3) + clients[1].acquire_starts(1, timeout_s=0.3) == 0
        for c in clients:  # each delivers its group: now each may hold ahead = 2, while the cap (3) has room
            c.send(traj(c.worker_id, 0), timeout_s=5)
        started = 2 + sum(_acquire(clients, 1))
        started += clients[0].acquire_starts(2, timeout_s=0.3) + clients[1].acquire_starts(2, timeout_s=0.3)
        # 3 when the groups came in together; 4 when the first one's worker was granted the cap's 2 left while the
        # other's probation permit, unused, was beyond it
        assert 3 <= started <= 4
        learner.set_admission(cap=5, ahead=2)  # the learner stepped: the fleet may start 5 groups in all
        started += sum(_acquire(clients, 5 - started))
        assert started == 5
        assert clients[0].acquire_starts(1, timeout_s=0.5) + clients[1].acquire_starts(1, timeout_s=0.5) == 0
    finally:
        for c in clients:
            c.close()


def test_a_worker_that_joins_before_the_first_cap_starts_only_on_permits():
    """A learner under admission control binds before it computes its first cap: a worker that joins in between
    is under admission control from its ready (a probation permit, counted), not told "no limit", under which it
    would start groups uncounted that the learner refuses once the limit comes (`over_start_limit`: its books and
    the learner's no longer agree, and every group it starts beyond them is lost)."""
    with LearnerServer("tcp://127.0.0.1:0", FAST, admission_control=True) as server:
        assert server.permits_left() == 0
        client = WorkerClient(server.control_endpoint, "early", FAST)
        try:
            client.wait_ready(10)
            assert client.start_limit >= 0
            assert client.acquire_starts(5, timeout_s=10) == 1  # its probation permit, and no more
            assert client.acquire_starts(1, timeout_s=0.3) == 0
            client.send(traj("early", 0), timeout_s=5)
            server.set_admission(cap=3, ahead=2)  # the learner's first cap
            started = 1 + sum(_acquire([client], 2))
            for i in range(1, started):
                client.send(traj("early", i), timeout_s=5)
            assert started == 3
            wait_until(lambda: server.stats["accepted"] == 3, 10, lambda: dict(server.stats))
            assert server.stats["rejected/over_start_limit"] == 0
        finally:
            client.close()


def test_permits_are_shared_in_proportion_to_each_workers_measured_speed():
    """Once every live worker's speed is measured (groups started per second generating, from its heartbeats),
    the fleet's ahead x workers permits are split in their proportion: a slow worker holds few, never none."""
    assert permit_share(None, None, 4) == 4  # unmeasured: `ahead` each
    assert permit_share(4.0, None, 4) == 4  # another worker is still unmeasured
    fleet = (4.0 + 4 / 3, 2)  # a fast worker (4 groups/s) and a slow one (4/3 groups/s)
    assert (permit_share(4.0, fleet, 4), permit_share(4 / 3, fleet, 4)) == (6, 2)
    assert permit_share(0.01, (100.01, 2), 4) == 1


def test_a_worker_claiming_permits_it_never_uses_holds_a_bounded_number(learner, worker):
    """Groups on their way count as used by the worker's heartbeats, but a worker that says it used every permit
    and sends nothing is believed only up to ``ahead`` beyond the groups that arrived."""
    learner.set_admission(cap=1000, ahead=2)
    wait_until(lambda: worker.start_limit == 1, 10, "a probation permit")
    assert worker.acquire_starts(1, timeout_s=1) == 1
    worker.send(traj("w0", 0), timeout_s=5)  # delivered: it holds its share now
    bound = 1 + 2 + 2  # arrived + ahead unused + ahead believed on their way
    wait_until(lambda: worker.acquire_starts(100, timeout_s=0.05) >= 0 and worker.start_limit >= bound, 10,
               "the start limit at the bound")
    for _ in range(10):  # take every permit granted and claim them used, again and again: nothing more comes
        worker.acquire_starts(100, timeout_s=0.1)
    assert worker.start_limit == bound
    # in the learner's books the permits beyond what it believes used are still the worker's to use
    assert learner.permits_left() == 1000 - bound + 2


def test_a_permit_for_a_group_that_never_arrives_is_given_back(learner, worker):
    """A group whose completions were all empty (or that the delay link dropped) never reaches the learner, which
    counts a start when a group arrives: the worker gives the permit back and may start another."""
    learner.set_admission(cap=2, ahead=2)
    wait_until(lambda: worker.start_limit == 1, 10, "a probation permit")
    assert worker.acquire_starts(2, timeout_s=5) == 1
    assert worker.acquire_starts(1, timeout_s=0.3) == 0
    worker.return_starts(1)  # its group came out empty
    assert worker.acquire_starts(1, timeout_s=1) == 1


def test_a_worker_whose_weights_lag_too_far_gets_no_permit_until_it_catches_up(learner, worker):
    """``max_lag``: a worker holding weights more than that many versions older than the newest would sample
    groups that stale; it is given no permit until its heartbeats say it holds a newer version."""
    for version in range(4):
        learner.publish(version, {"w": torch.full((4,), float(version))})
    worker.set_version_held(0)  # 3 versions behind, as its heartbeats say (a permit granted is never taken back)
    wait_until(lambda: [w.version_held for w in learner.workers()] == [0], 10, "the heartbeat")
    learner.set_admission(cap=100, ahead=2, max_lag=2)
    wait_until(lambda: learner.stats["permits_held_back/weights_lag"] == 1, 10, learner.stats)
    wait_until(lambda: worker.start_limit == 0, 10, "the learner's start limit")  # (-1 until an ack says one)
    assert worker.acquire_starts(1, timeout_s=1.0) == 0 and worker.start_limit == 0
    worker.set_version_held(2)  # within 2 of the newest: permits again
    assert worker.acquire_starts(1, timeout_s=10) == 1
    assert learner.stats["permits_held_back/weights_lag"] == 1  # counted once per time it fell behind


def test_permits_held_by_a_worker_that_leaves_go_back_to_the_fleet(learner):
    """Admission permits a departed worker never used must not stall the learner."""
    learner.set_admission(cap=3, ahead=2)
    leaving = WorkerClient(learner.control_endpoint, "p0", FAST)
    staying = None
    try:
        leaving.wait_ready(10)
        assert leaving.acquire_starts(1, timeout_s=5) == 1
        leaving.send(traj("p0", 0), timeout_s=5)
        wait_until(lambda: leaving.start_limit == 3, 10, "the rest of the cap")  # delivering: its share, unused
        staying = WorkerClient(learner.control_endpoint, "p1", FAST)
        staying.wait_ready(10)
        assert staying.acquire_starts(2, timeout_s=5) == 1  # on probation: one, beyond the cap
        staying.send(traj("p1", 0), timeout_s=5)  # delivered: its group is the cap's (3 = 1 + 1 + 1 left)
        assert staying.acquire_starts(1, timeout_s=0.5) == 0  # the rest of the cap is the other's, unused
        leaving.close()  # says bye with two unused permits
        assert staying.acquire_starts(2, timeout_s=5) == 1  # the one left of the cap
        assert staying.acquire_starts(1, timeout_s=0.5) == 0
    finally:
        leaving.close()
        if staying is not None:
            staying.close()


def test_the_programs_workers_rewards_ran_are_counted_across_their_processes():
    server = LearnerServer("tcp://127.0.0.1:0", dataclasses.replace(FAST, worker_expiry_s=1.0))
    first = WorkerClient(server.control_endpoint, "w0", FAST)
    clients = [first]
    try:
        first.wait_ready(10)
        first.reward_outcomes = {"ok": 3, "timeout": 1}
        wait_until(lambda: server.reward_outcomes() == {"ok": 3, "timeout": 1}, 10, server.reward_outcomes)
        first.reward_outcomes = {"ok": 5, "timeout": 1, "forbidden:socket": 2}  # cumulative: the latest counts
        wait_until(lambda: server.reward_outcomes().get("ok") == 5, 10, server.reward_outcomes)
        first.close()
        again = WorkerClient(server.control_endpoint, "w0", FAST)  # a new process under the same id: from 0
        clients.append(again)
        again.wait_ready(10)
        again.reward_outcomes = {"ok": 1}
        want = {"forbidden:socket": 2, "ok": 6, "timeout": 1}
        wait_until(lambda: server.reward_outcomes() == want, 10, server.reward_outcomes)
        other = WorkerClient(server.control_endpoint, "w1", FAST)
        clients.append(other)
        other.wait_ready(10)
        other.reward_outcomes = {"memory": 1}
        wait_until(lambda: server.reward_outcomes().get("memory") == 1, 10, server.reward_outcomes)
        other.close()  # it leaves the registry: its counts stay in the totals
        wait_until(lambda: server.stats["workers_removed/expired"], 30, "an expiry")
        assert server.reward_outcomes() == {**want, "memory": 1}
    finally:
        for client in clients:
            client.close()
        server.close()


def test_a_hello_sent_again_before_its_answer_gets_the_same_session_and_a_rejoin_a_new_one(learner):
    """Over a slow link (or while its connection is set up) a worker says hello again before the first answer
    arrives: the learner answers both with the same session, so the worker's first session is not ended by its
    own second hello. A hello after the worker was heard in its session is a rejoin: a new session."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(learner.control_endpoint)
    try:
        hello = encode(Hello("w0", "h", os.getpid(), -1, time.time()))
        sock.send_multipart(hello)
        sock.send_multipart(hello)

        def ready() -> Ready:
            while True:
                assert sock.poll(10_000), "no answer"
                message = decode(sock.recv_multipart())
                if isinstance(message, Ready):
                    return message

        first, again = ready(), []
        while sock.poll(500):  # the second hello: answered with the same session, or not at all when it came
            message = decode(sock.recv_multipart())  # within half a hello_interval_s of the first's ready
            if isinstance(message, Ready):
                again.append(message)
        assert all(r.settings["weights_session"] == first.settings["weights_session"] for r in again)
        assert learner.stats["hellos_repeated"] == 1
        assert len(again) + learner.stats["hellos_repeated/unanswered"] == 1
        sock.send_multipart(encode(Heartbeat("w0", -1, time.time())))  # heard in its session ...
        wait_until(lambda: learner.stats["received"] >= 3, 10, "the heartbeat")
        sock.send_multipart(hello)  # ... so a hello now begins a new one
        assert ready().settings["weights_session"] != first.settings["weights_session"]
        assert learner.stats["hellos_repeated"] == 1
    finally:
        sock.close(0)
        ctx.term()


def test_a_worker_takes_a_repeated_ready_of_its_session_for_the_same_session():
    ctx = zmq.Context()
    router, weights = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)  # a learner that answers one hello twice
    port = router.bind_to_random_port("tcp://127.0.0.1")
    weights_port = weights.bind_to_random_port("tcp://127.0.0.1")
    client = WorkerClient(f"tcp://127.0.0.1:{port}", "w0", FAST)
    try:
        assert router.poll(10_000)
        routing_id = router.recv_multipart()[0]
        ready = Ready("w0", 8, -1, 0.2, {"weights_port": weights_port, "weights_session": "s1"})
        for _ in range(2):
            router.send_multipart([routing_id, *encode(ready)])
        client.wait_ready(10)
        wait_until(lambda: client.stats["ready_repeated"] == 1, 10, client.stats)
        assert client._receiver.fetch.session == "s1"
    finally:
        client.close()
        router.close(0)
        weights.close(0)
        ctx.term()


def test_closing_the_learner_tells_workers_the_run_is_over():
    server = LearnerServer("tcp://127.0.0.1:0", FAST)
    client = WorkerClient(server.control_endpoint, "w0", FAST)
    try:
        client.wait_ready(10)
        server.close("run finished")
        assert client.finished.wait(5)
        assert "run finished" in client.rejections
        # the worker's client answered at once, and the learner's end stayed open until the answer arrived
        assert client.stats["end_of_run/answered"] == 1
        assert server.stats["end_of_run/answered"] == 1 and server.stats["end_of_run/unanswered"] == 0
    finally:
        client.close()


def test_the_learner_waits_a_bounded_time_for_a_worker_that_does_not_answer_the_end_of_the_run():
    """A worker whose answer does not come (its bye lost in a link's retransmissions, or a peer that never
    answers) keeps the learner's end open for transport.end_of_run_wait_s, no longer, and is counted."""
    config = dataclasses.replace(FAST, end_of_run_wait_s=0.5)
    server = LearnerServer("tcp://127.0.0.1:0", config)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.control_endpoint)
    try:
        sock.send_multipart(encode(Hello("w0", "h", os.getpid(), -1, time.time())))
        assert sock.poll(10_000) and isinstance(decode(sock.recv_multipart()), Ready)
        start = time.monotonic()
        server.close("run finished")
        assert time.monotonic() - start >= 0.5
        assert server.stats["end_of_run/answered"] == 0 and server.stats["end_of_run/unanswered"] == 1
    finally:
        sock.close(0)
        ctx.term()
