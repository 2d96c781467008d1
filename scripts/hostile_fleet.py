"""A hostile drill against a real `heterorl learner` process (docs/RELIABILITY.md): while an honest
`heterorl rollout` worker feeds it, hostile peers on loopback send every kind of poison the contract refuses,
open groups they never complete, replay the honest worker's trained ids as their own, forge its sampler id,
flood the registry with hellos (from one connection and from many), and send garbage frames. A second honest
worker starts once the registry is full of the flood's entries: the learner waits for it (it trains only with
two workers), so the drill ends only if the newcomer got in. The learner must still be training when every
drill is done, then stop cleanly when sent SIGTERM (its step in progress finished, a checkpoint written, exit 0),
having trained only honest data (and the replaying peer's groups, which are its own).

    python scripts/hostile_fleet.py --rounds 20 --out runs/hostile

Prints one table of what each hostile peer sent and what the learner told it, with the learner's own counts
from its summary and its peak memory; writes the same as OUT/drill.json. Exit status 0 when every promise held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np
import zmq
from drill_support import wait

from heterorl.config import TransportConfig, load_config, packaged, to_yaml
from heterorl.transport import TransportTimeout, WorkerClient
from heterorl.transport.protocol import Bye, Hello, Ready, Trajectory, decode, encode

# the 5x5 maze from the shipped maze base (maze_rl.yaml; the poison below is sized for its tokenizer and context),
# GEPO, asynchronous, small and quick, without delays
OVERRIDES = ["loss.name=gepo", "runtime.mode=async", "task.options.eval_size=8", "rollout.group_size=4",
             "rl.prompts_per_step=4", "rl.eval_every=1000",
             "runtime.workers=2", "runtime.groups_per_call=2", "runtime.checkpoint_every=5", "runtime.fleet_wait_s=600",
             "delay.up.kind=none", "delay.down.kind=none", "transport.heartbeat_interval_s=0.5",
             "transport.heartbeat_timeout_s=5.0", "logging.wandb_mode=disabled", "logging.progress=false",
             "logging.save_policy=false"]
VOCAB, CONTEXT, GROUP = 12, 256, 4  # the shipped maze base: 12 token ids, 256 positions
# 5 s without a heartbeat is death: on a loaded machine a peer (or the late worker) went silent for 2 s, was taken
# for dead and rejoined, its permits reclaimed, until the replaying peer got none in its 60 s
PEER = TransportConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, hello_interval_s=0.1)


def member(worker: str, group: str, j: int, *, prompt=(5, 6, 7), completion=(9, 10), logprob=-0.5, version=0,
           size=GROUP) -> Trajectory:
    completion = np.asarray(completion, np.int32)
    return Trajectory(f"{group}-{j}", group, "maze-x", worker, size, np.asarray(prompt, np.int32), completion,
                      np.full(len(completion), logprob, np.float32), np.full(len(completion), version, np.int32),
                      float(j % 2), 1.0, 2.0)


def poisons(worker: str, n: int) -> dict[str, list[Trajectory]]:
    """Round ``n``'s poisoned groups, by the reason their first member is refused for."""
    def group(name, **poison):
        return [member(worker, f"{name}-{n}", j, **(poison if j == 0 else {})) for j in range(GROUP)]

    return {
        "version_ahead": group("ahead", version=10**6),
        "token_out_of_vocab": group("vocab", completion=(2, VOCAB)),
        "too_long": group("long", prompt=np.full(8192, 5), completion=np.full(8192, 9)),
        "logprob_below_floor": group("floor", logprob=-1e30),
        "group_too_large": [member(worker, f"size-{n}", j, size=64) for j in range(GROUP)],
    }


def send(client: WorkerClient, trajectories: list) -> None:
    while trajectories:
        try:
            client.send_many(trajectories, 2.0)
            return
        except TransportTimeout as exc:
            trajectories = trajectories[exc.done:]


def told(client: WorkerClient) -> Counter:
    return Counter(r.split(": ")[1] for r in client.rejections if r.count(": ") >= 2)


def peer(endpoint: str, name: str) -> WorkerClient:
    """A hostile peer, registered, holding the learner's first version (so version 0 is not ahead)."""
    client = WorkerClient(endpoint, name, PEER)
    client.rejections = deque(maxlen=1_000_000)  # keep every answer for the tally
    client.wait_ready(60)
    client.wait_weights(-1, 120)
    return client


def drill_poison(endpoint: str, rounds: int, report: dict) -> None:
    client = peer(endpoint, "hostile-poison")
    sent = 0
    for n in range(rounds):
        for group in poisons("hostile-poison", n).values():
            send(client, group)
            sent += len(group)
    wait(lambda: sum(told(client).values()) >= sent, 60, "every group told")
    report["poison"] = {"sent": sent, "told": dict(told(client)), "accepted": client.stats["acked"]}
    client.close()


