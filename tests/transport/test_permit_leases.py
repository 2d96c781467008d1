"""Admission permits are leases (docs/RELIABILITY.md, "Permits"), on real loopback sockets: peers that hold
permits without delivering — silent ones, ones claiming groups they never send, ones opening groups they never
complete, ones ignoring their start limit — cannot stop an honest, delivering worker from starting groups.

Each test runs a stand-in learner (`Pace`: it takes whole groups and widens the cap by one per group taken,
a window of ``WINDOW`` groups ahead, as `heterorl learner` does per step) and an honest worker that starts,
samples and sends groups of 4 as its permits allow; it asserts that the honest worker delivers a fixed number
of groups while the attack goes on (before these bounds it delivered none, or one in ten minutes), never how
fast."""

import threading
import time
from collections import Counter

import zmq

from heterorl.config import TransportConfig
from heterorl.transport import LearnerServer, TransportTimeout, WorkerClient
from heterorl.transport.admission import Admission
from heterorl.transport.protocol import Heartbeat, Ready, decode, encode
from heterorl.transport.registry import WorkerInfo, WorkerRegistry
from tests.conftest import wait_until
from tests.transport.test_peer_bounds import ADDRESS, QUICK, hello_socket, member, say_hello, whole

WINDOW, AHEAD, HONEST_GROUPS = 4, 2, 24


class Pace:
    """The learner's end of admission: takes whole groups as they come and keeps the cap ``WINDOW`` groups
    ahead of those taken (by worker id, ``taken``)."""

    def __init__(self, server: LearnerServer) -> None:
        self.server, self.taken, self._stop = server, {}, threading.Event()
        server.set_admission(WINDOW, AHEAD)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for group in self.server.get_groups(100, timeout_s=0.05):
                self.taken[group[0].sampler_id] = self.taken.get(group[0].sampler_id, 0) + 1
                self.server.set_admission(WINDOW + sum(self.taken.values()), AHEAD)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Honest:
    """A worker that starts a group only on a permit and sends it whole, ``HONEST_GROUPS`` of them."""

    def __init__(self, endpoint: str, config: TransportConfig, name: str = "honest") -> None:
        self.client, self.name, self.sent = WorkerClient(endpoint, name, config), name, 0
        self.client.wait_ready(10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Honest":
        self._thread.start()
        return self

    def _run(self) -> None:
        while self.sent < HONEST_GROUPS and not self._stop.is_set():
            if not self.client.acquire_starts(1, timeout_s=0.2):
                continue
            group = whole(self.name, f"{self.name}-{self.sent}")
            while group and not self._stop.is_set():
                try:
                    self.client.send_many(group, 1.0)
                    group = []
                except TransportTimeout as exc:
                    group = group[exc.done:]
            self.sent += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def peer(ctx: zmq.Context, server: LearnerServer, name: str) -> zmq.Socket:
    """A raw registered peer (it said hello and was answered ready)."""
    sock = hello_socket(ctx, server.control_endpoint)
    say_hello(sock, name)
    assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Ready)
    return sock


