"""The work one peer makes the learner do is bounded (docs/RELIABILITY.md, "Work a peer makes"): a connection
whose messages are refused at a high rate is throttled — its messages discarded unread — and then its worker
disconnected for a back-off, on real loopback sockets; `PeerThrottle`'s rules on their own."""

import contextlib
import subprocess
import sys
import time

import msgpack
import zmq

from heterorl.config import TransportConfig
from heterorl.transport import LearnerServer
from heterorl.transport.protocol import Ack, Bye, Hello, TrajectoryBatch, decode, encode
from heterorl.transport.throttle import MAX_BACKOFF_S, PeerThrottle, Verdict
from tests.conftest import ENV, REPO, wait_until
from tests.transport.test_peer_bounds import ADDRESS, QUICK, hello_socket, member
from tests.transport.test_permit_leases import HONEST_GROUPS, Honest, Pace, peer


@contextlib.contextmanager
def beside_an_honest_worker(config: TransportConfig, attacker: str):
    """A learner's end taking groups as a learner does (`Pace`), an honest worker sending its groups (`Honest`),
    and a raw registered peer named ``attacker``: (the server, its pace, the peer's socket), all closed after."""
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        pace = Pace(server)
        honest = Honest(server.control_endpoint, config).start()
        sock = peer(ctx, server, attacker)
        try:
            yield server, pace, sock
        finally:
            honest.close()
            pace.close()
            sock.close(0)
    ctx.term()


def test_a_peer_flooding_refusable_messages_is_throttled_then_disconnected_and_the_honest_worker_goes_on():
    """Three waves of 20 messages of 2,048 trajectories each beyond the peer's permits: each wave's first
    message is decoded and refused, and its connection throttled: the other 19 are discarded unread (before,
    each cost the learner's I/O thread its decoding and 2,048 refusals); at the third throttle the peer is told
    busy, its id refused for the back-off and its TCP connection cut; the honest worker's groups are all taken."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=64, throttle_s=0.5)
    with beside_an_honest_worker(config, "flood") as (server, pace, flood):
        frames = encode(TrajectoryBatch([member("flood", f"f-{j}", 0, size=1) for j in range(2048)]))
        for wave, back_off in enumerate((0.5, 1.0, 2.0)):  # each wave once the last throttle is over
            for _ in range(20):
                flood.send_multipart(frames)
            wait_until(lambda: server.stats["throttled/discarded"] == 19 * (wave + 1), 30,
                       lambda: dict(server.stats))  # the wave's first message decoded, the rest unread
            time.sleep(back_off + 0.1)
        assert (server.stats["throttled/throttled"], server.stats["throttled/disconnect"]) == (2, 1)
        wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                   lambda: f"the honest worker's groups taken: {pace.taken}")
        assert "flood" not in {w.worker_id for w in server.workers()}
        answers = []
        while flood.poll(1000):
            answers.append(decode(flood.recv_multipart()))
        byes = [a for a in answers if isinstance(a, Bye)]
        assert byes and byes[-1].busy and "disconnected for 2 s" in byes[-1].reason
        # and its TCP connection was cut once the bye had gone out: what it sends now comes on a new connection,
        # which has not said hello, and a message of several frames from one is refused unread
        wait_until(lambda: server.stats["throttled/connections_cut"] == 1, 10, lambda: dict(server.stats))
        refused = server.stats["rejected/unknown_peer"]
        flood.send_multipart(encode(TrajectoryBatch([member("flood", "x", 0, size=1)])))
        wait_until(lambda: server.stats["rejected/unknown_peer"] == refused + 1, 10, lambda: dict(server.stats))


def test_the_throttle_doubles_its_back_off_disconnects_and_forgets_a_quiet_peer():
    throttle = PeerThrottle(max_refusals_per_s=10, throttle_s=1.0, throttles_before_disconnect=3)
    assert throttle.count(b"p", 10, 0.0) is Verdict.OK  # at the rate: fine
    assert throttle.count(b"p", 1, 0.5) is Verdict.THROTTLED
    assert throttle.discards(b"p", 1.4) and not throttle.discards(b"p", 1.6) and not throttle.discards(b"q", 1.0)
    assert throttle.count(b"p", 11, 2.0) is Verdict.THROTTLED and throttle.backoff_s(b"p") == 2.0
    assert throttle.count(b"p", 11, 5.0) is Verdict.DISCONNECT and throttle.backoff_s(b"p") == 4.0
    assert throttle.count(b"p", 11, 100.0) is Verdict.THROTTLED  # quiet for a minute: it starts over
    assert throttle.count(b"p", 5, 200.0) is Verdict.OK and throttle.count(b"p", 5, 200.5) is Verdict.OK
    assert throttle.count(b"p", 1, 201.5) is Verdict.OK  # a new second, a new window
    many = PeerThrottle(1, 1000.0, 100)
    for k in range(12):
        many.count(b"p", 2, 10_000.0 * k)
    assert many.backoff_s(b"p") == MAX_BACKOFF_S
    throttle.ban(["w", "key"], until=10.0)
    assert throttle.banned_for(["w"], 4.0) == 6.0 and throttle.banned_for(["other", "key"], 9.0) == 1.0
    assert throttle.banned_for(["w", ""], 10.5) == 0.0


def answers_of(sock: zmq.Socket, seconds: float) -> list:
    """What the learner sent ``sock`` within ``seconds``, decoded."""
    found, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            found.append(decode(sock.recv_multipart()))
    return found


def told(answers: list) -> list[str]:
    return [reason for a in answers if isinstance(a, Ack) for reason in a.rejected]


def test_messages_larger_than_a_peers_byte_budget_are_dropped_unread_and_the_peer_is_told():
    """A registered peer's 2 MB messages against a budget of 1 MiB: each is dropped before any decoding (none
    refused, none counted as received trajectories), the peer is told why at most once a second, and the
    honest worker's groups are all taken."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=64,
                             peer_inbound_bytes=2**20)
    with beside_an_honest_worker(config, "big") as (server, pace, big):
        frames = encode(TrajectoryBatch([member("big", f"b-{j}", 0, size=1, tokens=40_000) for j in range(4)]))
        assert sum(len(f) for f in frames) > 2 * 10**6
        for _ in range(30):
            big.send_multipart(frames)
        wait_until(lambda: server.stats["inbound/dropped/too_large"] == 30, 30, lambda: dict(server.stats))
        assert server.stats["rejected"] == 0 and "big" not in pace.taken  # never decoded
        reasons = [r for r in told(answers_of(big, 1.5)) if r.startswith("too_large")]
        assert 1 <= len(reasons) <= 2, reasons  # once a second at most
        assert "transport.peer_inbound_bytes" in reasons[0] and "transport.trajectory_batch" in reasons[0]
        wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                   lambda: f"the honest worker's groups taken: {pace.taken}")


