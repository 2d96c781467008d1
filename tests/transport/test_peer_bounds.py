"""What one registered peer can hold or take from others, on real loopback sockets: its incomplete groups (count,
bytes, age), the ids of other workers (namespaced), the registry (expiry, full), its rate, and its key (revoked
without a restart)."""

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from heterorl.config import TransportConfig
from heterorl.errors import ConfigError
from heterorl.transport import (
    CurveConfig,
    LearnerServer,
    TransportError,
    TransportTimeout,
    WorkerClient,
    make_keypair,
    revoke_key,
)
from heterorl.transport.groups import GroupAssembler
from heterorl.transport.protocol import Hello, Ready, decode, encode
from tests.conftest import run_cli, trajectory, wait_until

ADDRESS = "tcp://127.0.0.1:0"
QUICK = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, hello_interval_s=0.05, linger_ms=0)


def member(worker: str, group: str, j: int, size: int = 4, tokens: int = 2, **fields):
    """Member ``j`` of ``worker``'s group ``group`` (of ``size``), with ``tokens`` prompt and completion tokens."""
    return trajectory(trajectory_id=f"{group}-{j}", group_id=group, sampler_id=worker, group_size=size,
                      prompt_tokens=np.full(tokens, 5, np.int32), completion_len=tokens, version=0,
                      reward=float(j % 2), sent_at=0.0, **fields)


def whole(worker: str, group: str, size: int = 4) -> list:
    return [member(worker, group, j, size) for j in range(size)]


def told(client: WorkerClient) -> dict[str, str]:
    """{trajectory or group id: reason} of what the learner told ``client`` it refused or dropped."""
    return {r.split(": ")[0]: r.split(": ")[1] for r in client.rejections if ": " in r}


def curve_keys(folder: Path, workers) -> tuple[CurveConfig, dict[str, CurveConfig], Path]:
    """Keys made in ``folder``: the learner's CURVE config allowing each of ``workers``, each worker's CURVE
    config (by name), and the learner's allowed-keys folder."""
    keys, allowed = folder / "keys", folder / "allowed"
    allowed.mkdir()
    learner_pub, learner_secret = make_keypair(keys, "learner")
    curves = {}
    for name in workers:
        public, secret = make_keypair(keys, name)
        shutil.copy(public, allowed / public.name)
        curves[name] = CurveConfig(str(secret), server_key_file=str(learner_pub))
    return CurveConfig(str(learner_secret), allowed_keys_dir=str(allowed)), curves, allowed


def take_all(server: LearnerServer, n: int) -> list:
    got = []
    deadline = time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        got += server.get(n - len(got), timeout_s=0.2)
    return got


def test_incomplete_groups_are_bounded_per_worker_dropped_when_refused_and_expire():
    """A peer that opens groups it never completes holds at most ``open_groups_per_worker`` of them and
    ``open_group_bytes_per_worker`` bytes, for at most ``group_timeout_s``; the learner only ever sees whole
    groups; an honest worker beside it is untouched."""
    config = TransportConfig(**QUICK, credits_per_worker=64, open_groups_per_worker=4,
                             open_group_bytes_per_worker=20_000, group_timeout_s=1.5)
    with LearnerServer(ADDRESS, config) as server:
        hostile, honest = (WorkerClient(server.control_endpoint, name, config) for name in ("hostile", "honest"))
        try:
            hostile.wait_ready(10), honest.wait_ready(10)
            # six groups opened by one member each: four are held, the fifth and sixth refused
            hostile.send_many([member("hostile", f"open-{g}", 0) for g in range(6)], 5)
            wait_until(lambda: len(hostile.rejections) >= 2, 10, "two groups refused")
            assert told(hostile) == {"open-4-0": "open_groups_bound", "open-5-0": "open_groups_bound"}
            # a member that would take the held bytes past the bound is refused and its group dropped at once
            hostile.send_many([member("hostile", "open-0", 1, tokens=3000)], 5)  # 48,000 bytes > 20,000
            wait_until(lambda: "open-0" in told(hostile), 10, "open-0 dropped")
            assert told(hostile)["open-0-1"] == "open_bytes_bound" and told(hostile)["open-0"] == "group_rejected"
            hostile.send_many([member("hostile", "open-0", 2)], 5)  # its later members are refused too
            wait_until(lambda: "open-0-2" in told(hostile), 10, "open-0-2 refused")
            assert told(hostile)["open-0-2"] == "group_rejected"
            # the honest worker's groups pass whole; nothing of the hostile's incomplete groups reaches the learner
            for g in range(5):
                honest.send_many(whole("honest", f"h-{g}"), 5)
            got = take_all(server, 20)
            assert len(got) == 20 and {t.sampler_id for t in got} == {"honest"} and list(honest.rejections) == []
            [info] = [w for w in server.workers() if w.worker_id == "hostile"]
            assert info.buffered == 3 and server.buffered() == 3  # open-1..3, one member each, on its credit
            # after group_timeout_s the rest is dropped, its credit freed, and the peer told
            wait_until(lambda: all(f"open-{g}" in told(hostile) for g in (1, 2, 3)), 10, "open groups expired")
            assert {told(hostile)[f"open-{g}"] for g in (1, 2, 3)} == {"group_expired"}
            assert server.stats["dropped_groups/group_expired"] == 3
            [info] = [w for w in server.workers() if w.worker_id == "hostile"]
            assert (info.buffered, info.open_bytes, server.buffered()) == (0, 0, 0)
            # bounded, not banned: a whole group from it is taken
            hostile.send_many(whole("hostile", "fine"), 5)
            assert [t.trajectory_id for t in take_all(server, 4)] == [f"fine-{j}" for j in range(4)]
        finally:
            hostile.close(), honest.close()
    assert server.stats["dropped_groups"] == 4 and server.stats["rejected"] == 4


