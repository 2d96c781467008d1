"""The network lab itself (heterorl/netlab): hosts are separate network stacks with their own addresses, a link's
latency, loss and bandwidth are what it was set to (lower bounds: a link is never faster than its shape), a cut
link carries nothing until healed and a TCP connection outlives the cut, and nothing is left behind."""

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from heterorl.netlab import LEARNER_ADDRESS, LinkShape, NetLab, missing
from heterorl.netlab.lab import PREFIX

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return {name for name in listed if name.startswith(PREFIX)}


def tcp_server(lab: NetLab) -> socket.socket:
    """A listening TCP socket on the learner's address (port chosen by the kernel)."""
    with lab.inside("learner"):
        server = socket.create_server((LEARNER_ADDRESS, 0))
    server.settimeout(10)
    return server


def connect(lab: NetLab, host: str, port: int, timeout_s: float = 10) -> socket.socket:
    with lab.inside(host):
        return socket.create_connection((LEARNER_ADDRESS, port), timeout=timeout_s)


def test_hosts_are_separate_stacks_with_their_own_addresses():
    with NetLab(2) as lab:
        server = tcp_server(lab)
        port = server.getsockname()[1]
        for k in (1, 2):
            client = connect(lab, f"worker-{k}", port)
            peer, address = server.accept()
            assert address[0] == lab.address(f"worker-{k}") == f"10.201.{k}.2"
            client.sendall(b"ping")
            assert peer.recv(4) == b"ping"
            client.close()
            peer.close()
        # this process's loopback is not a worker host's: a server on it cannot be reached from there
        local = socket.create_server(("127.0.0.1", 0))
        with lab.inside("worker-1"), pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", local.getsockname()[1]), timeout=2)
        local.close()
        server.close()


def udp_pair(lab: NetLab, host: str) -> tuple[socket.socket, socket.socket, tuple[str, int]]:
    """A UDP socket on the learner and one on ``host``; the learner's address."""
    with lab.inside("learner"):
        receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        receiver.bind((LEARNER_ADDRESS, 0))
    with lab.inside(host):
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return receiver, sender, receiver.getsockname()


def test_a_links_delay_is_its_round_trip_and_its_loss_rate_is_what_was_set():
    shape = LinkShape(delay_ms=30)
    with NetLab(1, shape) as lab:
        server = tcp_server(lab)
        rtts = []
        for _ in range(5):  # a TCP handshake is one round trip: 2 x 30 ms at least
            start = time.monotonic()
            client = connect(lab, "worker-1", server.getsockname()[1])
            rtts.append(time.monotonic() - start)
            server.accept()[0].close()
            client.close()
        assert min(rtts) >= 0.058, rtts
        assert sorted(rtts)[2] < 1.0, rtts  # (the median: a loose bound, the wire is not lost in the delay)

        lab.shape("worker-1", LinkShape(loss=0.2), direction="up")  # changed while the hosts are up
        receiver, sender, address = udp_pair(lab, "worker-1")
        receiver.settimeout(2.0)
        got: set[bytes] = set()

        def receive():  # as they come: a socket's buffer holds a few hundred datagrams
            try:
                while True:
                    got.add(receiver.recv(16))
            except TimeoutError:
                pass

        reader = threading.Thread(target=receive)
        reader.start()
        sent = 2000
        for i in range(sent):
            sender.sendto(i.to_bytes(4, "big"), address)
            if i % 20 == 19:
                time.sleep(0.002)  # within the devices' queues: only the wire drops
        reader.join(60)
        # binomial(2000, 0.8): mean 1600, sd 17.9; the bounds are 5 sd away
        assert 1510 <= len(got) <= 1690, len(got)
        stats = lab.wire_stats()
        if stats:
            assert stats[0]["up"][1] >= sent - len(got)


def test_a_links_bandwidth_bounds_a_transfer():
    with NetLab(1, LinkShape(rate_mbit=8)) as lab:
        server = tcp_server(lab)
        client = connect(lab, "worker-1", server.getsockname()[1])
        peer, _ = server.accept()
        payload = b"x" * 1_000_000  # 8 Mbit: 1 s at 8 Mbit/s
        received = []

        def drain():
            total = 0
            while total < len(payload):
                chunk = peer.recv(65536)
                if not chunk:
                    break
                total += len(chunk)
            received.append(total)

        reader = threading.Thread(target=drain)
        start = time.monotonic()
        reader.start()
        client.sendall(payload)
        reader.join(30)
        elapsed = time.monotonic() - start
        assert received == [len(payload)]
        assert elapsed >= 0.9, elapsed  # headers add ~3 %, the burst is 10 ms
        client.close()
        peer.close()


def test_a_cut_link_carries_nothing_until_healed_and_a_connection_survives_it():
    with NetLab(2) as lab:
        server = tcp_server(lab)
        client = connect(lab, "worker-1", server.getsockname()[1])
        other = connect(lab, "worker-2", server.getsockname()[1])
        peers = {}
        for _ in range(2):
            sock, address = server.accept()
            peers[address[0]] = sock
        lab.cut("worker-1")
        client.sendall(b"during the cut")
        peers["10.201.1.2"].settimeout(1.5)
        with pytest.raises(TimeoutError):
            peers["10.201.1.2"].recv(64)
        other.sendall(b"the other link")  # the other worker's link is not cut
        peers["10.201.2.2"].settimeout(5)
        assert peers["10.201.2.2"].recv(64) == b"the other link"
        lab.heal("worker-1")
        peers["10.201.1.2"].settimeout(30)  # TCP retransmits: the bytes sent during the cut arrive
        assert peers["10.201.1.2"].recv(64) == b"during the cut"
        for sock in [client, other, *peers.values()]:
            sock.close()


def test_nothing_is_left_behind_and_a_dead_labs_namespaces_are_removed():
    # a lab whose process is gone: named for a pid no process can have (pids are below pid_max), where a pid of
    # a process that just ended could be given to a new one before the lab starts (the suite spawns thousands)
    stale = f"{PREFIX}{Path('/proc/sys/kernel/pid_max').read_text().strip()}-learner"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    before = namespaces() - {stale}
    with pytest.raises(RuntimeError, match="inside"):
        with NetLab(2) as lab:
            sleeper = lab.run("worker-1", ["sleep", "600"])
            assert stale not in namespaces()  # a lab whose process died: removed when this one started
            assert {lab.namespace(h) for h in lab.hosts()} <= namespaces()
            raise RuntimeError("a test that fails inside the lab")
    # nothing of this lab's is left, nor anything new; other labs' namespaces may go meanwhile (a lab another
    # test's process left behind is removed when its pid is seen dead, and a pid is reused on a busy machine)
    assert not {name for name in namespaces() if name.startswith(f"{lab.tag}-")}
    assert namespaces() <= before
    assert sleeper.poll() is not None
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"h{os.getpid() % 10**6}l" not in links
