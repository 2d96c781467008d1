"""``heterorl bench transport``: our ZeroMQ transport against raw pyzmq moving the same bytes, in one run.

Trajectories: ``--trajectories`` trajectories per measurement (``--prompt-tokens``
+ ``--completion-tokens``; ~62 KB encoded by default), sent from each count of
worker processes in ``--workers`` (spawned; each runs a ``WorkerClient`` and
sends its share as fast as credit allows, a group of 8 per ``send_many`` call as
the rollout worker does) into one ``LearnerServer`` in this
process, which consumes them with ``get``. Baseline: the same encoded frames,
the same count and the same number of sender processes over raw PUSH/PULL
(PULL here; no validation, no credit). MB/s counts encoded frame bytes. CPU per
trajectory sums user+system time of every process taking part (learner or
PULL here, plus the senders), so it stays meaningful on a busy machine where
the rates are noisy.

Weights: ``publish`` of a ``--weights-mib`` state dict (float32 tensors of 1M
elements) until ``--weight-receivers`` worker processes hold the verified
version. Baseline: the same bytes, in the same 4 MiB chunks, sent raw ROUTER →
DEALER to as many receiver processes, which keep the frames (no checksum, no
reassembly). The time runs from just before ``publish`` (or the first raw send)
in this process to the latest receiver's ``time.time()`` on completion; GB/s
counts the bytes delivered to all receivers. Peak memory of a receiver is its
``VmHWM`` (``ru_maxrss`` would report the parent's size: Linux keeps it across
the fork + exec of a spawned process).

Rounds alternate ours / raw; each figure is the best of ``--repeats`` after a
warm-up round.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import resource
import time
from typing import Any

import numpy as np

_HOST = "tcp://127.0.0.1"
_TIMEOUT_S = 120.0
_TRAJECTORY_TARGET = 0.8
_WEIGHTS_TARGET = 0.6
_GROUP = 8  # completions per prompt: a worker hands the transport one scored group at a time
_VOCAB = 151_936  # token ids are drawn below 150,000; the contract's vocabulary is a Qwen2.5 model's
_VERSION = 7  # every trajectory's policy version, published before the senders start


# -- payloads and measurements ----------------------------------------------------------------------

def _trajectory(sampler_id: str, prompt_tokens: int, completion_tokens: int):
    """A realistic trajectory: random token ids, negative log-probs, one policy version."""
    from heterorl.transport.protocol import Trajectory

    rng = np.random.default_rng(0)
    now = time.time()
    return Trajectory(
        trajectory_id=f"{sampler_id}-0", group_id="g-0", prompt_id="p-0", sampler_id=sampler_id, group_size=_GROUP,
        prompt_tokens=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        completion_tokens=rng.integers(0, 150_000, completion_tokens, dtype=np.int32),
        behaviour_logprobs=-rng.exponential(1.0, completion_tokens).astype(np.float32),
        policy_versions=np.full(completion_tokens, _VERSION, dtype=np.int32),
        reward=1.0, generation_start=now - 10.0, generation_end=now,
    )


def _encoded_frame(prompt_tokens: int, completion_tokens: int) -> bytes:
    from heterorl.transport.protocol import encode

    (frame,) = encode(_trajectory("w0", prompt_tokens, completion_tokens))
    return bytes(frame)


def _state_dict(total_mib: int) -> dict:
    import torch

    return {f"layer{i:03d}.weight": torch.full((2**20,), float(i)) for i in range(total_mib // 4)}


def _cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _memory_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process image, from /proc/self/status (VmRSS, VmHWM)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line.split(":")[0]] = int(line.split()[1]) * 1024
    return values["VmRSS"], values["VmHWM"]


class _Inbox:
    """A report queue read by kind: items of other kinds wait for their own ``collect``."""

    def __init__(self, ctx) -> None:
        self.queue = ctx.Queue()
        self._held: list[tuple] = []

    def collect(self, kind: str, count: int) -> list[tuple]:
        got = [item for item in self._held if item[0] == kind][:count]
        for item in got:
            self._held.remove(item)
        while len(got) < count:
            item = self.queue.get(timeout=_TIMEOUT_S)
            (got if item[0] == kind else self._held).append(item)
        return got


# -- sender processes (trajectories) ----------------------------------------------------------------

def _ours_sender(address: str, worker_id: str, prompt_tokens: int, completion_tokens: int, config: Any,
                 commands: Any, reports: Any) -> None:
    """Per command ``n``: send ``n`` trajectories as fast as credit allows, report CPU used; None ends.

    The trajectories of the next round are made between rounds, as the raw sender's frame is made before
    it starts: both time moving data they already hold, not making it."""
    from heterorl.transport import WorkerClient

    base = _trajectory(worker_id, prompt_tokens, completion_tokens)
    made = 0

    def make(count: int) -> list:
        nonlocal made
        out = [dataclasses.replace(base, trajectory_id=f"{worker_id}-{made + i}", group_id=f"g-{(made + i) // _GROUP}",
                                   prompt_id=f"p-{(made + i) // _GROUP}") for i in range(count)]
        made += count
        return out

    with WorkerClient(address, worker_id, config) as client:
        client.wait_ready(_TIMEOUT_S)
        reports.put(("ready", worker_id))
        ready: list = []
        while (n := commands.get(timeout=_TIMEOUT_S)) is not None:
            ready += make(max(0, n - len(ready)))  # only the first round of a new size makes them here
            cpu = _cpu_s()
            for start in range(0, n, _GROUP):  # a group at a time, as a rollout worker sends what it scored
                client.send_many(ready[start:min(n, start + _GROUP)], _TIMEOUT_S)
            client.flush(_TIMEOUT_S)
            reports.put(("done", worker_id, _cpu_s() - cpu))
            ready = make(n)  # the next round is usually the same size


def _raw_sender(address: str, worker_id: str, frame: bytes, commands: Any, reports: Any) -> None:
    import zmq

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    reports.put(("ready", worker_id))
    while (n := commands.get(timeout=_TIMEOUT_S)) is not None:
        cpu = _cpu_s()
        for _ in range(n):
            push.send(frame, copy=False)
        reports.put(("done", worker_id, _cpu_s() - cpu))
    push.close(linger=10_000)
    ctx.term()


class _Senders:
    """Spawned sender processes, each driven by its own command queue."""

    def __init__(self, ctx, target, args_per_process: list[tuple]) -> None:
        self.reports = _Inbox(ctx)
        self.commands = [ctx.Queue() for _ in args_per_process]
        self.procs = [ctx.Process(target=target, args=(*args, q, self.reports.queue), daemon=True)
                      for args, q in zip(args_per_process, self.commands)]
        for p in self.procs:
            p.start()

    def run(self, n_each: int, receive: Any) -> tuple[float, float, float]:
        """(elapsed s, CPU s of this receiving process, CPU s of the senders) to move ``n_each`` per sender;
        ``receive(total)`` consumes here."""
        cpu, start = _cpu_s(), time.perf_counter()
        for q in self.commands:
            q.put(n_each)
        receive(n_each * len(self.commands))
        elapsed = time.perf_counter() - start
        own_cpu = _cpu_s() - cpu
        return elapsed, own_cpu, sum(r[2] for r in self.reports.collect("done", len(self.commands)))

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(_TIMEOUT_S)


def _whole_groups(n: int) -> int:
    """``n`` trajectories rounded down to whole groups of `_GROUP` (at least one group)."""
    return max(_GROUP, n // _GROUP * _GROUP)


def _bench_trajectories(ctx, workers: int, n_total: int, repeats: int, prompt_tokens: int,
                        completion_tokens: int, frame: bytes, config: Any) -> dict[str, tuple[float, float, float]]:
    """{"ours"/"raw": (best trajectories/s, CPU s per trajectory of the receiver and of the senders in that
    round)}. The learner checks every trajectory against a contract, as a live learner does."""
    import torch
    import zmq

    from heterorl.transport import LearnerServer
    from heterorl.transport.protocol import TrajectoryContract

    n_each = _whole_groups(n_total // workers)  # the learner passes on whole groups only
    contract = TrajectoryContract(vocab_size=_VOCAB, max_sequence_len=prompt_tokens + completion_tokens,
                                  group_size=_GROUP)
    server = LearnerServer(f"{_HOST}:0", config, contract=contract)
    server.publish(_VERSION, {"bias": torch.zeros(1)})  # the version the trajectories carry is out
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    raw_address = f"{_HOST}:{pull.bind_to_random_port(_HOST)}"
    groups = {
        "ours": _Senders(ctx, _ours_sender, [(server.control_endpoint, f"w{i}", prompt_tokens, completion_tokens,
                                              config) for i in range(workers)]),
        "raw": _Senders(ctx, _raw_sender, [(raw_address, f"r{i}", frame) for i in range(workers)]),
    }
    for group in groups.values():
        group.reports.collect("ready", workers)

    def receive_ours(total: int) -> None:
        received = 0
        while received < total:
            got = server.get(4096, _TIMEOUT_S)
            if not got:
                raise RuntimeError(f"the learner received nothing for {_TIMEOUT_S} s; stats {dict(server.stats)}")
            received += len(got)

    def receive_raw(total: int) -> None:
        for _ in range(total):
            pull.recv(copy=False)

    receivers = {"ours": receive_ours, "raw": receive_raw}
    for name, group in groups.items():  # warm-up
        group.run(_whole_groups(n_each // 10), receivers[name])
    best: dict[str, tuple[float, float, float]] = {"ours": (0.0, 0.0, 0.0), "raw": (0.0, 0.0, 0.0)}
    for _ in range(repeats):
        for name, group in groups.items():
            elapsed, receiver_cpu, sender_cpu = group.run(n_each, receivers[name])
            rate, count = n_each * workers / elapsed, n_each * workers
            if rate > best[name][0]:
                best[name] = (rate, receiver_cpu / count, sender_cpu / count)
    for group in groups.values():
        group.close()
    pull.close(0)
    zctx.term()
    server.close()
    if server.stats.get("rejected", 0) or server.stats.get("inbound/dropped", 0):
        raise RuntimeError(f"the learner rejected or dropped trajectories: {dict(server.stats)}")
    return best


# -- receiver processes (weights) -------------------------------------------------------------------

def _ours_weights_receiver(address: str, worker_id: str, rounds: int, reports: Any) -> None:
    from heterorl.config import TransportConfig
    from heterorl.transport import WorkerClient

    with WorkerClient(address, worker_id, TransportConfig(weights_deltas=False)) as client:
        client.wait_ready(_TIMEOUT_S)
        rss_ready = _memory_bytes()[0]
        reports.put(("ready", worker_id))
        held = -1
        for _ in range(rounds):
            got = client.wait_weights(held, _TIMEOUT_S)
            done = time.time()
            if got is None:
                raise TimeoutError(f"{worker_id}: no weights newer than {held} within {_TIMEOUT_S} s")
            held = got[0]
            client.set_version_held(held)
            reports.put(("got", worker_id, done))
            del got
        reports.put(("memory", worker_id, rss_ready, _memory_bytes()[1]))


def _raw_weights_receiver(address: str, worker_id: str, rounds: int, total_bytes: int, reports: Any) -> None:
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send(b"hello")
    rss_ready = _memory_bytes()[0]
    reports.put(("ready", worker_id))
    for _ in range(rounds):
        frames, received = [], 0
        while received < total_bytes:
            frames.append(dealer.recv(copy=False))
            received += len(frames[-1])
        reports.put(("got", worker_id, time.time()))
        del frames
    reports.put(("memory", worker_id, rss_ready, _memory_bytes()[1]))
    dealer.close(0)
    ctx.term()


def _bench_weights(ctx, total_mib: int, receivers: int, repeats: int) -> dict[str, Any]:
    """Best end-to-end times of ours and raw, and the receivers' memory (RSS when ready, peak)."""
    import zmq

    from heterorl.config import TransportConfig
    from heterorl.transport import LearnerServer

    state = _state_dict(total_mib)
    buffer = b"".join(t.numpy().tobytes() for t in state.values())
    chunk_bytes = TransportConfig().weights_chunk_bytes
    chunks = [memoryview(buffer)[i:i + chunk_bytes] for i in range(0, len(buffer), chunk_bytes)]
    rounds = repeats + 1  # the first is a warm-up

    # whole versions, as raw sends them (the same state each round would otherwise go as an empty delta;
    # deltas have their own benchmark, `heterorl bench weights`)
    server = LearnerServer(f"{_HOST}:0", TransportConfig(weights_deltas=False))
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)  # raw: the whole version is queued at once, no flow control
    raw_address = f"{_HOST}:{router.bind_to_random_port(_HOST)}"
    inboxes = {"ours": _Inbox(ctx), "raw": _Inbox(ctx)}
    procs = [ctx.Process(target=_ours_weights_receiver, daemon=True,
                         args=(server.control_endpoint, f"w{i}", rounds, inboxes["ours"].queue))
             for i in range(receivers)]
    procs += [ctx.Process(target=_raw_weights_receiver, daemon=True,
                          args=(raw_address, f"r{i}", rounds, len(buffer), inboxes["raw"].queue))
              for i in range(receivers)]
    for p in procs:
        p.start()
    for inbox in inboxes.values():
        inbox.collect("ready", receivers)
    peers = [router.recv_multipart()[0] for _ in range(receivers)]

    def send_ours(version: int) -> None:
        server.publish(version, state)

    def send_raw(version: int) -> None:
        for chunk in chunks:
            for peer in peers:
                router.send_multipart([peer, chunk], copy=False)

    senders = {"ours": send_ours, "raw": send_raw}
    best = {"ours": float("inf"), "raw": float("inf")}
    for version in range(rounds):
        for name, send in senders.items():
            start = time.time()
            send(version)
            elapsed = max(r[2] for r in inboxes[name].collect("got", receivers)) - start
            if version:  # version 0 is the warm-up
                best[name] = min(best[name], elapsed)
    memory = {name: inbox.collect("memory", receivers) for name, inbox in inboxes.items()}
    for p in procs:
        p.join(_TIMEOUT_S)
    router.close(0)
    zctx.term()
    server.close()
    return {"bytes": len(buffer), "chunks": len(chunks), "chunk_bytes": chunk_bytes, **best,
            "memory": {name: (max(r[2] for r in reports), max(r[3] for r in reports))
                       for name, reports in memory.items()}}