def test_a_member_held_for_its_group_holds_only_its_own_bytes_not_its_whole_message():
    """A received trajectory's arrays view its message's frame: one member held in an open group kept the whole
    message alive (32 such messages of 75.5 MB: +2.3 GB while the held bytes counted 2,560). A held member is
    copied out of its frame."""
    config = TransportConfig(**QUICK, credits_per_worker=64)
    with LearnerServer(ADDRESS, config) as server:
        peer = WorkerClient(server.control_endpoint, "peer", config)
        try:
            peer.wait_ready(10)
            big = member("peer", "big", 0, size=1, tokens=50_000)  # a whole group of one: 800 KB of the frame
            peer.send_many([big, member("peer", "open", 0)], 5)  # ... and one member of a group of 4, held
            [taken] = take_all(server, 1)
            assert taken.trajectory_id == "big-0" and taken.completion_tokens.base is not None  # (a view, taken)
            # (the assembler's own view of what it holds: no public API hands out held members)
            [held] = server._rooms.intake.groups._open["peer"]["open"].members.values()
            for array in (held.prompt_tokens, held.completion_tokens, held.behaviour_logprobs,
                          held.policy_versions):
                assert array.base is None, "a held member still views its message's frame"
            assert [w.open_bytes for w in server.workers() if w.worker_id == "peer"] == [held.nbytes]
        finally:
            peer.close()


def test_a_peer_cannot_squat_another_workers_ids():
    """Ids are the workers' own: a peer that sends the very ids another worker will use (whole groups, and
    groups it never completes) makes none of that worker's trajectories a duplicate, nor its groups
    inconsistent."""
    config = TransportConfig(**QUICK, credits_per_worker=64)
    with LearnerServer(ADDRESS, config) as server:
        squatter, honest = (WorkerClient(server.control_endpoint, name, config) for name in ("squatter", "honest"))
        try:
            squatter.wait_ready(10), honest.wait_ready(10)
            # the honest worker's ids, sent first by the squatter (under its own sampler id: anything else is
            # refused as forged): one whole group, and three members of two more groups
            squatter.send_many(whole("squatter", "honest-s-0") + whole("squatter", "honest-s-1")[:3]
                               + whole("squatter", "honest-s-2")[:3], 5)
            squatter.send_many([member("honest", "honest-s-3", 0)], 5)
            wait_until(lambda: server.stats["rejected/forged_id"] == 1, 10, "the forged sampler id refused")
            # renamed so the ids are exactly the honest worker's
            for g in range(3):
                honest.send_many([member("honest", f"honest-s-{g}", j) for j in range(4)], 5)
            got = take_all(server, 16)
        finally:
            squatter.close(), honest.close()
    assert server.stats["duplicates"] == 0 and list(honest.rejections) == []
    assert sorted(t.trajectory_id for t in got if t.sampler_id == "honest") == sorted(
        f"honest-s-{g}-{j}" for g in range(3) for j in range(4))
    assembler = GroupAssembler(timeout_s=600)
    added = [assembler.add(t, 0.0) for t in got]
    complete = [a.complete for a in added if a.complete is not None]
    assert sorted((g[0].group_id, g[0].sampler_id) for g in complete) == [
        ("honest-s-0", "honest"), ("honest-s-0", "squatter"), ("honest-s-1", "honest"), ("honest-s-2", "honest")]
    assert not any(a.refused for a in added)


def hello_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def say_hello(sock: zmq.Socket, worker_id: str) -> None:
    sock.send_multipart(encode(Hello(worker_id, "h", 1, -1, time.time())))


