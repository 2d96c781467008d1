"""The userspace wire between two hosts of a test network, for kernels without ``netem``: a pair of TAP devices
per link, one moved into each host's namespace, and one process that carries every Ethernet frame from one to
the other after a delay, or drops it.

Per direction of each link: a delay drawn uniformly from [delay − jitter, delay + jitter] (``netem``'s default
jitter; frames overtake one another when jitter exceeds their spacing, as they do under ``netem``) and an
independent loss probability. Bandwidth is not the wire's: the kernel's ``tbf`` shapes each device's egress
(`heterorl.netlab.lab`).

    python -m heterorl.netlab.wire NAME_A NAME_B [NAME_A NAME_B ...]

creates the TAP devices (NAME_A of each link carries the learner's side), prints ``ready`` and forwards until its
standard input closes. It reads commands, one JSON object per line:
``{"link": I, "direction": "down"|"up"|"both", "delay_ms": D, "jitter_ms": J, "loss": P}`` (down: from
NAME_A to NAME_B) changes a link's shape; ``{"stats": true}`` prints one JSON line of frames carried and dropped
per link and direction. Requires root (``/dev/net/tun``).
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65_536
MAX_QUEUED = 100_000  # frames in flight on one wire at most: beyond, new frames are dropped (counted)


def open_tap(name: str) -> int:
    """A TAP device ``name`` (Ethernet frames, no packet info): its file descriptor, non-blocking."""
    if len(name.encode()) > 15:
        raise ValueError(f"interface name {name!r} is longer than 15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Shape:
    """One direction of a link: delay and jitter in seconds, loss probability; frames carried and dropped."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    carried: int = 0
    dropped: int = 0

    def update(self, command: dict) -> None:
        if "delay_ms" in command:
            self.delay_s = max(0.0, float(command["delay_ms"]) / 1000)
        if "jitter_ms" in command:
            self.jitter_s = max(0.0, float(command["jitter_ms"]) / 1000)
        if "loss" in command:
            self.loss = min(1.0, max(0.0, float(command["loss"])))

    def delay(self, rng: random.Random) -> float:
        if not self.jitter_s:
            return self.delay_s
        return max(0.0, rng.uniform(self.delay_s - self.jitter_s, self.delay_s + self.jitter_s))


@dataclass
class Wire:
    """Every link's two TAP descriptors and shapes, and the frames in flight (a heap by delivery time)."""

    fds: list[tuple[int, int]]
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    shapes: list[dict[str, Shape]] = field(default_factory=list)
    in_flight: list = field(default_factory=list)
    sequence: int = 0

    def __post_init__(self) -> None:
        self.shapes = [{"down": Shape(), "up": Shape()} for _ in self.fds]
        # fd → (link, direction, the fd its frames go out on)
        self.route = {}
        for i, (a, b) in enumerate(self.fds):
            self.route[a] = (i, "down", b)
            self.route[b] = (i, "up", a)

    def command(self, line: str) -> None:
        try:
            command = json.loads(line)
        except ValueError:
            print(json.dumps({"error": f"not JSON: {line[:100]!r}"}), flush=True)
            return
        if command.get("stats"):
            print(json.dumps({"stats": [{d: [s.carried, s.dropped] for d, s in shapes.items()}
                                        for shapes in self.shapes]}), flush=True)
            return
        link = command.get("link")
        if not isinstance(link, int) or not 0 <= link < len(self.shapes):
            print(json.dumps({"error": f"no link {link!r}"}), flush=True)
            return
        directions = ("down", "up") if command.get("direction", "both") == "both" else (command["direction"],)
        for direction in directions:
            self.shapes[link][direction].update(command)
        print(json.dumps({"ok": link}), flush=True)

    def receive(self, fd: int, now: float) -> None:
        """Read every frame waiting on ``fd`` and schedule (or drop) each."""
        link, direction, out = self.route[fd]
        shape = self.shapes[link][direction]
        while True:
            try:
                frame = os.read(fd, MAX_FRAME)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the device is down (a partition): nothing to read
                return
            if not frame:
                return
            if (shape.loss and self.rng.random() < shape.loss) or len(self.in_flight) >= MAX_QUEUED:
                shape.dropped += 1
                continue
            self.sequence += 1
            heapq.heappush(self.in_flight, (now + shape.delay(self.rng), self.sequence, out, frame, shape))

    def deliver(self, now: float) -> float | None:
        """Write every frame due by ``now``; seconds until the next one (None: none in flight)."""
        while self.in_flight and self.in_flight[0][0] <= now:
            _, _, out, frame, shape = heapq.heappop(self.in_flight)
            try:
                os.write(out, frame)
                shape.carried += 1
            except OSError:  # the far device is down or its queue full: the frame is lost, as on a wire
                shape.dropped += 1
        return None if not self.in_flight else max(0.0, self.in_flight[0][0] - now)


def serve(names: list[str]) -> None:
    if not names or len(names) % 2:
        raise SystemExit("usage: python -m heterorl.netlab.wire NAME_A NAME_B [NAME_A NAME_B ...]")
    fds = [(open_tap(a), open_tap(b)) for a, b in zip(names[::2], names[1::2])]
    wire = Wire(fds)
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    pending = b""
    readable = [stdin, *wire.route]
    timeout: float | None = None
    while True:
        ready, _, _ = select.select(readable, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd != stdin:
                wire.receive(fd, now)
                continue
            try:
                chunk = os.read(stdin, 65_536)
            except BlockingIOError:
                continue
            if not chunk:  # the lab closed our input: it is done with us
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    wire.command(line.decode(errors="replace"))
        timeout = wire.deliver(time.monotonic())


if __name__ == "__main__":
    serve(sys.argv[1:])
