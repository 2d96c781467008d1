"""A worker's trajectories on their way out: held until their trajectories link delivers them, then sent in
``trajectories`` messages of up to ``trajectory_batch`` (`Outbox`), each written into a reused buffer
(`SendBuffers`)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import zmq

from heterorl.config import TransportConfig
from heterorl.delay.queue import DelayQueue
from heterorl.transport.protocol import Trajectory, TrajectoryBatch, encode


class SendBuffers:
    """Reusable buffers for outgoing trajectory batches. A fresh multi-megabyte array per message costs more
    in page faults than the copy into it (the allocator gives freed memory back to the system and faults it
    in again on the next message), so the worker keeps ``keep`` buffers and reuses each once ZeroMQ reports
    it is done with the frames viewing it."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.allocated = 0  # new buffers made (the rest of the messages reused one)
        self._free: list[np.ndarray] = []
        self._busy: list[tuple[np.ndarray, zmq.MessageTracker]] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes``: a released one if it fits, else a new one."""
        self._free += [buffer for buffer, tracker in self._busy if tracker.done]
        self._busy = [(buffer, tracker) for buffer, tracker in self._busy if not tracker.done]
        for i in range(len(self._free) - 1, -1, -1):  # the most recently released first: the warmest in cache
            if len(self._free[i]) >= nbytes:
                return self._free.pop(i)
        if self._free and len(self._free) + len(self._busy) >= self.keep:
            self._free.pop(0)  # too small for today's batches: let it go
        self.allocated += 1
        return np.empty(max(1 << 16, 1 << (nbytes - 1).bit_length()), np.uint8)  # headroom for bigger batches

    def sent(self, buffer: np.ndarray, tracker: zmq.MessageTracker) -> None:
        if len(self._free) + len(self._busy) < self.keep:
            self._busy.append((buffer, tracker))

    def unused(self, buffer: np.ndarray) -> None:
        """``buffer`` was taken but nothing was sent from it."""
        if len(self._free) + len(self._busy) < self.keep:
            self._free.append(buffer)



class Outbox:
    """The trajectories a worker queued (`WorkerClient.send`) and its control socket has not taken yet. Each
    waits in ``queue`` (a `DelayQueue`) until its trajectories link delivers it (at once without a delay link);
    the I/O thread then sends the due ones in messages of up to ``trajectory_batch``. ``queue`` and ``in_hand``
    are guarded by the client's ``lock``; messages are encoded and sent outside it, so ``send`` is not held up
    meanwhile."""

    def __init__(self, config: TransportConfig, stats: Counter, lock: threading.Condition,
                 buffers: SendBuffers) -> None:
        self.config, self.stats, self.buffers, self._lock = config, stats, buffers, lock
        self.queue: DelayQueue[Trajectory] = DelayQueue()  # a reordering delay link may reorder
        self.in_hand = 0  # trajectories taken from the queue by the I/O thread and not yet handed to the socket

    def send_due(self, control: zmq.Socket, now: float, time_scale: float) -> None:
        """Send the trajectories due at ``now`` (on the delay clock, which runs ``time_scale`` times real time);
        a partial batch waits until its oldest member has been due for ``trajectory_linger_ms`` (a few ms of
        latency for far fewer messages). What the socket will not take (HWM reached) stays queued."""
        size = self.config.trajectory_batch
        linger = self.config.trajectory_linger_ms / 1000 * time_scale
        with self._lock:
            if not self.queue:
                return
            due = self.queue.count_due(now)
            if due < size and (not due or now - self.queue.next_due_time() < linger):
                return
            held = self.queue.pop_due(now)
            batches = [held[start:start + size] for start in range(0, len(held), size)]
            self.in_hand = len(held)
        try:
            for i, batch in enumerate(batches):
                if not self._send_batch(control, [entry[2] for entry in batch]):
                    with self._lock:  # HWM reached: keep them queued, try on the next loop
                        self.queue.restore([entry for unsent in batches[i:] for entry in unsent])
                    break
        finally:
            with self._lock:
                self.in_hand = 0
                self._lock.notify_all()

    def _send_batch(self, control: zmq.Socket, trajectories: list[Trajectory]) -> bool:
        """One ``trajectories`` message, its arrays sent without a copy from a reused buffer; False when the
        socket would block."""
        sent_at = time.time()
        for traj in trajectories:
            traj.sent_at = sent_at
        message = TrajectoryBatch(trajectories)
        buffer = self.buffers.take(message.payload_nbytes())
        header, *data = encode(message, out=buffer)
        frames = [zmq.Frame(frame, copy=False, track=True) for frame in data]
        try:
            control.send_multipart([header, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.buffers.unused(buffer)
            self.stats["send_blocked"] += 1
            return False
        self.buffers.sent(buffer, zmq.MessageTracker(*frames))
        self.stats["sent"] += len(trajectories)
        return True