def test_the_registry_forgets_dead_workers_says_when_it_is_full_and_gives_one_connection_one_entry():
    config = TransportConfig(**QUICK, max_workers=3, worker_expiry_s=1.0)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        clients = []
        try:
            # one connection saying hello as 50 ids holds one registry entry, the last one
            flood = hello_socket(ctx, server.control_endpoint)
            for i in range(50):
                say_hello(flood, f"flood-{i}")
            wait_until(lambda: server.stats["workers_removed"] == 49, 10, "one entry per connection")
            assert [w.worker_id for w in server.workers()] == ["flood-49"]
            clients = [WorkerClient(server.control_endpoint, f"w{i}", config) for i in range(2)]
            for client in clients:
                client.wait_ready(10)
            clients[0].send_many([member("w0", "g", j, size=1) for j in range(3)], 5)  # counted after it leaves
            # full: flood-49 never sent a heartbeat, but until it is taken for dead a new worker is refused
            # with the reason (the one a live registry gives; the dead entry then makes room)
            late = WorkerClient(server.control_endpoint, "late", config)
            clients.append(late)
            late.wait_ready(10)  # it keeps saying hello: flood-49 went silent, so it got flood-49's place
            assert "flood-49" not in {w.worker_id for w in server.workers()}
            assert len(server.workers()) == 3
            refused = WorkerClient(server.control_endpoint, "refused", config)
            clients.append(refused)
            with pytest.raises(TransportTimeout, match="registry is full"):
                refused.wait_ready(1.5)  # three live workers: no room
            assert server.stats["rejected/registry_full"] >= 1
            refused.close()
            # a worker that leaves is forgotten after worker_expiry_s; its counts stay in the fleet's totals
            removed = server.stats["workers_removed"]
            clients[0].close()
            wait_until(lambda: "w0" not in {w.worker_id for w in server.workers()}, 10, "w0 expired")
            # (a hello of `refused` still in flight when it closed can take w0's place for a moment: it then goes
            # silent and is taken for dead, as flood-49 was; once, under load, it did)
            assert {w.worker_id for w in server.workers()} - {"refused"} == {"w1", "late"}
            assert server.stats["workers_removed"] >= removed + 1
            assert server.fleet_totals()["trajectories"] == 3
            newcomer = WorkerClient(server.control_endpoint, "newcomer", config)
            clients.append(newcomer)
            newcomer.wait_ready(10)  # the place w0 left
        finally:
            for client in clients:
                client.close()
            flood.close(0)
            ctx.term()


def test_a_rate_limit_paces_an_honest_worker_through_its_credit_and_refuses_one_that_ignores_it():
    config = TransportConfig(**QUICK, credits_per_worker=8, max_trajectories_per_s=40.0)
    with LearnerServer(ADDRESS, config) as server:
        honest = WorkerClient(server.control_endpoint, "paced", config)
        stop = threading.Event()
        consumer = threading.Thread(target=lambda: [server.get(100, timeout_s=0.05) for _ in iter(stop.is_set, True)],
                                    daemon=True)  # a learner that takes at once: only the rate holds credit back
        try:
            honest.wait_ready(10)
            consumer.start()
            start = time.monotonic()
            for g in range(12):  # 48 trajectories: 8 in the bucket at hello, then 40/s
                group = whole("paced", f"p-{g}")
                while group:
                    try:
                        honest.send_many(group, 5)
                        group = []
                    except TransportTimeout as exc:
                        group = group[exc.done:]
            wait_until(lambda: server.stats["accepted"] == 48, 20, "all 48 taken")
            assert time.monotonic() - start >= (48 - 8) / 40.0 * 0.9  # never faster than the rate allows
            assert list(honest.rejections) == [] and server.stats["rejected"] == 0
        finally:
            stop.set()
            honest.close()
    # a peer that ignores its credit: past the bucket, refused as rate_limited (and never buffered)
    config = TransportConfig(**QUICK, credits_per_worker=32, max_trajectories_per_s=0.5)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        sock = hello_socket(ctx, server.control_endpoint)
        try:
            say_hello(sock, "greedy")
            assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Ready)
            for j in range(32):
                sock.send_multipart(encode(member("greedy", f"r-{j}", 0, size=1)))
            wait_until(lambda: server.stats["accepted"] == 32, 10, "the bucket's 32")
            server.get(100, timeout_s=0)  # credit room again, but no tokens
            for j in range(32, 40):
                sock.send_multipart(encode(member("greedy", f"r-{j}", 0, size=1)))
            wait_until(lambda: server.stats["accepted"] + server.stats["rejected"] == 40, 10, "all 40 answered")
            assert server.stats["rejected/rate_limited"] >= 6  # 0.5/s refills at most a few in the meantime
        finally:
            sock.close(0)
            ctx.term()


