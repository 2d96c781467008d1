"""What a registered peer can make the learner remember by naming things, on real loopback sockets: reward outcome
names, engine names, worker ids under one CURVE key, and log lines (docs/RELIABILITY.md, "Maps a peer fills")."""

import logging
import time

import pytest
import zmq

from heterorl.config import TransportConfig
from heterorl.runtime.engine_stats import MAX_NEW_ENGINES, OTHER_ENGINE, FleetEngines
from heterorl.tasks import sandbox_judge
from heterorl.transport import LearnerServer, TransportTimeout, WorkerClient
from heterorl.transport.outcomes import KNOWN_OUTCOMES, MAX_NEW_OUTCOMES, MAX_NEW_OUTCOMES_PER_WORKER
from heterorl.transport.protocol import Bye, Heartbeat, Hello, Ready, decode, encode
from tests.conftest import wait_until
from tests.transport.test_peer_bounds import (
    ADDRESS,
    QUICK,
    curve_keys,
    hello_socket,
    member,
    say_hello,
    take_all,
)


def joined(sock: zmq.Socket) -> None:
    assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Ready)


def test_a_peer_inventing_outcome_names_holds_a_bounded_map_and_every_count_is_kept():
    """64 fresh names in each of 200 heartbeats (12,800 names, half of them ``forbidden:*``): the learner's map
    keeps the known names, at most `MAX_NEW_OUTCOMES_PER_WORKER` of the peer's, and counts the rest under
    ``other`` and ``forbidden:other``, their sum unchanged; an honest worker's own name is still kept."""
    config = TransportConfig(**QUICK)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        sock = hello_socket(ctx, server.control_endpoint)
        honest = WorkerClient(server.control_endpoint, "honest", config)
        try:
            say_hello(sock, "inventor")
            joined(sock)
            honest.wait_ready(10)
            beats = 200
            for k in range(beats):
                names = {f"n{k}-{i}": 1 for i in range(32)} | {f"forbidden:n{k}-{i}": 1 for i in range(32)}
                sock.send_multipart(encode(Heartbeat("inventor", -1, time.time(), reward_outcomes=names)))
            wait_until(lambda: sum(server.reward_outcomes().values()) == 64 * beats, 10, "every heartbeat taken")
            honest.reward_outcomes = {"ok": 3, "forbidden:socket": 1, "my_task_reason": 2}
            wait_until(lambda: "my_task_reason" in server.reward_outcomes(), 10, "the honest worker's beat")
            outcomes = server.reward_outcomes()
        finally:
            honest.close()
            sock.close(0)
            ctx.term()
    # the peer's first four names are kept (its quota of the 16 new names), each of its other names folded
    invented = set(outcomes) - KNOWN_OUTCOMES - {"my_task_reason"}
    assert invented == {f"n0-{i}" for i in range(MAX_NEW_OUTCOMES_PER_WORKER)} and len(invented) < MAX_NEW_OUTCOMES
    assert outcomes["other"] == 32 * beats - MAX_NEW_OUTCOMES_PER_WORKER
    assert outcomes["forbidden:other"] == 32 * beats  # forbidden:* names fold into forbidden:other
    assert (outcomes["ok"], outcomes["forbidden:socket"], outcomes["my_task_reason"]) == (3, 1, 2)
    [info] = [w for w in server.workers() if w.worker_id == "inventor"]
    assert len(info.reward_outcomes) <= MAX_NEW_OUTCOMES_PER_WORKER + 2
    assert len(info.outcomes_before) <= MAX_NEW_OUTCOMES_PER_WORKER + 2


def test_the_known_outcomes_are_every_reason_the_code_tasks_sandbox_reports():
    judge = sandbox_judge
    reasons = {judge.OK, judge.WRONG, judge.TIMEOUT, judge.NOT_STARTED, judge.MEMORY, judge.OUTPUT, judge.CRASHED,
               judge.SYNTAX, "leftover", f"{judge.FORBIDDEN}:other",
               *(f"{judge.FORBIDDEN}:{k}" for k in judge.FORBIDDEN_KINDS)}
    assert reasons <= KNOWN_OUTCOMES


