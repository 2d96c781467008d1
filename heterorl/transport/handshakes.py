"""Refused handshakes, said on both ends. ZeroMQ refuses a connection before any message of ours is read — a CURVE
key the learner does not allow, a worker whose ``--server-key`` is not the learner's, plaintext against CURVE —
and says nothing unless asked. Here it is asked:

- the learner's authenticator (`RefusalLoggingAuthenticator`) names each key it refuses, with the peer's address;
- a socket monitor (`HandshakeMonitor`) on each end reads ZeroMQ's handshake failures: the learner logs them, and
  a worker keeps the latest, which its timeout message names (`WorkerClient.handshake_refused`).

The learner's lines are rate-limited (`RateLimitedLog`): a worker dialling again every second is one line per
``every_s`` per cause, with the count of the others. ZeroMQ's monitor gives the learner's listening endpoint,
not the peer's address, for the failures its authenticator does not see (a wrong server key, plaintext)."""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
FINGERPRINT_CHARS = 8  # of a key's z85 text: enough to tell keys apart in a log, too few to be the key


def fingerprint(z85_key: bytes | str) -> str:
    """The start of a public key's z85 text (the text `heterorl keys` writes into NAME.key)."""
    text = z85_key.decode("ascii", "replace") if isinstance(z85_key, bytes) else z85_key
    return text[:FINGERPRINT_CHARS] + "…"


MISMATCH = ("one end speaks CURVE and the other plaintext: give both ends keys (--curve-secret, and the learner's "
            "public key as --server-key on the worker) or neither")


def handshake_cause(event: int, value: int, side: str) -> str:
    """What a handshake failure means, in words, as ``side`` ("learner", "worker" or "plaintext worker") sees
    it. The end that finds a mismatch of mechanisms (CURVE against plaintext) closes the connection, and which end
    finds it first is a race: the other sees only a handshake closed without a reason, so that is told by what
    this end knows (a plaintext worker's cause is the mismatch)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the learner refused this worker's CURVE key: its public key is not in the learner's allowed-keys "
                "folder (copy this worker's NAME.key there; `heterorl keys revoke` removes one)" if side == "worker"
                else "a CURVE key not in the allowed-keys folder")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return MISMATCH
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "a CURVE handshake that could not be decrypted: the worker's --server-key is not this learner's key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and side == "plaintext worker":
        return ("the learner closed the handshake without a reason: most likely it uses CURVE and this worker "
                f"does not ({MISMATCH})")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and side == "worker":
        return ("the learner closed the CURVE handshake without a reason: most likely --server-key is not the "
                "learner's public key (its log says so)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"a handshake the peer closed without a reason: most likely {MISMATCH.split(':')[0]}, or the "
                "worker's --server-key is not this learner's key (the worker's own log says which)")
    return f"ZeroMQ handshake failure (event {event}, value {value})"


class RateLimitedLog:
    """At most one line per cause every ``every_s`` seconds; the next says how many were left out."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, cause: str, message: str) -> bool:
        """Log ``message`` unless ``cause`` was logged within ``every_s``; True when it was logged."""
        now = time.monotonic()
        if now - self._last.get(cause, -float("inf")) < self.every_s:
            self._left_out[cause] = self._left_out.get(cause, 0) + 1
            return False
        self._last[cause] = now
        more = self._left_out.pop(cause, 0)
        self.logger.warning("%s%s", message, f" (and {more} more like it in the last {self.every_s:g} s)"
                            if more else "")
        return True


class HandshakeMonitor:
    """ZeroMQ's handshake failures on one socket, read without blocking from its monitor socket (``socket``,
    for a poller)."""

    def __init__(self, sock: zmq.Socket, side: str) -> None:
        self._watched, self.side = sock, side
        self.socket = sock.get_monitor_socket(HANDSHAKE_EVENTS)

    def read(self) -> list[tuple[int, str]]:
        """The failures since the last read: (ZeroMQ's event, its cause in words)."""
        failures = []
        while self.socket.poll(0):
            message = parse_monitor_message(self.socket.recv_multipart())
            event = int(message["event"])
            failures.append((event, handshake_cause(event, int(message["value"]), self.side)))
        return failures

    def close(self) -> None:
        """Stop monitoring (before the watched socket closes)."""
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:
            pass  # the watched socket is already closed
        self.socket.close(0)


class RefusalLoggingAuthenticator(ThreadAuthenticator):
    """The learner's CURVE authenticator: a `ThreadAuthenticator` that also logs each key it refuses, with the
    peer's address and the key's fingerprint (rate-limited per key)."""

    def __init__(self, context: zmq.Context, refusals: RateLimitedLog, allowed_dir: str) -> None:
        super().__init__(context, log=logging.getLogger("heterorl.auth"))
        self._refusals, self._allowed_dir = refusals, allowed_dir

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        await super().handle_zap_message(msg)
        if len(msg) != 7 or msg[5] != b"CURVE" or len(msg[6]) != 32:
            return  # (the base class has answered and logged a malformed request)
        domain, address, key = msg[2].decode("utf-8", "replace") or "*", msg[3].decode("utf-8", "replace"), msg[6]
        z85_key = z85.encode(key)
        if not self.certs.get(domain, {}).get(z85_key):
            self._refusals.warning(f"key {z85_key!r}", f"refused a CURVE handshake from {address}: key "
                                   f"{fingerprint(z85_key)} is not in the allowed-keys folder {self._allowed_dir}")