def test_a_peer_past_its_work_budget_is_not_handled_until_it_refills_and_what_it_sends_meanwhile_is_dropped():
    """Messages of 2,048 duplicates each (acknowledged again, never refused: no throttle sees them) from a peer,
    every peer's work budget being 50 ms of the I/O thread a second and its bytes two such messages: what it
    sends while its bucket is empty, or beyond the bytes it has waiting, is dropped unread as it is read, counted
    and told; the honest worker (a millisecond a message) keeps within its own budget and its groups are all
    taken."""
    group = [member("dup", "d", j) for j in range(4)]
    frames = encode(TrajectoryBatch([group[j % 4] for j in range(2048)]))  # every member a duplicate, once sent
    size = sum(len(frame) for frame in frames)
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=4096,
                             peer_work_s_per_s=0.05, peer_work_burst_s=0.05, peer_inbound_bytes=2 * size + 2**16)
    with beside_an_honest_worker(config, "dup") as (server, pace, dup):
        wait_until(lambda: server.workers() and any(
            w.worker_id == "dup" and w.starts_granted_session >= 1 for w in server.workers()), 10,
            "the peer's probation permit")
        dup.send_multipart(encode(TrajectoryBatch(group)))  # one whole group on its permit: taken in
        wait_until(lambda: any(w.worker_id == "dup" and w.trajectories == 4 for w in server.workers()), 10,
                   lambda: dict(server.stats))
        for _ in range(40):
            dup.send_multipart(frames)
        # dropped as they are read: while its bucket is empty (work_spent), or, while it holds two messages
        # waiting, beyond its bytes (over_budget), whichever comes first on this machine
        wait_until(lambda: server.stats["inbound/dropped/work_spent"] + server.stats["inbound/dropped/over_budget"]
                   >= 1, 30, lambda: dict(server.stats))
        assert any(r.startswith(("work_spent", "over_budget")) and "transport.peer_" in r
                   for r in told(answers_of(dup, 1.5)))
        assert server.stats["duplicates"] < 40 * 2048  # not every message was handled
        wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                   lambda: f"the honest worker's groups taken: {pace.taken}")