def test_workers_naming_fresh_engines_get_a_bounded_number_of_engine_tallies():
    """40 workers, each naming an engine of its own in its hello and sending one trajectory, tallied as the
    learner tallies them (`FleetEngines`): the first `MAX_NEW_ENGINES` names have tallies, the rest are counted
    under ``other``, and every trajectory is counted."""
    config = TransportConfig(**QUICK)
    ctx = zmq.Context()
    socks = []
    with LearnerServer(ADDRESS, config) as server:
        try:
            for i in range(40):
                socks.append(hello_socket(ctx, server.control_endpoint))
                socks[-1].send_multipart(encode(Hello(f"w{i}", "h", 1, -1, time.time(), engine=f"eng{i}")))
                joined(socks[-1])
                socks[-1].send_multipart(encode(member(f"w{i}", f"g{i}", 0, size=1)))
            got = take_all(server, 40)
            engines = FleetEngines(server.workers)
            for t in got:
                engines.tally(t.sampler_id).received += 1
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
    assert len(got) == 40
    assert set(engines.tallies) == {f"eng{i}" for i in range(MAX_NEW_ENGINES)} | {OTHER_ENGINE}
    assert sum(t.received for t in engines.tallies.values()) == 40
    assert engines.tallies[OTHER_ENGINE].received == 40 - MAX_NEW_ENGINES


def test_one_curve_key_holds_at_most_max_ids_per_key_worker_ids(tmp_path):
    """A third worker id under a key that holds two live ones is told busy, naming `max_ids_per_key`; another
    key is not affected; when one of the key's workers leaves, the third gets its place."""
    curve, curves, _ = curve_keys(tmp_path, ("shared", "own"))
    config = TransportConfig(**QUICK, max_ids_per_key=2)
    with LearnerServer(ADDRESS, config, curve=curve) as server:
        def client(worker_id: str, key: str) -> WorkerClient:
            clients.append(WorkerClient(server.control_endpoint, worker_id, config, curve=curves[key]))
            return clients[-1]

        clients = []
        try:
            first, second = client("a1", "shared"), client("a2", "shared")
            first.wait_ready(10), second.wait_ready(10)
            third = client("a3", "shared")
            with pytest.raises(TransportTimeout, match=r"key already holds 2 live worker ids .*max_ids_per_key"):
                third.wait_ready(1.5)
            assert server.stats["rejected/key_full"] >= 1
            client("b1", "own").wait_ready(10)  # another key's worker joins
            assert sorted(w.worker_id for w in server.workers()) == ["a1", "a2", "b1"]
            first.close()  # its bye: taken for dead, so its entry makes room for the key's next id
            third.wait_ready(10)
            assert sorted(w.worker_id for w in server.workers()) == ["a2", "a3", "b1"]
        finally:
            for c in clients:
                c.close()


def test_membership_log_lines_a_peer_can_trigger_are_rate_limited(caplog):
    """300 hellos under fresh ids from one connection, then 100 byes each followed by a heartbeat: without a
    bound, 300 "joined", 100 "left" and 100 "is back" lines; with it, about 20 of each (`PacedLog`'s burst)."""
    config = TransportConfig(**QUICK)
    ctx = zmq.Context()
    caplog.set_level(logging.INFO, logger="heterorl.transport")
    with LearnerServer(ADDRESS, config) as server:
        sock = hello_socket(ctx, server.control_endpoint)
        try:
            start = time.monotonic()
            for i in range(300):
                say_hello(sock, f"flood-{i}")
            wait_until(lambda: server.stats["workers_removed"] == 299, 10, "every hello answered")
            for _ in range(100):
                sock.send_multipart(encode(Bye("flood-299", "bye")))
                sock.send_multipart(encode(Heartbeat("flood-299", -1, time.time())))
            wait_until(lambda: server.stats["received"] == 500, 10, "every bye and heartbeat taken")
            elapsed = time.monotonic() - start
        finally:
            sock.close(0)
            ctx.term()
    lines = [r.getMessage() for r in caplog.records if r.name == "heterorl.transport"]
    counts = {what: sum(what in line for line in lines) for what in (" joined from ", " left: ", " is back")}
    slack = 2 + int(elapsed)  # one more line of each per second of the flood
    assert all(20 <= n <= 20 + slack for n in counts.values()), counts
    assert "worker flood-0 joined from h (pid 1)" in lines
