"""What both ends of the transport share: addresses, CurveZMQ keys, socket setup, non-blocking send and receive,
the I/O thread's wake-up pipe, and the transport's errors.

Sockets are made here with a channel's high-water marks, linger and inbound size limit (`make_socket`); which
pattern, HWM and timeouts each channel uses is stated where the learner binds it (`learner_io.LearnerIO._open`)
and where a worker connects it (`client.WorkerClient._connect`).
"""

from __future__ import annotations

import ipaddress
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth

from heterorl.addresses import parse_host_port
from heterorl.config import TransportConfig
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.transport.protocol import Limits

# (send_time_s, size_bytes) -> delivery_time_s, or None when the link drops the message
DelaySchedule = Callable[[float, int], "float | None"]


class TransportError(HeteroRLError):
    """A transport operation failed (timeout, refused handshake, closed endpoint)."""


class TransportTimeout(TransportError):
    """A blocking transport call ran out of time. ``done``: how many of its items it got through first (for
    ``send_many``: the trajectories queued or dropped by the delay link; resend from there)."""

    def __init__(self, message: str, done: int = 0) -> None:
        super().__init__(message)
        self.done = done


@dataclass
class CurveConfig:
    """CurveZMQ keys (files made by ``heterorl keys``).

    Learner: ``secret_key_file`` (its own ``*.key_secret``) and
    ``allowed_keys_dir`` (a folder of the workers' public ``*.key`` files).
    Worker: ``secret_key_file`` (its own) and ``server_key_file`` (the
    learner's public ``*.key``).
    """

    secret_key_file: str
    server_key_file: str | None = None
    allowed_keys_dir: str | None = None

    def keypair(self) -> tuple[bytes, bytes]:
        path = Path(self.secret_key_file)
        if not path.is_file():
            raise ConfigError(f"CURVE secret key file {path} not found; make one with `heterorl keys --name NAME`")
        public, secret = zmq.auth.load_certificate(str(path))
        if secret is None:
            raise ConfigError(f"{path} holds no secret key; pass the *.key_secret file, not the public *.key")
        return public, secret

    def server_public_key(self) -> bytes:
        if not self.server_key_file or not Path(self.server_key_file).is_file():
            raise ConfigError(f"the learner's public key file {self.server_key_file!r} is missing; copy the "
                              "learner's *.key file to the worker and pass it as server_key_file (--server-key)")
        public, _ = zmq.auth.load_certificate(self.server_key_file)
        return public


def make_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (secret, mode 0600) into ``directory``. ``name`` is a
    plain file name (letters, digits, ``-``, ``_``, ``.``), so the files land in ``directory`` and nowhere else."""
    if name in (".", "..") or not name or any(not (c.isascii() and (c.isalnum() or c in "-_.")) for c in name):
        raise ConfigError(f"key name {name!r} must be a plain file name: letters, digits, '-', '_' and '.', not "
                          "'.' or '..' (no path: the key files go into --out)")
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{directory} is not a folder: give --out a folder for the key files") from None
    for suffix in (".key", ".key_secret"):
        if (directory / (name + suffix)).exists():
            raise ConfigError(f"{directory / (name + suffix)} exists; choose another --name or remove it")
    umask = os.umask(0o077)  # the secret file is never readable by others, not even before the chmod
    try:
        public, secret = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(umask)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o666 & ~umask)  # as any file the user writes: it is meant to be copied to the other side
    return Path(public), Path(secret)


REVOKED = "revoked"  # the subfolder of an allowed-keys folder where `revoke_key` moves a key
ADDRESS_EXAMPLE = "tcp://127.0.0.1:5555"  # an address a bad one is told to look like


def revoke_key(allowed_dir: str | Path, name: str) -> Path:
    """Take worker ``name``'s public key out of a learner's allowed-keys folder (into its ``revoked/``
    subfolder, kept as a record): a running learner refuses it within ``transport.keys_reload_s``, its live
    connections included. Returns where the key went."""
    folder = Path(allowed_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder: give --allow-keys the learner's folder of allowed *.key files")
    key = folder / f"{name}.key"
    if "/" in name or not key.is_file():
        present = sorted(path.stem for path in folder.glob("*.key"))
        raise ConfigError(f"no key {name!r} in {folder} (allowed: {', '.join(present) or 'none'})")
    (folder / REVOKED).mkdir(exist_ok=True)
    target = folder / REVOKED / key.name
    os.replace(key, target)
    return target


def _host_of(address: str) -> str:
    if "://" not in address:
        raise ConfigError(f"address {address!r} must look like tcp://HOST:PORT")
    scheme = address.split("://", 1)[0]
    if scheme in ("ipc", "inproc"):
        return "localhost"
    if scheme != "tcp":
        raise ConfigError(f"address {address!r}: only tcp://, ipc:// and inproc:// are supported")
    return parse_host_port(address, "address", ADDRESS_EXAMPLE)[0].strip("[]")


def is_loopback(address: str) -> bool:
    return is_loopback_host(_host_of(address))


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1); a name that is not an IP is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_security(address: str, curve: CurveConfig | None, config: TransportConfig, refusal: str) -> None:
    """Plaintext only on loopback, unless the config allows it; ``refusal`` is the error, naming the fix."""
    if curve is None and not is_loopback(address) and not config.allow_plaintext:
        raise ConfigError(refusal)


def port_of(address: str) -> int:
    return parse_host_port(address, "address", ADDRESS_EXAMPLE)[1]


def make_socket(ctx: zmq.Context, kind: int, hwm: int, config: TransportConfig, limits: Limits) -> zmq.Socket:
    """A socket with the channel's high-water marks, linger and inbound size limit."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, config.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_header_bytes + limits.max_chunk_bytes)
    return sock


def receive_waiting(sock: zmq.Socket, handle, limit: int = 256) -> None:
    """Hand up to ``limit`` waiting messages to ``handle(sock, frames)`` without blocking."""
    for _ in range(limit):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        handle(sock, frames)


def send_frames(sock: zmq.Socket, frames: list, stats: Counter, what: str) -> bool:
    """Non-blocking send; a full queue or a vanished peer is counted, never raised."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        stats[f"send_dropped/{what}"] += 1
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        stats[f"send_unreachable/{what}"] += 1
    return False


class Wakeup:
    """A self-pipe the I/O thread polls next to its sockets, so another thread can wake it at once (a pipe is
    safe to write from any thread; a ZeroMQ socket is not)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # already pending (pipe full) or closed: the thread will wake anyway

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class Endpoint:
    """Context-manager support: ``with LearnerServer(...) as server:`` closes it on the way out."""

    def close(self, reason: str = "") -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
