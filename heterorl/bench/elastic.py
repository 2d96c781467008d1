"""``heterorl bench elastic``: one learner, a fleet that changes under it. A scripted scenario on the maze task
(tiny model, async GEPO), each step its own phase:

1. start two workers (``a1``, ``a2``);
2. add two fast ones (``f1``, ``f2``) and two slow ones (``s1``, ``s2``: ``--slow`` times slower, 8 by default);
3. kill ``f1`` (its host dies: SIGKILL, no goodbye);
4. partition ``s1`` for ``--partition-s`` seconds, then heal it;
5. remove ``f2`` and ``s2`` (SIGTERM: each says goodbye and its permits go back at once);
6. add ``f2`` back (the same id: a rejoin);
7. a last phase as it is, then the learner is stopped (SIGTERM: a checkpoint and the run's summary).

Hosts: on loopback (no root) each worker is a `heterorl rollout --connect` process of its own session; a host
that dies is a SIGKILL to it, a partition a SIGSTOP until the heal's SIGCONT (a frozen host: it stops computing
too). With ``--lab`` (root) each worker has a host of its own on the network lab (`heterorl.netlab`): a host
that dies is every process on it killed, a partition its link cut both ways while it keeps computing. A slow
worker is ``--throttle``: after each generation it sleeps (F − 1) × the generation's time, so it frees the CPU
instead of spinning (on 2 cores, six spinning workers would measure only the cores).

It prints a timeline (per ``--window-s``, 10 s: live workers, samples/s trained, the learner's busy fraction, the
capacity line, each worker's staleness mean/max), the totals (rollouts generated = trained + discarded by reason
+ left over; trained twice; the learner's idle time while a worker was live; each join's seconds to its first
group trained; samples/s against the capacity line in steady phases) and issue 65's targets with their verdicts:
nothing lost or trained twice; the learner idle < 10 % while a worker is live and the learner is the
bottleneck; a joiner's first group trained ≤ 10 s after it starts; throughput ≥ 80 % of the capacity line in
steady phases. The capacity line is the sum over live workers of the rate each showed while generating in this
run (its contention included), not a solo calibration. Everything goes to ``OUT/elastic.json`` and the plot to
``OUT/elastic.png``; the numbers come from `heterorl.bench.elastic_timeline`.

``--steps-per-phase N`` drives the phases by the learner's progress instead of the clock (the test's short
version): a phase ends after N learner steps and once what it did shows (each joiner has a group trained, a
killed or partitioned worker is marked dead, a removed one has left, a healed one is back).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from heterorl.bench.elastic_timeline import Action, plot, totals, windows
from heterorl.config import load_config, packaged, to_yaml
from heterorl.netlab.fleet import await_learner_address, log_tail, log_times
from heterorl.runs import format_table, read_metrics
from heterorl.runtime.accounting import GROUP_LOG

BASE = ["loss.name=gepo", "runtime.mode=async", "rollout.group_size=4", "rl.prompts_per_step=4",
        "runtime.groups_per_call=2", "runtime.workers=2", "rl.steps=100000", "rl.eval_every=100000",
        "task.options.eval_size=8", "runtime.checkpoint_every=0", "runtime.fleet_wait_s=300",
        "logging.group_log=true", "logging.wandb_mode=disabled", "logging.progress=false",
        "logging.save_policy=false", "transport.heartbeat_interval_s=0.5", "transport.heartbeat_timeout_s=3",
        # four workers join at once in phase 2: each gets a probation permit before its first group is in
        "transport.probation_permits=4"]
# (verb, workers): the scenario, one phase each; a "partition" phase heals its workers after --partition-s
SCENARIO = (("start", ("a1", "a2")), ("start", ("f1", "f2", "s1", "s2")), ("kill", ("f1",)),
            ("partition", ("s1",)), ("remove", ("f2", "s2")), ("start", ("f2",)), ("hold", ()))
ACTIONS = "actions.jsonl"  # OUT/actions.jsonl: the scenario's actions as taken (`--report` reads them again)
# what the learner's log says of a worker joining, rejoining (a new connection), dying, coming back and leaving
LEARNER_SAYS = {"joined": " joined from", "rejoined": " rejoined from", "dead": "marked dead", "back": " is back",
                "left": " left:"}
LAB_HOSTS = {"a1": 1, "a2": 2, "f1": 3, "f2": 4, "s1": 5, "s2": 6}


def throttle_of(worker: str, fast: float, slow: float) -> float:
    """The throttle of a slow worker (``s1``, ``s2``) or of the others."""
    return slow if worker.startswith("s") else fast


class Loopback:
    """The scenario's hosts as processes on this machine, each in a session of its own (`supervise.Child`)."""

    name = "loopback"

    def __init__(self, folder: Path, config: Path) -> None:
        self.folder, self.config = folder, config
        self.procs: dict = {}

    def start_learner(self, run_dir: Path) -> str:
        from heterorl.runtime.supervise import Child

        self.procs["learner"] = Child("learner", ["learner", "--config", str(self.config), "--bind",
                                                  "tcp://127.0.0.1:0"], self.log("learner"))
        return await_learner_address(run_dir, self.procs["learner"].proc, self.log("learner"))

    def start_worker(self, worker: str, address: str, throttle: float) -> None:
        from heterorl.runtime.supervise import Child

        self.procs[worker] = Child(worker, ["rollout", "--connect", address, "--worker-id", worker, "--throttle",
                                            f"{throttle:g}"], self.log(worker))

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def signal(self, worker: str, sig: int) -> None:
        try:
            os.killpg(self.procs[worker].proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, worker: str) -> None:
        self.signal(worker, signal.SIGKILL)

    def partition(self, worker: str) -> None:
        self.signal(worker, signal.SIGSTOP)

    def heal(self, worker: str) -> None:
        self.signal(worker, signal.SIGCONT)

    def remove(self, worker: str) -> None:
        self.procs[worker].stop(timeout_s=30)

    def alive(self, name: str) -> bool:
        return self.procs[name].proc.poll() is None

    def stop_all(self) -> None:
        for name in self.procs:  # (a worker frozen when the scenario failed takes no SIGTERM until thawed)
            if name != "learner":
                self.heal(name)
        for name in ["learner", *(n for n in self.procs if n != "learner")]:
            self.procs[name].stop(timeout_s=120 if name == "learner" else 30)