def drill_open_groups(endpoint: str, rounds: int, report: dict) -> None:
    """One member of each of many groups, never completed, without asking for permits: the one its probation
    permit allows is held (until its deadline), the rest refused beyond its start limit (or, at a high rate of
    refusals, its connection throttled)."""
    client = peer(endpoint, "hostile-open")
    sent = rounds * 50
    for n in range(sent):
        send(client, [member("hostile-open", f"open-{n}", 0)])
    wait(lambda: client.stats["acked"] + sum(told(client).values()) >= sent
         or any(r.startswith("throttled: ") for r in client.rejections), 60, "the open groups answered")
    report["open_groups"] = {"sent": sent, "held": client.stats["acked"], "told": dict(told(client))}
    client.close()


def drill_replay(endpoint: str, run_dir: Path, report: dict) -> None:
    """The honest worker's trained ids (from the learner's checkpoint), sent again as this peer's own, and
    with its sampler id forged."""
    state = wait(lambda: _trained_ids(run_dir), 120, "a trained step")
    ids = [key.split("|", 1)[1] for key in state if key.startswith("honest|")][:16]
    client = peer(endpoint, "hostile-replay")
    groups = []
    for g in sorted({tid.rsplit("-", 1)[0] for tid in ids}):  # each on a permit, as a worker starts a group,
        if not client.acquire_starts(1, timeout_s=60):  # while the run gives permits
            break
        send(client, [member("hostile-replay", g, j) for j in range(GROUP)])
        groups.append(g)
    if not groups:
        raise RuntimeError("the replaying peer got no admission permit before the run ended")
    send(client, [member("honest", groups[0], j) for j in range(GROUP)])  # forged: names the honest sampler
    wait(lambda: client.stats["acked"] + sum(told(client).values()) >= GROUP * (len(groups) + 1), 60,
         "the replayed groups answered")
    report["replay"] = {"groups": len(groups), "accepted": client.stats["acked"], "told": dict(told(client))}
    client.close()


def _trained_ids(run_dir: Path) -> list | None:
    try:
        ids = json.loads((run_dir / "checkpoints" / "learner_state.json").read_text())["trained_ids"]
    except (OSError, ValueError, KeyError):
        return None
    return ids or None


def drill_registry(endpoint: str, hellos: int, connections: int, report: dict) -> None:
    """Hellos with new ids from one connection, then one hello from each of many connections."""
    ctx = zmq.Context()
    socks = []
    try:
        one = ctx.socket(zmq.DEALER)
        one.setsockopt(zmq.LINGER, 10_000)  # every hello and frame goes out before close
        one.connect(endpoint)
        socks.append(one)
        for i in range(hellos):
            one.send_multipart(encode(Hello(f"flood-{i}", "h", 1, -1, time.time())))
        # every one of them answered before the crowd connects: the crowd filling the registry first would make
        # these hellos refusals (busy) rather than replacements, which arrival order alone would decide
        one_answers = Counter()
        deadline = time.monotonic() + 60
        while sum(one_answers.values()) < hellos and one.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            message = decode(one.recv_multipart(copy=False))
            if isinstance(message, (Ready, Bye)):
                one_answers["ready" if isinstance(message, Ready) else "bye"] += 1
        answers = Counter()
        for i in range(connections):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 10_000)
            sock.connect(endpoint)
            sock.send_multipart(encode(Hello(f"crowd-{i}", "h", 1, -1, time.time())))
            socks.append(sock)
        deadline = time.monotonic() + 10
        for sock in socks[1:]:
            if sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
                answers["bye (busy)" if b"busy" in sock.recv_multipart()[0] else "ready"] += 1
        report["registry"] = {"hellos_one_connection": hellos, "one_connection_answers": dict(one_answers),
                              "connections": connections, "answers": dict(answers)}
        # garbage frames of every size on a registered connection and an unregistered one
        rng = random.Random(0)
        for k in range(1000):
            (socks[-1] if k % 2 else socks[0]).send_multipart([rng.randbytes(rng.randint(0, 300))])
        report["garbage_frames"] = 1000
        time.sleep(5)  # connections open until the learner has read it all (a peer that leaves takes the unread)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()  # waits (up to the linger) until what was sent is out