def test_a_message_refused_at_decode_is_told_naming_its_field():
    """A registered peer's batch whose data frame is 4 bytes short is told in its next ack, naming ``data``; a
    connection that has not said hello and sends a hello of another schema version is refused, naming ``v``."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0})
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        short = peer(ctx, server, "short")
        stranger = hello_socket(ctx, server.control_endpoint)
        try:
            header, data = encode(TrajectoryBatch([member("short", "s", 0, size=1)]))
            short.send_multipart([header, bytes(data)[:-4]])
            reasons = told(answers_of(short, 1.0))
            assert any(r.startswith("refused_at_decode: length_mismatch: field `data`") for r in reasons), reasons
            hello = msgpack.unpackb(encode(Hello("stranger", "h", 1, -1, time.time()))[0])
            stranger.send_multipart([msgpack.packb({**hello, "v": 1})])
            byes = [a for a in answers_of(stranger, 1.0) if isinstance(a, Bye)]
            assert byes and byes[0].refuses and "field `v`" in byes[0].reason, byes
        finally:
            short.close(0)
            stranger.close(0)
            ctx.term()



FLOOD = """
import sys, time, zmq
from heterorl.transport.protocol import Hello, encode
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect(sys.argv[1])
sock.send_multipart(encode(Hello("tiny", "h", 1, -1, time.time())))
assert sock.poll(10_000)
sock.recv_multipart()  # ready
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[2]):
    for _ in range(100):
        sock.send(b"x")  # refused at decode until its connection is throttled, then discarded unread
print("sent", flush=True)
"""


def test_reading_a_throttled_flood_of_tiny_messages_is_paced_and_the_honest_worker_goes_on():
    """A registered peer (another process) throttled for its refusals keeps sending one-byte messages as fast as
    it can for 3 s: each must be read to be discarded, a read no peer's budget pays for. The I/O thread's time
    reading them stays within `transport.discard_read_s_per_s` (0.05 s a second, and a burst of 1 ms): reading
    pauses when it is spent, and the honest worker's groups, read between the pauses, are all taken. Without the
    pace the thread read them as fast as they came (0.69 s of reading against a bound of 0.17). Whether reading
    paused at all depends on how fast the flood came (a loaded suite once sent 11,000 messages in the 3 s, 35 ms
    of reading): only the bound is asserted."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=64,
                             max_refusals_per_s=10, throttle_s=60.0)
    with LearnerServer(ADDRESS, config) as server:
        pace = Pace(server)
        honest = Honest(server.control_endpoint, config).start()
        start = time.monotonic()
        flood = subprocess.run([sys.executable, "-c", FLOOD, server.control_endpoint, "3"], env=ENV, cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        try:
            assert flood.returncode == 0 and "sent" in flood.stdout, flood.stderr[-2000:]
            wait_until(lambda: server.stats["throttled/throttled"] == 1, 30, lambda: dict(server.stats))
            wait_until(lambda: pace.taken.get("honest", 0) == HONEST_GROUPS, 60,
                       lambda: f"the honest worker's groups taken: {pace.taken}")
            read_s, elapsed = server.stats["inbound/dropped_read_s"], time.monotonic() - start
        finally:
            honest.close()
            pace.close()
    assert server.stats["throttled/discarded"] > 0
    default = TransportConfig()  # (the test's config keeps the pace's defaults)
    assert read_s <= default.discard_read_s_per_s * elapsed + default.discard_read_burst_s + 0.005, (
        read_s, elapsed, dict(server.stats))