class Lab(Loopback):
    """The scenario's hosts on the network lab: the learner's host and one per worker (`LAB_HOSTS`)."""

    name = "network lab"

    def __init__(self, folder: Path, config: Path) -> None:
        from heterorl.netlab import NetLab
        from heterorl.netlab.fleet import LabFleet

        super().__init__(folder, config)
        self.lab = NetLab(len(LAB_HOSTS))
        self.lab.start()
        self.fleet = LabFleet(self.lab, folder, config, curve=False)

    def start_learner(self, run_dir: Path) -> str:
        self.fleet.start_learner()
        self.procs["learner"] = self.fleet.learner
        return self.fleet.address

    def start_worker(self, worker: str, address: str, throttle: float) -> None:
        host = LAB_HOSTS[worker]
        self.procs[worker] = self.lab.run(f"worker-{host}", [sys.executable, "-m", "heterorl.cli", "rollout",
                                                              "--connect", address, "--worker-id", worker,
                                                              "--allow-plaintext", "--throttle", f"{throttle:g}"],
                                          log=self.log(worker))

    def kill(self, worker: str) -> None:
        self.lab.kill_host(f"worker-{LAB_HOSTS[worker]}")

    def partition(self, worker: str) -> None:
        self.lab.cut(f"worker-{LAB_HOSTS[worker]}")

    def heal(self, worker: str) -> None:
        self.lab.heal(f"worker-{LAB_HOSTS[worker]}")

    def remove(self, worker: str) -> None:
        _stop(self.procs[worker], 30)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop_all(self) -> None:
        try:
            _stop(self.procs["learner"], 120)
            for name, proc in self.procs.items():
                if name != "learner":
                    _stop(proc, 30)
        finally:
            self.lab.close()


