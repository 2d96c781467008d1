"""What registered peers can take from training (docs/RELIABILITY.md, "Bounds per worker"), against a real
`heterorl learner` process fed by one honest `heterorl rollout` worker: a quiet window measures the learner's
steps per second, then each attack runs for a window of its own and the drill measures the steps per second
during it (as a share of the quiet rate), the seconds from the attack's end to the next step, and the
learner's resident memory above its level before the first attack.

    python scripts/peer_bounds_drill.py --window-s 10 --out runs/peer_bounds

The attacks, one per bound: groups opened and never completed (one member each of 32 groups, then gone);
silent peers, peers claiming 2^31 - 1 groups started and one sending groups without permits; a flood of
messages of 4,096 refusable trajectories; members held for their groups out of large messages; contract-valid
log-probabilities of -49.99 (importance weights ~5e20); invented reward outcome names and engine names;
connections asking for weights chunks that never read; and, against the budgets per peer (docs/RELIABILITY.md,
"Budgets per peer"), a non-reading peer's ~15.6 MB messages, messages of 4,096 duplicates, a new connection per
message, data frames 4 bytes short, and hellos repeated in a tight loop. Prints one table and writes
OUT/drill.json; exit status
0 when every attack left the honest worker at least --min-share of the quiet rate (and the learner made at least
--min-steps steps during it), training resumed within --resume-s, and memory stayed within --max-rss-mib.

The attacks run in this process's threads. --attacker-nice 19 runs them at the lowest priority: they stand for
peers on other hosts, and on a machine of two cores a tight sending loop at the learner's priority takes a core
the learner and the honest worker need (measured before the reads of dropped messages were paced: the repeated
hellos left 0.25 of the quiet rate at nice 0, 0.37 at nice 19; 8 s windows, 2 cores). --set passes learner
config overrides, to measure a bound at another setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from heterorl.config import load_config, packaged, to_yaml
from heterorl.transport import TransportTimeout, WorkerClient
from heterorl.transport.protocol import Heartbeat, Hello, TrajectoryBatch, WeightsRequest, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drill_support import wait  # noqa: E402
from hostile_fleet import OVERRIDES, PEER, _endpoint, cli, member  # noqa: E402 (the drill's sibling)

ATTACKS = ("open_groups", "silent_and_claiming", "flood", "held_members", "extreme_logprobs", "invented_names",
           "weights_readers", "large_messages", "duplicates", "connection_per_message", "short_frames",
           "repeated_hellos")


class Learner:
    """The learner process, its steps (from metrics.jsonl) and its resident memory."""

    def __init__(self, out: Path, steps: int, overrides: list[str] = ()) -> None:
        self.run_dir = out / "run"
        config = out / "learner.yaml"
        config.write_text(to_yaml(load_config(packaged("maze_rl.yaml"), [
            *OVERRIDES, "runtime.workers=1", f"rl.steps={steps}", "runtime.checkpoint_every=1000000",
            f"logging.run_dir={self.run_dir}", *overrides])))
        self.process = cli("learner", "--config", str(config), "--bind", "tcp://127.0.0.1:0", log=out / "learner.log")
        self.endpoint = wait(lambda: _endpoint(self.run_dir) or (self.process.poll() is not None and "dead"), 300,
                             "the learner's endpoint")
        if self.endpoint == "dead":
            raise RuntimeError(f"the learner exited early; see {out / 'learner.log'}")

    def steps(self) -> int:
        try:
            with (self.run_dir / "metrics.jsonl").open("rb") as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def registered(endpoint: str, name: str) -> tuple[WorkerClient, dict]:
    """A registered peer holding the learner's first version, and the settings its ``ready`` gave it."""
    client = WorkerClient(endpoint, name, PEER)
    settings = client.wait_ready(60).settings
    client.wait_weights(-1, 120)
    return client, settings


def raw_peer(ctx: zmq.Context, endpoint: str, name: str, engine: str = "torch") -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    sock.send_multipart(encode(Hello(name, "h", 1, 0, time.time(), engine=engine)))
    return sock


