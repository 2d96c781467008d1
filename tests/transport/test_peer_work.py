"""The work one peer makes the learner do is bounded (docs/RELIABILITY.md, "Work a peer makes"): a connection
whose messages are refused at a high rate is throttled — its messages discarded unread — and then its worker
disconnected for a back-off, on real loopback sockets; `PeerThrottle`'s rules on their own."""

import time

import zmq

from heterorl.config import TransportConfig
from heterorl.transport import LearnerServer
from heterorl.transport.protocol import Bye, TrajectoryBatch, decode, encode
from heterorl.transport.throttle import MAX_BACKOFF_S, PeerThrottle, Verdict
from tests.conftest import wait_until
from tests.transport.test_peer_bounds import ADDRESS, QUICK, member
from tests.transport.test_permit_leases import HONEST_GROUPS, Honest, Pace, peer


def test_a_peer_flooding_refusable_messages_is_throttled_then_disconnected_and_the_honest_worker_goes_on():
    """Three waves of 20 messages of 2,048 trajectories each beyond the peer's permits: each wave's first
    message is decoded and refused, and its connection throttled: the other 19 are discarded unread (before,
    each cost the learner's I/O thread its decoding and 2,048 refusals); at the third throttle the peer is told
    busy and its id refused for the back-off; the honest worker's groups are all taken."""
    config = TransportConfig(**{**QUICK, "heartbeat_timeout_s": 30.0}, credits_per_worker=64, throttle_s=0.5)
    ctx = zmq.Context()
    with LearnerServer(ADDRESS, config) as server:
        pace = Pace(server)
        honest = Honest(server.control_endpoint, config).start()
        flood = peer(ctx, server, "flood")
        try:
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
            flood.send_multipart(encode(member("flood", "x", 0, size=1)))  # (discarded: still throttled)
        finally:
            honest.close()
            pace.close()
            flood.close(0)
            ctx.term()


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