def _stop(proc, timeout_s: float) -> None:
    from heterorl.runtime.supervise import stop_process

    if proc.poll() is None:
        stop_process(proc, timeout_s)


def read_records(run_dir: Path) -> list[dict]:
    """The learner's group log (`heterorl.runtime.accounting.group_records`), the lines written whole."""
    path = run_dir / GROUP_LOG
    return read_metrics(path) if path.is_file() else []


class Scenario:
    """Runs `SCENARIO` on a back-end (`Loopback` or `Lab`), writing each action down as it is taken."""

    def __init__(self, args, hosts: Loopback, run_dir: Path) -> None:
        self.args, self.hosts, self.run_dir = args, hosts, run_dir
        self.actions: list[Action] = []
        self.address = ""

    def act(self, verb: str, worker: str) -> None:
        throttle = throttle_of(worker, self.args.fast, self.args.slow)
        self.actions.append(Action(time.time(), verb, worker, throttle))
        with (self.run_dir.parent / ACTIONS).open("a") as f:
            f.write(json.dumps(vars(self.actions[-1])) + "\n")
        if verb == "start":
            self.hosts.start_worker(worker, self.address, throttle)
        else:
            getattr(self.hosts, verb)(worker)
        print(f"  {time.time() - self.actions[0].t:6.1f} s  {verb} {worker}"
              + (f" (throttle {throttle:g})" if verb == "start" else ""), flush=True)

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
        return max((r["step"] for r in records), default=0)

    def learner_said(self, pattern: str, since: float) -> bool:
        return any(t >= since - 1.0 for t in log_times(self.hosts.log("learner"), pattern))

    def shown(self, verb: str, workers: tuple, since: float) -> bool:
        """Whether what the phase did shows: joiners trained, the dead and partitioned marked dead, the removed
        gone, the healed back."""
        if verb == "start":
            records = read_records(self.run_dir)
            return all(any(r["worker"] == w and r["generation_start"] >= since for r in records) for w in workers)
        said = {"kill": "silent for", "partition": "silent for", "remove": "left", "heal": None}
        if verb == "heal":
            return all(self.learner_said(f"worker {w} is back", since) or
                       self.learner_said(f"worker {w} rejoined", since) for w in workers)
        return verb not in said or all(self.learner_said(f"worker {w} {said[verb]}", since) for w in workers)

    def wait(self, verb: str, workers: tuple, since: float, seconds: float) -> None:
        """Until the phase may end: ``seconds`` of the clock, or (``--steps-per-phase``) its learner steps and what
        it did showing; the learner's exit or the phase timeout end the bench with the learner's log."""
        args, first = self.args, self.steps()
        deadline = time.monotonic() + args.phase_timeout_s
        while True:
            if not self.hosts.alive("learner"):
                raise RuntimeError(f"the learner exited during '{verb}':\n{log_tail(self.hosts.log('learner'))}")
            if args.steps_per_phase is None:
                if time.time() >= since + seconds:
                    return
            elif self.steps() >= first + args.steps_per_phase and self.shown(verb, workers, since):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"phase '{verb} {' '.join(workers)}' did not end within {args.phase_timeout_s} s "
                                   f"(learner step {self.steps()}):\n{log_tail(self.hosts.log('learner'))}")
            time.sleep(0.25)

    def run(self) -> tuple[float, float]:
        """The scenario from the learner's start; its start and end (wall clock)."""
        args = self.args
        self.address = self.hosts.start_learner(self.run_dir)
        print(f"learner listening on {self.address} ({self.hosts.name}); the scenario:", flush=True)
        for verb, workers in SCENARIO:
            since = time.time()
            for worker in workers:
                self.act(verb, worker)
            if verb == "partition":
                self.wait(verb, workers, since, args.partition_s)
                healed = time.time()
                for worker in workers:
                    self.act("heal", worker)
                self.wait("heal", workers, healed, max(0.0, args.phase_s - args.partition_s))
            else:
                self.wait(verb, workers, since, args.phase_s)
        return self.actions[0].t, time.time()