def test_a_revoked_key_is_refused_without_a_restart_live_connections_included(tmp_path):
    curve, curves, allowed = curve_keys(tmp_path, ("w1", "w2"))
    config = TransportConfig(**QUICK, keys_reload_s=0.1)

    def client(name: str) -> WorkerClient:
        return WorkerClient(server.control_endpoint, name, config, curve=curves[name])

    with LearnerServer("tcp://127.0.0.1:0", config, curve=curve) as server:
        w1, w2 = client("w1"), client("w2")
        clients = [w1, w2]
        try:
            w1.wait_ready(10), w2.wait_ready(10)
            moved = revoke_key(allowed, "w1")
            assert moved == allowed / "revoked" / "w1.key" and not (allowed / "w1.key").exists()
            # the live connection is refused within keys_reload_s: the worker is told and stops
            assert w1.finished.wait(10) and "removed" in w1.refused
            assert server.stats["revoked"] == 1 and [w.worker_id for w in server.workers()] == ["w2"]
            w2.send_many(whole("w2", "after"), 5)
            assert len(take_all(server, 4)) == 4  # the other worker goes on
            again = client("w1")  # a new connection by the revoked key is not let in
            clients.append(again)
            with pytest.raises(TransportTimeout):
                again.wait_ready(1.5)
            again.close()
            shutil.move(moved, allowed / "w1.key")  # allowed again: a new connection joins
            back = client("w1")
            clients.append(back)
            back.wait_ready(10)
        finally:
            for c in clients:
                c.close()
    with pytest.raises(ConfigError, match=r"no key 'w9' in .*allowed: w1, w2"):
        revoke_key(allowed, "w9")


def test_a_worker_that_dials_before_its_key_is_allowed_joins_once_the_learner_reads_it(tmp_path):
    """How `heterorl train --launcher ray` lets in a worker of a node added mid-run: its key is written into the
    running learner's allowed-keys folder as the worker starts, and a worker refused until the learner re-reads
    that folder (``keys_reload_s``) dials again (ZeroMQ does not retry a refused CURVE handshake)."""
    curve, curves, allowed = curve_keys(tmp_path, ("late",))
    held = shutil.move(allowed / "late.key", tmp_path / "late.key")
    config = TransportConfig(**QUICK, keys_reload_s=0.5)
    with LearnerServer("tcp://127.0.0.1:0", config, curve=curve) as server:
        client = WorkerClient(server.control_endpoint, "late", config, curve=curves["late"])
        try:
            wait_until(lambda: client.handshake_refused, 10, "the refused handshake")
            shutil.move(held, allowed / "late.key")
            client.wait_ready(20)
            assert client.stats["redialled"] >= 1 and [w.worker_id for w in server.workers()] == ["late"]
        finally:
            client.close()


def test_keys_revoke_on_the_command_line(tmp_path):
    make_keypair(tmp_path / "allowed", "w1")
    done = run_cli("keys", "revoke", "--name", "w1", "--allow-keys", str(tmp_path / "allowed"), timeout=60)
    assert done.returncode == 0 and "revoked w1" in done.stdout, done.stderr
    assert (tmp_path / "allowed" / "revoked" / "w1.key").is_file()
    missing = run_cli("keys", "revoke", "--name", "w1", timeout=60)
    assert missing.returncode == 2 and "needs --allow-keys" in missing.stderr


def test_peer_bounds_are_validated():
    with pytest.raises(ConfigError, match="worker_expiry_s"):
        TransportConfig(worker_expiry_s=1.0).validate()
    with pytest.raises(ConfigError, match="max_trajectories_per_s"):
        TransportConfig(max_trajectories_per_s=-1).validate()
    with pytest.raises(ConfigError, match="open_groups_per_worker"):
        TransportConfig(open_groups_per_worker=0).validate()


@pytest.mark.parametrize("busy", ["control", "weights"])
def test_a_port_in_use_is_an_error_at_once_naming_the_address(busy):
    """The bind fails fast (the socket that failed is closed, so nothing waits on it) and names the address.
    Only the channel under test is given a held port; the other binds port 0, so no other process can make it
    fail first."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        held = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        control, weights = (held, None) if busy == "control" else ("tcp://127.0.0.1:0", held)
        start = time.monotonic()
        with pytest.raises(TransportError, match=f"{held} is in use by another process"):
            LearnerServer(control, TransportConfig(linger_ms=0), weights_address=weights)
        assert time.monotonic() - start < 20  # it used to wait out the constructor's 30 s (a bind takes ms)