def test_silent_and_claiming_peers_and_one_ignoring_its_start_limit_cannot_stall_an_honest_worker():
    """Five peers that only heartbeat, four that claim 2^31 - 1 groups started, and one that sends 40 whole
    groups without a permit: the honest worker delivers its groups all the same, the claims buy nothing, and
    the groups beyond the greedy peer's start limit are refused, ``over_start_limit``."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=64)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        pace = Pace(server)
        silent = [WorkerClient(server.control_endpoint, f"silent-{i}", config) for i in range(5)]
        socks, honest = [], None
        try:
            for client in silent:
                client.wait_ready(10)
            # (which two of the five hold the fleet's two probation permits follows the order their hellos arrived)
            wait_until(lambda: sum(c.start_limit >= 1 for c in silent) == 2, 10, "the probation permits taken")
            socks = [peer(ctx, server, f"claim-{i}") for i in range(4)]
            for i, sock in enumerate(socks):
                sock.send_multipart(encode(Heartbeat(f"claim-{i}", 0, time.time(), groups_started=2**31 - 1)))
            greedy = peer(ctx, server, "greedy")
            socks.append(greedy)
            for g in range(40):
                for traj in whole("greedy", f"greedy-{g}"):
                    greedy.send_multipart(encode(traj))
            honest = Honest(server.control_endpoint, config).start()
            wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                       lambda: f"the honest worker's groups taken: {pace.taken}; {server.admission_state()}")
            wait_until(lambda: server.stats["rejected/over_start_limit"] >= 38, 10, "the greedy groups refused")
            assert pace.taken.get("greedy", 0) <= 2  # a probation permit (and one more once it delivered)
            assert not any(name.startswith(("silent", "claim")) for name in pace.taken)
            assert all(w.starts_granted_session - w.permits_voided <= 1 for w in server.workers()
                       if w.worker_id.startswith(("silent", "claim")))  # a probation permit at most each
        finally:
            if honest is not None:
                honest.close()
            pace.close()
            for client in silent:
                client.close()
            for sock in socks:
                sock.close(0)
            ctx.term()


def test_groups_a_peer_opens_and_never_completes_stall_the_fleet_for_seconds_not_minutes():
    """A peer that first delivers whole groups (so it holds its share), then sends one member of each of 32
    groups and goes quiet: the groups beyond its start limit are refused, and those it could start are dropped
    once 4 x its measured assembly time (at least ``group_deadline_min_s``) has passed, far below
    ``group_timeout_s``; the honest worker delivers its groups meanwhile."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=256, group_timeout_s=600.0,
                             group_deadline_min_s=1.0)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        pace = Pace(server)
        sock, honest = peer(ctx, server, "opener"), None
        try:
            wait_until(lambda: any(w.worker_id == "opener" and w.starts_granted_session >= 1
                                   for w in server.workers()), 10, "the opener's probation permit")
            for g in range(3):  # deliver: now it holds its share of the cap
                for traj in whole("opener", f"done-{g}"):
                    sock.send_multipart(encode(traj))
                wait_until(lambda g=g: pace.taken.get("opener", 0) == g + 1, 10, "the opener's group taken")
            for g in range(32):
                sock.send_multipart(encode(member("opener", f"open-{g}", 0)))
            wait_until(lambda: server.stats["accepted"] >= 12 + 1, 10, "the opener's first open group")
            honest = Honest(server.control_endpoint, config).start()
            wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                       lambda: f"the honest worker's groups taken: {pace.taken}; {server.admission_state()}")
            wait_until(lambda: server.stats["dropped_groups/group_expired"] >= 1, 20, "the open groups dropped")
            assert server.stats["rejected/over_start_limit"] >= 32 - AHEAD - 2
        finally:
            if honest is not None:
                honest.close()
            pace.close()
            sock.close(0)
            ctx.term()


def test_in_sync_mode_a_worker_waiting_for_the_next_version_keeps_its_permits_however_long_the_step():
    """The learner takes the batch; the worker holds permits for its next share but cannot use them before the
    next version lands. A step that outlasts the lease (an evaluation under load) once put it on probation: its
    permits went back, it got one beyond the cap, and it sampled a group for the version after the last step
    (the sync run's waste, seen in CI). Now the lease clock stands still until its heartbeats say it holds the
    version, then runs again."""
    config = TransportConfig(permit_lease_s=60.0, permit_lease_min_s=5.0)
    stats = Counter()
    registry = WorkerRegistry(config, stats)
    worker = WorkerInfo("w0", "host", 1, b"w0", None, joined_at=0.0, last_seen=0.0, version_held=1,
                        released_version=1)
    registry.workers["w0"] = worker
    admission = Admission(registry, config, stats)
    admission.set(cap=8, ahead=4)

    def never(_):
        return False

    admission.grant_all(0.0, never)  # on probation: one permit; its group completes, then it holds its share
    admission.count_start(worker, "g0")
    admission.count_complete(worker, "g0", now=1.0)
    admission.grant_all(1.0, never)
    admission.count_start(worker, "g1")
    admission.count_complete(worker, "g1", now=1.5)
    admission.grant_all(1.5, never)
    assert admission.delivering(worker, 1.5) and admission._unused(worker) == 4
    admission.await_version(2)  # the learner took the batch of version 1
    for now in (30.0, 100.0, 300.0):  # the step takes 5 minutes: the lease (at most 60 s) would have run out
        admission.grant_all(now, never)
        assert admission.delivering(worker, now) and admission._unused(worker) == 4, now
    assert stats["permits_returned"] == 0 and admission.probation_unused == 0
    worker.version_held = 2  # its heartbeat says it holds the version: now it owes its share, and the clock runs
    admission.grant_all(301.0, never)
    admission.grant_all(400.0, never)
    assert not admission.delivering(worker, 400.0) and stats["permits_returned"] == 1