def _config(args, run_dir: Path) -> str:
    overrides = [*BASE, f"logging.run_dir={run_dir}", *args.overrides]
    cfg = load_config(packaged("maze_rl.yaml"), overrides)
    if cfg.runtime.mode != "async":
        raise SystemExit("heterorl bench elastic: runtime.mode must be async (a sync run samples a fixed share per "
                         "worker and version; it is not elastic)")
    return to_yaml(cfg)


def weights_tallies(log: Path) -> list[str]:
    """What a worker's log says it received, one entry per life ("3 versions whole, 40 as deltas")."""
    found = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if "versions whole" in line:
            found.append(line[line.index("weights: ") + 9:].split(", 0 checksum")[0].rstrip(")"))
    return found


def report(args, out: Path, backend: str, end: float) -> dict:
    """The timeline, totals and targets of the run in ``out`` (its run dir, logs and actions): printed, and in
    ``OUT/elastic.json`` and ``OUT/elastic.png``."""
    run_dir, logs = out / "run", out / "logs"
    actions = [Action(**json.loads(line)) for line in (out / ACTIONS).read_text().splitlines()]
    records, start = read_records(run_dir), actions[0].t
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir / "metrics.jsonl")
    dropped = max((m.get("buffer/dropped_trained", 0) for m in metrics), default=0)
    waits = {m["step"]: m["learner/wait_s"] for m in metrics if m.get("learner/wait_s") is not None}
    rows = windows(records, actions, waits, start, end, args.window_s)
    found = totals(records, actions, rows, waits, summary["rollouts"], dropped)
    found["pace_ahead_max"] = max((m.get("pace/ahead_steps", 0) for m in metrics), default=0)
    found["transport"] = summary.get("transport", {})
    found["weights"] = {w: weights_tallies(logs / f"{w}.log") for w in sorted({a.worker for a in actions})}
    found["learner_events"] = {kind: len(log_times(logs / "learner.log", said)) for kind, said in LEARNER_SAYS.items()}
    workers = sorted({a.worker for a in actions})
    print(f"\ntimeline ({args.window_s:g} s windows; staleness in versions, mean/max per worker):")
    print(format_table(
        ["t (s)", "live", "samples/s", "capacity", "learner busy", "bottleneck", "steady", "staleness"],
        [[f"{r['t']:.0f}", f"{r['live']:.1f}", f"{r['samples_per_s']:.2f}", f"{r['capacity']:.2f}",
          f"{r['learner_busy']:.0%}", "learner" if r["learner_bound"] else "fleet", "yes" if r["steady"] else "",
          " ".join(f"{w} {s['mean']:.1f}/{s['max']}" for w, s in r["staleness"].items())] for r in rows]))
    print_totals(found, workers)
    out.mkdir(parents=True, exist_ok=True)
    result = {"backend": backend, "options": {k: v for k, v in vars(args).items() if k != "out"},
              "actions": [vars(a) for a in actions], "start": start, "end": end, "windows": rows, **found}
    (out / "elastic.json").write_text(json.dumps(result, indent=1))
    plot(rows, actions, start, out / "elastic.png", found["learner_rate"])
    print(f"\nwritten: {out / 'elastic.json'}, {out / 'elastic.png'}; the run: {run_dir}, its logs: {logs}")
    return result