def send_ignoring_credit(client: WorkerClient, group: list) -> None:
    try:
        client.send_many(group, 0.5)
    except TransportTimeout:
        pass


# -- the attacks: each runs until ``stop`` is set ----------------------------------------------------------------
def open_groups(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    sock = raw_peer(ctx, endpoint, "opener")
    time.sleep(0.5)
    for g in range(32):
        sock.send_multipart(encode(member("opener", f"open-{g}", 0)))
    time.sleep(0.5)
    sock.close(0)  # gone, without a bye
    stop.wait()


def silent_and_claiming(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    silent = [WorkerClient(endpoint, f"silent-{i}", PEER) for i in range(5)]
    claims = [raw_peer(ctx, endpoint, f"claim-{i}") for i in range(4)]
    greedy = WorkerClient(endpoint, "greedy", PEER)
    n = 0
    try:
        while not stop.is_set():
            for i, sock in enumerate(claims):
                sock.send_multipart(encode(Heartbeat(f"claim-{i}", 0, time.time(), groups_started=2**31 - 1)))
            send_ignoring_credit(greedy, [member("greedy", f"greedy-{n}", j) for j in range(4)])
            n += 1
            stop.wait(0.05)
    finally:
        for client in [*silent, greedy]:
            client.close()
        for sock in claims:
            sock.close(0)


def flood(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    sock = raw_peer(ctx, endpoint, "flood")
    frames = encode(TrajectoryBatch([member("flood", f"f-{j}", 0, size=1) for j in range(4096)]))
    while not stop.is_set():
        sock.send_multipart(frames)
        stop.wait(0.02)
    sock.close(0)


def held_members(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """32 messages of ~2 MB whose one member is left in an open group (the rest refused beyond credit)."""
    sock = raw_peer(ctx, endpoint, "holder")
    time.sleep(0.5)
    for g in range(32):
        batch = [member("holder", f"held-{g}", 0)] + [
            member("holder", f"bulk-{g}-{j}", 0, prompt=np.full(100, 5), completion=np.full(100, 9), size=1)
            for j in range(1000)]
        sock.send_multipart(encode(TrajectoryBatch(batch)))
    stop.wait()
    sock.close(0)


def extreme_logprobs(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """Whole groups on permits, within the contract, with behaviour log-probabilities of -49.99."""
    client, _ = registered(endpoint, "extreme")
    n = 0
    while not stop.is_set():
        if client.acquire_starts(1, 0.2):
            version = (client.latest_weights() or (0,))[0]
            send_ignoring_credit(client, [member("extreme", f"x-{n}", j, logprob=-49.99, version=version)
                                          for j in range(4)])
            n += 1
    client.close()


def invented_names(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    client, _ = registered(endpoint, "namer")
    socks, n = [], 0
    while not stop.is_set():
        client.reward_outcomes = {f"outcome-{n}-{k}": 1 for k in range(64)}
        socks.append(raw_peer(ctx, endpoint, f"engine-peer-{n}", engine=f"engine-{n}"))
        if len(socks) > 50:
            socks.pop(0).close(0)
        n += 1
        stop.wait(0.05)
    client.close()
    for sock in socks:
        sock.close(0)


def weights_readers(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """16 connections asking, in a registered peer's name and with its session token, for every chunk of the
    newest version, never reading a reply."""
    client, settings = registered(endpoint, "reader")
    token, port = settings.get("weights_session", ""), settings["weights_port"]
    socks = []
    for _ in range(16):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1_000_000)
        sock.connect(f"{endpoint.rsplit(':', 1)[0]}:{port}")
        socks.append(sock)
    while not stop.is_set():
        version = (client.latest_weights() or (0,))[0]
        for sock in socks:
            for chunk in range(4):
                sock.send_multipart(encode(WeightsRequest("reader", -1, version, chunk, session=token)))
        stop.wait(0.25)
    for sock in socks:
        sock.close(0)
    client.close()


def large_messages(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """A registered peer that never reads, sending messages of ~15.6 MB as fast as it can: 1,500 trajectories,
    each with 2,048 environment-span entries (5-byte integers in msgpack), all past their completion (refused
    once the header is unpacked, its cost)."""
    sock = raw_peer(ctx, endpoint, "large")
    spans = tuple(range(70_000, 72_048))
    frames = encode(TrajectoryBatch([dataclasses.replace(member("large", f"l-{j}", 0, size=1), env_spans=spans)
                                     for j in range(1500)]))
    while not stop.is_set():
        sock.send_multipart(frames)
        stop.wait(0.01)
    sock.close(0)


def duplicates(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """A registered peer delivers one whole group on its permit, then sends messages of 4,096 copies of it:
    duplicates, each acknowledged again and never refused (no throttle counts them)."""
    client, _ = registered(endpoint, "dup")
    while not client.acquire_starts(1, 0.2) and not stop.is_set():
        pass
    version = (client.latest_weights() or (0,))[0]
    group = [member("dup", "dup-0", j, version=version) for j in range(4)]
    send_ignoring_credit(client, group)
    client.close()
    sock = raw_peer(ctx, endpoint, "dup")
    frames = encode(TrajectoryBatch([group[j % 4] for j in range(4096)]))
    while not stop.is_set():
        sock.send_multipart(frames)
        stop.wait(0.01)
    sock.close(0)


def connection_per_message(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """A new connection for every message: hello, then one message of 4,096 refusable trajectories, then gone
    (a throttle per connection never sees the same one twice)."""
    frames = encode(TrajectoryBatch([member("churn", f"c-{j}", 0, size=1) for j in range(4096)]))
    while not stop.is_set():
        sock = raw_peer(ctx, endpoint, "churn")
        sock.send_multipart(frames)
        sock.close(0)
        stop.wait(0.01)


def short_frames(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """A registered peer's batches of 512 trajectories whose data frame is 4 bytes short (refused at decode,
    after the header is unpacked)."""
    sock = raw_peer(ctx, endpoint, "short")
    header, data = encode(TrajectoryBatch([member("short", f"s-{j}", 0, size=1) for j in range(512)]))
    while not stop.is_set():
        sock.send_multipart([header, bytes(data)[:-4]])
        stop.wait(0.001)
    sock.close(0)


def repeated_hellos(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """One connection saying hello in a tight loop and never heartbeating: each is answered ready again (a hello
    repeated before the first heartbeat is not a refusal)."""
    sock = raw_peer(ctx, endpoint, "hellos")
    frames = encode(Hello("hellos", "h", 1, 0, time.time()))
    while not stop.is_set():
        for _ in range(100):
            sock.send_multipart(frames)
        stop.wait(0.001)
    sock.close(0)


def measure(learner: Learner, seconds: float, min_steps: int = 0, give_up_s: float = 0.0) -> tuple[float, int]:
    """Steps per second over ``seconds``, or longer, until ``min_steps`` steps were made (``give_up_s`` at most),
    and the steps made."""
    first, start = learner.steps(), time.monotonic()
    time.sleep(seconds)
    deadline = start + max(seconds, give_up_s)
    while learner.steps() - first < min_steps and time.monotonic() < deadline and learner.process.poll() is None:
        time.sleep(0.05)
    made = learner.steps() - first
    return made / (time.monotonic() - start), made


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    learner = Learner(out, args.steps, args.set)
    honest = cli("rollout", "--connect", learner.endpoint, "--worker-id", "honest", log=out / "honest.log")
    # --attacker-nice: on Linux a nice value is per thread and inherited, so the attack threads and ZeroMQ's I/O
    # thread, made below, take this one's (the learner and the honest worker, started above, keep theirs)
    os.nice(args.attacker_nice)
    ctx, report = zmq.Context(), {"attacks": {}, "attacker_nice": args.attacker_nice}
    try:
        wait(lambda: learner.steps() >= 5, 300, "five quiet steps")
        report["quiet_steps_per_s"] = quiet = measure(learner, args.window_s)[0]
        base_rss = report["rss_before_mib"] = learner.rss_mib()
        for name in args.attacks:
            stop = threading.Event()
            attack = threading.Thread(target=globals()[name], args=(learner.endpoint, ctx, stop), daemon=True)
            attack.start()
            rate, made = measure(learner, args.window_s, args.min_steps, args.give_up_s)
            rss = learner.rss_mib()
            stop.set()
            attack.join(30)
            ended, before = time.monotonic(), learner.steps()
            try:
                wait(lambda: learner.steps() > before or learner.process.poll() is not None, args.give_up_s,
                     "a step after the attack")
                resumed = round(time.monotonic() - ended, 2)
            except TimeoutError:
                resumed = float("inf")  # (reported as Infinity: no step within --give-up-s)
            report["attacks"][name] = {"steps_per_s": round(rate, 2), "share": round(rate / quiet, 2), "steps": made,
                                       "resume_s": resumed,
                                       "rss_above_before_mib": round(rss - base_rss, 1)}
            time.sleep(2)  # the learner settles before the next attack
        report["learner_alive"] = learner.process.poll() is None
    finally:
        for process in (learner.process, honest):
            if process.poll() is None:
                process.kill()
        ctx.term()
    return report


def broken(report: dict, args) -> list[str]:
    found = [] if report.get("learner_alive") else ["the learner died"]
    for name, seen in report["attacks"].items():
        if seen["share"] < args.min_share:
            found.append(f"{name}: {seen['share']:.2f} of the quiet steps/s < {args.min_share}")
        if seen["steps"] < args.min_steps:
            found.append(f"{name}: {seen['steps']} steps during the attack in {args.give_up_s:g} s < {args.min_steps}")
        if seen["resume_s"] > args.resume_s:
            found.append(f"{name}: resumed after {seen['resume_s']:.1f} s > {args.resume_s}")
        if seen["rss_above_before_mib"] > args.max_rss_mib:
            found.append(f"{name}: RSS +{seen['rss_above_before_mib']:.0f} MiB > {args.max_rss_mib}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds of the quiet window and each attack")
    parser.add_argument("--steps", type=int, default=1_000_000, help="learner steps (the drill stops it)")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--min-share", type=float, default=0.5, help="steps/s during an attack / quiet, at least")
    parser.add_argument("--min-steps", type=int, default=0, help=(
        "steps the learner must make during each attack: the attack lasts past its window until it has, "
        "--give-up-s at most (0: the window only)"))
    parser.add_argument("--resume-s", type=float, default=10.0, help="seconds to the first step after an attack")
    parser.add_argument("--max-rss-mib", type=float, default=300.0, help="learner RSS above its level before")
    parser.add_argument("--give-up-s", type=float, default=120.0, help="wait this long for a step after an attack")
    parser.add_argument("--attacker-nice", type=int, default=0, help=(
        "nice value of the attackers' threads (the drill's own process; the learner and the honest worker keep "
        "theirs); 19: they stand for other hosts, whose sending loops do not take the learner's cores"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="learner config overrides, after the drill's own (e.g. transport.throttle_s=2)")
    parser.add_argument("--out", default="runs/peer_bounds", help="output folder")
    args = parser.parse_args(argv)
    report = run(args)
    report["broken"] = broken(report, args)
    (Path(args.out) / "drill.json").write_text(json.dumps(report, indent=2))
    print(f"quiet: {report['quiet_steps_per_s']:.2f} steps/s")
    print(f"{'attack':22} {'steps/s':>8} {'share':>6} {'resume s':>9} {'RSS +MiB':>9}")
    for name, seen in report["attacks"].items():
        print(f"{name:22} {seen['steps_per_s']:8.2f} {seen['share']:6.2f} {seen['resume_s']:9.2f} "
              f"{seen['rss_above_before_mib']:9.1f}")
    print("every bound held" if not report["broken"] else "BROKEN: " + "; ".join(report["broken"]))
    return 0 if not report["broken"] else 1


if __name__ == "__main__":
    sys.exit(main())