def peak_rss_mib(pid: int, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out["peak_rss_mib"] = int(line.split()[1]) / 1024
        except OSError:
            return
        stop.wait(0.2)


def cli(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "heterorl.cli", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": "disabled"})


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    config = out / "learner.yaml"
    config.write_text(to_yaml(load_config(packaged("maze_rl.yaml"), OVERRIDES + [
        f"rl.steps={args.steps}", f"logging.run_dir={run_dir}", f"transport.max_workers={args.max_workers}",
        f"transport.group_timeout_s={args.group_timeout_s}"])))
    learner = cli("learner", "--config", str(config), "--bind", "tcp://127.0.0.1:0", log=out / "learner.log")
    workers, report, memory, stop = [], {}, {}, threading.Event()
    threading.Thread(target=peak_rss_mib, args=(learner.pid, stop, memory), daemon=True).start()
    try:
        endpoint = wait(lambda: _endpoint(run_dir) or (learner.poll() is not None and "dead"), 300,
                        "the learner's endpoint")
        if endpoint == "dead":
            raise RuntimeError(f"the learner exited early; see {out / 'learner.log'}")
        workers.append(cli("rollout", "--connect", endpoint, "--worker-id", "honest", log=out / "honest.log"))
        drills = [threading.Thread(target=_recorded, args=(drill, report, *drill_args)) for drill, drill_args in (
            (drill_poison, (endpoint, args.rounds, report)), (drill_open_groups, (endpoint, args.rounds, report)),
            (drill_replay, (endpoint, run_dir, report)))]
        for drill in drills:
            drill.start()
        drill_registry(endpoint, args.hellos, args.connections, report)
        # the registry is full of the flood's entries (live for heartbeat_timeout_s, then dead): the second
        # honest worker must get in, or the learner never starts training
        workers.append(cli("rollout", "--connect", endpoint, "--worker-id", "late", log=out / "late.log"))
        for drill in drills:
            drill.join()
        alive = learner.poll() is None
        if alive:
            learner.send_signal(signal.SIGTERM)
        code = learner.wait(args.timeout_s)
    finally:
        stop.set()
        for process in [learner, *workers]:
            if process.poll() is None:
                process.kill()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1] if records else {}
    trained = _trained_ids(run_dir) or []
    report["learner"] = {
        "exit_code": code, "steps": summary.get("steps"), "alive_after_drills": alive,
        "stopped_by": summary.get("stopped_by"), **memory,
        "transport": summary.get("transport", {}),
        "trained_trajectories": len(trained),
        "trained_from": dict(Counter(key.split("|", 1)[0] for key in trained)),
        "duplicates": last.get("transport/duplicates"), "dropped_trained": last.get("buffer/dropped_trained"),
        "late_worker_joined": "joined learner" in (out / "late.log").read_text(),
    }
    return report


def _recorded(drill, report: dict, *args) -> None:
    """Run ``drill``; an error it raises goes into the report (a drill that did not finish is a broken promise)."""
    try:
        drill(*args)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other drills and the learner go on
        report.setdefault("drill_errors", []).append(f"{drill.__name__}: {exc!r}")


def _endpoint(run_dir: Path) -> str | None:
    path = run_dir / "endpoints.json"
    try:
        return json.loads(path.read_text())["control"]
    except (OSError, ValueError, KeyError):
        return None


def held(report: dict) -> list[str]:
    """The promises that did not hold (empty: all held)."""
    learner, broken = report["learner"], list(report.get("drill_errors", []))
    broken += [f"the {name} drill did not finish" for name in ("poison", "open_groups", "replay", "registry")
               if name not in report]
    if learner["exit_code"] != 0:
        broken.append(f"the learner exited with {learner['exit_code']}")
    if not learner["alive_after_drills"]:
        broken.append("the learner was not training when the drills were done (raise --steps)")
    elif learner["stopped_by"] != "SIGTERM":
        broken.append(f"the learner did not stop cleanly on SIGTERM (its summary says {learner['stopped_by']!r})")
    if set(learner["trained_from"]) - {"honest", "late", "hostile-replay"}:
        broken.append(f"trained data from {learner['trained_from']}")
    if learner["duplicates"] or learner["dropped_trained"]:
        broken.append("honest data was taken for duplicates or already trained")
    if not learner["late_worker_joined"]:
        broken.append("the late worker could not join after the flood")
    if report.get("poison", {}).get("accepted"):
        broken.append(f"{report['poison']['accepted']} poisoned trajectories were accepted")
    if "replay" in report and report["replay"]["accepted"] != GROUP * report["replay"]["groups"]:
        broken.append("the replayed ids were not taken as the replaying peer's own")
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of every poison; x50 groups left open")
    parser.add_argument("--steps", type=int, default=100_000,
                        help="learner steps: more than it trains while the drills run (it is stopped after them)")
    parser.add_argument("--hellos", type=int, default=1100, help="hellos with new ids from one connection")
    parser.add_argument("--connections", type=int, default=100, help="connections saying hello once each")
    parser.add_argument("--max-workers", type=int, default=64, help="the learner's transport.max_workers")
    parser.add_argument("--group-timeout-s", type=float, default=15.0, help="transport.group_timeout_s")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on the learner after this long")
    parser.add_argument("--out", default="runs/hostile", help="output folder")
    args = parser.parse_args(argv)
    report = run(args)
    broken = held(report)
    report["broken"] = broken
    (Path(args.out) / "drill.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print("every promise held" if not broken else "BROKEN: " + "; ".join(broken))
    return 0 if not broken else 1


if __name__ == "__main__":
    sys.exit(main())