def print_totals(found: dict, workers: list[str]) -> None:
    r = found["rollouts"]
    reasons = ", ".join(f"{n} {why}" for why, n in r["discarded"].items() if n) or "none"
    print(f"\nrollouts: {r['generated']} generated = {r['trained']} trained + {sum(r['discarded'].values())} "
          f"discarded ({reasons}) + {r['left_over']} left over; lost {found['lost']}; trained twice "
          f"{found['trained_twice']}; groups lost with a dead or stopped worker before they reached the learner: "
          f"{found['transport'].get('permits_reclaimed', 0)} permits reclaimed")
    print(f"learner: trains {found['learner_rate']:.2f} samples/s while busy; idle "
          f"{found['learner_idle_s_while_live']:.0f} s while a worker was live")
    print("workers (rate while generating, groups trained, staleness mean/max, weights received):")
    for w in workers:
        s = found["staleness"].get(w, {"groups": 0, "mean": 0.0, "max": 0})
        print(f"  {w}: {found['rates'].get(w, 0.0):.2f} samples/s, {s['groups']} groups, staleness "
              f"{s['mean']:.2f}/{s['max']}; {'; '.join(found['weights'][w]) or 'no tally (killed)'}")
    print("joins (seconds from start to its first group trained): " + ", ".join(
        f"{j['worker']} {'-' if j['first_trained_s'] is None else format(j['first_trained_s'], '.1f')}"
        for j in found["joins"]))
    print(f"learner's log: {found['learner_events']}")
    print("\ntargets:")
    for name, t in found["targets"].items():
        print(f"  {name}: {t['shown']} -> {t['verdict']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench elastic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds per phase (default 40)")
    parser.add_argument("--partition-s", type=float, default=30.0, help="how long s1 is cut off (default 30)")
    parser.add_argument("--fast", type=float, default=1.0, help="the other workers' throttle factor (default 1: as "
                        "fast as this machine runs them; raise it to make the fleet, not the learner, the bottleneck)")
    parser.add_argument("--slow", type=float, default=8.0, help="the slow workers' throttle factor (default 8)")
    parser.add_argument("--steps-per-phase", type=int, help="drive the phases by learner steps (and what each "
                        "did showing) instead of --phase-s")
    parser.add_argument("--phase-timeout-s", type=float, default=600.0, help="the longest a phase may wait")
    parser.add_argument("--window-s", type=float, default=10.0, help="the timeline's window (default 10 s)")
    parser.add_argument("--lab", action="store_true", help="hosts on the network lab (root) instead of loopback")
    parser.add_argument("--out", default="runs/bench-elastic", help="where the run, logs, json and plot go")
    parser.add_argument("--report", action="store_true", help="only print and write again the report of the run "
                        "already in --out")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) over the bench's")
    args = parser.parse_args(argv)
    if args.slow < 1 or args.fast < 1 or args.phase_s <= 0 or args.partition_s <= 0 or args.window_s <= 0:
        parser.error("--fast and --slow must be >= 1 and --phase-s, --partition-s, --window-s positive")
    out = Path(args.out).resolve()
    if args.report:
        saved = json.loads((out / "elastic.json").read_text()) if (out / "elastic.json").is_file() else {}
        report(args, out, saved.get("backend", "loopback"), float((out / "ended").read_text()))
        return 0
    if args.lab:
        from heterorl.netlab import missing

        lacking = missing()
        if lacking:
            print(f"heterorl bench elastic --lab: {lacking}; run it without --lab for loopback", file=sys.stderr)
            return 2
    logs, run_dir = out / "logs", out / "run"
    for stale in (run_dir, logs, out / ACTIONS):  # a run of its own each time: its records and logs are this run's only
        if stale.is_dir():
            shutil.rmtree(stale)
        stale.unlink(missing_ok=True)
    logs.mkdir(parents=True)
    config = out / "run.yaml"
    config.write_text(_config(args, run_dir))
    hosts = (Lab if args.lab else Loopback)(logs, config)
    phase = f"{args.steps_per_phase} learner steps" if args.steps_per_phase else f"{args.phase_s:g} s"
    print(f"heterorl bench elastic: {len(SCENARIO)} phases of {phase}, workers x{args.fast:g} and (slow) "
          f"x{args.slow:g} slower, partition {args.partition_s:g} s, on {hosts.name}", flush=True)
    scenario = Scenario(args, hosts, run_dir)
    try:
        start, end = scenario.run()
    finally:
        hosts.stop_all()
    (out / "ended").write_text(f"{end}\n")
    report(args, out, hosts.name, end)
    return 0