# -- report -----------------------------------------------------------------------------------------

def _verdict(ratio: float, target: float) -> str:
    return f"ratio {ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench transport", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=10_000,
                        help="trajectories per measurement, split evenly across the worker processes")
    parser.add_argument("--workers", default="1,4", help="comma-separated counts of worker processes")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=4864)
    parser.add_argument("--weights-mib", type=int, default=100, help="state dict size (a multiple of 4 MiB)")
    parser.add_argument("--weight-receivers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement (best of)")
    parser.add_argument("--credits", type=int, default=None,
                        help="credits_per_worker of the transport (default: TransportConfig's)")
    parser.add_argument("--batch", type=int, default=None,
                        help="trajectory_batch of the transport (default: TransportConfig's)")
    parser.add_argument("--skip", choices=["trajectories", "weights"], action="append", default=[])
    args = parser.parse_args(argv)
    if args.weights_mib < 4 or args.weights_mib % 4:
        parser.error(f"--weights-mib {args.weights_mib} must be a positive multiple of 4 (tensors of 4 MiB)")
    ctx = mp.get_context("spawn")
    from heterorl.config import TransportConfig
    from heterorl.errors import ConfigError

    config = TransportConfig(**{name: value for name, value in (("credits_per_worker", args.credits),
                                                                ("trajectory_batch", args.batch))
                                if value is not None})
    try:
        config.validate()
    except ConfigError as exc:
        parser.error(str(exc))

    if "trajectories" not in args.skip:
        frame = _encoded_frame(args.prompt_tokens, args.completion_tokens)
        mb = len(frame) / 1e6
        print(f"trajectories: {args.prompt_tokens} prompt + {args.completion_tokens} completion tokens = "
              f"{len(frame):,} bytes per encoded frame; {args.trajectories:,} per measurement, best of {args.repeats}; "
              f"{config.credits_per_worker} credits per worker, up to {config.trajectory_batch} per message")
        for workers in (int(w) for w in args.workers.split(",")):
            r = _bench_trajectories(ctx, workers, args.trajectories, args.repeats, args.prompt_tokens,
                                    args.completion_tokens, frame, config)
            (ours, ours_in, ours_out), (raw, raw_in, raw_out) = r["ours"], r["raw"]
            label = f"{workers} worker{'s' if workers > 1 else ''}"
            print(f"  trajectories, {label}: ours {ours:6.0f}/s {ours * mb:5.0f} MB/s | raw {raw:6.0f}/s "
                  f"{raw * mb:5.0f} MB/s | {_verdict(ours / raw, _TRAJECTORY_TARGET)}")
            print(f"    CPU per trajectory, all processes: ours {(ours_in + ours_out) * 1e6:4.0f} us "
                  f"(learner {ours_in * 1e6:.0f} + senders {ours_out * 1e6:.0f}) | raw "
                  f"{(raw_in + raw_out) * 1e6:4.0f} us "
                  f"(PULL {raw_in * 1e6:.0f} + senders {raw_out * 1e6:.0f})")
    if "weights" not in args.skip:
        w = _bench_weights(ctx, args.weights_mib, args.weight_receivers, args.repeats)
        delivered_gb = w["bytes"] * args.weight_receivers / 1e9
        print(f"weights: {w['bytes']:,} bytes ({args.weights_mib // 4} float32 tensors of 1M elements) to "
              f"{args.weight_receivers} worker processes in {w['chunks']} chunks of {w['chunk_bytes'] / 2**20:g} MiB; "
              f"best of {args.repeats}")
        print(f"  weights publish: ours {w['ours']:.3f} s {delivered_gb / w['ours']:5.2f} GB/s | raw {w['raw']:.3f} s "
              f"{delivered_gb / w['raw']:5.2f} GB/s | {_verdict(w['raw'] / w['ours'], _WEIGHTS_TARGET)}")
        for name in ("ours", "raw"):
            ready, peak = w["memory"][name]
            print(f"  receiver peak RSS, {name:4s}: {peak / 2**20:5.0f} MiB "
                  f"(+{(peak - ready) / 2**20:.0f} MiB over {ready / 2**20:.0f} MiB before the first transfer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
