"""Fault drills on the network lab (docs/NETLAB.md): a CURVE learner and two workers on separate hosts over WAN
links (latency, jitter, loss, bandwidth), and, one after another while the run goes on, a partition of one
worker, a partition of every worker, each healed after --partition-s; then 5 % loss and 20 ms jitter (packets
reordered) on the weights links, and every link dropped to 10 Mbit/s, each for --phase-s. The learner is then
stopped (SIGTERM: the run's accounting is checked) and started again with --resume, and its host reboots behind
lossy links (--reboot-loss): every process on it killed, down for --reboot-down-s, the learner resumed on the
same address. For each partition it
measures, from the processes' own logs, how long the learner and the worker took to notice (against their
heartbeat bounds), how long the worker took to rejoin after the heal, and the learner's steps during the cut;
for the others the steps, staleness and waits before and during. At the end: no trajectory trained twice, every
rollout accounted for (generated = trained + discarded by reason + left over); each worker's tally of versions
taken (whole, as deltas), resyncs and checksum failures is printed.

    sudo python scripts/netlab_drills.py --partition-s 30 --out runs/netlab

Prints one table and writes OUT/drills.json; exit status 0 when every promise held. Needs root (`missing`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from drill_support import wait

from heterorl.config import load_config, packaged, to_yaml
from heterorl.netlab import LinkShape, NetLab, missing
from heterorl.netlab.fleet import LabFleet

HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S = 0.5, 3.0
OVERRIDES = ["loss.name=gepo", "runtime.mode=async", "task.options.eval_size=8", "rollout.group_size=4",
             "rl.prompts_per_step=4", "rl.eval_every=100000", "rl.steps=100000", "runtime.workers=2",
             "runtime.groups_per_call=2", "runtime.checkpoint_every=5", "runtime.fleet_wait_s=300",
             "delay.up.kind=none", "delay.down.kind=none", f"transport.heartbeat_interval_s={HEARTBEAT_INTERVAL_S}",
             f"transport.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "logging.wandb_mode=disabled",
             "logging.progress=false", "logging.save_policy=false"]


def partition(fleet: LabFleet, cut: list[int], seconds: float) -> dict:
    """Cut the links of workers ``cut`` for ``seconds``, heal them, and measure (see the module)."""
    lab = fleet.lab
    step_before, cut_at = fleet.learner_step(), time.time()
    for k in cut:
        lab.cut(f"worker-{k}")
    time.sleep(seconds)
    steps_during = fleet.learner_step() - step_before
    healed_at = time.time()
    for k in cut:
        lab.heal(f"worker-{k}")
    seen = {}
    for k in cut:
        name = f"w{k}"

        def rejoined(name=name):
            times = [fleet.first_after("learner", f"worker {name} {event}", healed_at)
                     for event in ("rejoined from", "is back", "joined from")]
            times = [t for t in times if t is not None]
            return min(times) if times else None

        seen[name] = {
            "learner_noticed_s": fleet.first_after("learner", f"worker {name} silent for", cut_at),
            "worker_noticed_s": fleet.first_after(name, "learner silent for", cut_at),
            "rejoined_after_heal_s": wait(rejoined, 120, f"{name} to rejoin"),
        }
    step_at_heal = fleet.learner_step()
    wait(lambda: fleet.learner_step() > step_at_heal + 1, 120, "steps after the heal")
    return {"cut": [f"w{k}" for k in cut], "seconds": seconds, "steps_during_cut": steps_during,
            "steps_after_heal_s": time.time() - healed_at, "workers": seen}


def metrics_between(fleet: LabFleet, first: int, last: int) -> dict:
    """Steps/s and mean staleness (versions, seconds) over the learner's steps ``first`` … ``last``."""
    path = fleet.run_dir() / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if first <= r.get("step", -1) <= last and "staleness/versions_mean" in r]

    def mean(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return round(sum(values) / len(values), 2) if values else None

    return {"steps": len(steps), "staleness_versions": mean("staleness/versions_mean"),
            "staleness_s": mean("staleness/seconds_mean"), "learner_wait_s": mean("learner/wait_s")}


def shaped(fleet: LabFleet, shape: LinkShape, direction: str, seconds: float, normal: LinkShape) -> dict:
    """Every link set to ``shape`` in ``direction`` for ``seconds``, then back to ``normal``: the learner's steps,
    staleness and waits in the same time before and during."""
    lab = fleet.lab
    start = fleet.learner_step()
    time.sleep(seconds)
    middle = fleet.learner_step()
    for k in range(1, lab.workers + 1):
        lab.shape(f"worker-{k}", shape, direction)
    time.sleep(seconds)
    end = fleet.learner_step()
    for k in range(1, lab.workers + 1):
        lab.shape(f"worker-{k}", normal, direction)
    return {"shape": vars(shape), "direction": direction, "seconds": seconds,
            "before": metrics_between(fleet, start + 1, middle), "during": metrics_between(fleet, middle + 1, end)}


def reboot(fleet: LabFleet, shape: LinkShape, down_s: float) -> dict:
    """The learner's host reboots while the workers sit behind ``shape`` links: every process on it killed at
    once (SIGKILL), the host down for ``down_s``, then the learner started again with ``--resume`` on the same
    address. Measures when it listened again, when each worker joined it, and its steps after."""
    lab = fleet.lab
    for k in range(1, lab.workers + 1):
        lab.shape(f"worker-{k}", shape)
    step_before = fleet.learner_step()
    killed_at = time.time()
    lab.kill_host("learner")
    fleet.learner.wait(30)
    time.sleep(down_s)
    started_at = time.time()
    fleet.start_learner("--resume")
    listening_s = time.time() - started_at
    joined = {}
    for k in range(1, lab.workers + 1):
        name = f"w{k}"
        joined[name] = wait(lambda name=name: fleet.first_after("learner", f"worker {name} joined from", started_at),
                            120, f"{name} to join the resumed learner")
    resumed_at = fleet.learner_step()
    wait(lambda: fleet.learner_step() >= resumed_at + 3, 120, "steps after the resume")
    return {"links": vars(shape), "down_s": down_s, "step_at_kill": step_before, "resumed_from_step": resumed_at,
            "listening_after_start_s": listening_s, "joined_after_start_s": joined,
            "worker_noticed_s": {f"w{k}": fleet.first_after(f"w{k}", "learner silent for", killed_at)
                                 for k in range(1, lab.workers + 1)},
            "steps_after_s": time.time() - started_at}


def stop(fleet: LabFleet) -> tuple[int, dict]:
    """SIGTERM to the learner: its exit code and its summary."""
    fleet.learner.send_signal(signal.SIGTERM)
    code = fleet.learner.wait(120)
    return code, json.loads((fleet.run_dir() / "summary.json").read_text())


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "run.yaml"
    overrides = [*OVERRIDES, f"logging.run_dir={out / 'run'}"]
    if args.max_weights_lag is not None:
        overrides.append(f"runtime.max_weights_lag={args.max_weights_lag}")
    config.write_text(to_yaml(load_config(packaged("maze_rl.yaml"), overrides)))
    shape = LinkShape(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss=args.loss, rate_mbit=args.rate_mbit)
    report: dict = {"links": vars(shape), "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}
    with NetLab(2, shape) as lab:
        report["backend"] = lab.backend
        fleet = LabFleet(lab, out, config)
        fleet.start_learner()
        for k in (1, 2):
            fleet.start_worker(k)
        wait(lambda: fleet.learner_step() >= 3, 300, "three steps")
        report["partition_one"] = partition(fleet, [1], args.partition_s)
        report["partition_all"] = partition(fleet, [1, 2], args.partition_s)
        report["lossy_weights"] = shaped(fleet, replace(shape, loss=0.05, jitter_ms=max(shape.jitter_ms, 20.0)),
                                         "down", args.phase_s, shape)
        report["bandwidth_drop"] = shaped(fleet, replace(shape, rate_mbit=10.0), "both", args.phase_s, shape)
        report["learner_exit"], summary = stop(fleet)
        records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
        # the learner comes back (--resume), and then its host reboots, behind lossy links
        lossy = replace(shape, loss=args.reboot_loss)
        started_at = time.time()
        fleet.start_learner("--resume")
        wait(lambda: all(fleet.first_after("learner", f"worker w{k} joined from", started_at) is not None
                         for k in (1, 2)), 120, "the workers to join the learner started again")
        report["learner_reboot"] = reboot(fleet, lossy, args.reboot_down_s)
        report["rebooted_exit"], rebooted = stop(fleet)
        trained = json.loads((out / "run" / "checkpoints" / "learner_state.json").read_text())["trained_ids"]
        report["learner_reboot"].update(steps=rebooted["steps"], stopped_by=rebooted.get("stopped_by"),
                                        trained_ids=len(trained), trained_twice=len(trained) - len(set(trained)))
        for k, worker in fleet.workers.items():
            worker.send_signal(signal.SIGTERM)
            report[f"w{k}_exit"] = worker.wait(60)
            tally = [line for line in fleet.log(f"w{k}").read_text().splitlines() if "stopped by a signal" in line]
            report[f"w{k}_tally"] = tally[-1].split(" after ", 1)[-1] if tally else None
        report["wire"] = lab.wire_stats()
    rollouts = summary["rollouts"]
    report["run"] = {"steps": summary["steps"], "stopped_by": summary.get("stopped_by"),
                     "duplicates": records[-1].get("transport/duplicates"),
                     "trained_twice_refused": records[-1].get("buffer/dropped_trained"), "rollouts": rollouts,
                     "unaccounted": rollouts["generated"] - rollouts["trained"] - sum(rollouts["discarded"].values())
                     - rollouts["left_over"]}
    return report


def broken(report: dict) -> list[str]:
    found = []
    bound = HEARTBEAT_TIMEOUT_S + 2 * HEARTBEAT_INTERVAL_S + 1.0  # the timeout, a beat each way, the log's grain
    for drill in ("partition_one", "partition_all"):
        seen = report[drill]
        if drill == "partition_one" and seen["steps_during_cut"] <= 0:
            found.append("the learner made no step while one worker was cut (it blocked on the cut link)")
        for name, times in seen["workers"].items():
            for side in ("learner_noticed_s", "worker_noticed_s"):
                if times[side] is None or times[side] > bound:
                    found.append(f"{drill}: {side.split('_')[0]} noticed {name}'s cut after {times[side]} s "
                                 f"(bound {bound:.1f} s)")
    for drill in ("lossy_weights", "bandwidth_drop"):
        if report[drill]["during"]["steps"] <= 0:
            found.append(f"{drill}: the learner made no step ({report[drill]})")
    rebooted = report["learner_reboot"]
    if report["rebooted_exit"] != 0 or rebooted["stopped_by"] != "SIGTERM":
        found.append(f"the rebooted learner did not stop cleanly (exit {report['rebooted_exit']}, "
                     f"{rebooted['stopped_by']})")
    if rebooted["trained_twice"]:
        found.append(f"{rebooted['trained_twice']} trajectories trained twice across the learner's lives")
    run = report["run"]
    if report["learner_exit"] != 0 or run["stopped_by"] != "SIGTERM":
        found.append(f"the learner did not stop cleanly (exit {report['learner_exit']}, {run['stopped_by']})")
    # (below 0: the learner took trajectories the workers' last heartbeats had not counted yet when it stopped)
    if run["duplicates"] or run["unaccounted"] > 0:
        found.append(f"rollouts: {run['duplicates']} duplicates, {run['unaccounted']} unaccounted")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partition-s", type=float, default=30.0, help="seconds each partition lasts")
    parser.add_argument("--phase-s", type=float, default=30.0,
                        help="seconds before and during the lossy weights links and the bandwidth drop")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way latency of every link")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="± jitter (uniform)")
    parser.add_argument("--loss", type=float, default=0.005, help="packet loss probability")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="bandwidth of every link, each way")
    parser.add_argument("--reboot-loss", type=float, default=0.02,
                        help="packet loss of every link, each way, while the learner's host reboots")
    parser.add_argument("--reboot-down-s", type=float, default=5.0, help="seconds the learner's host stays down")
    parser.add_argument("--max-weights-lag", type=int, default=None,
                        help="runtime.max_weights_lag: no permits for a worker this many versions behind")
    parser.add_argument("--out", default="runs/netlab", help="output folder")
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"cannot run the drills: {why}", file=sys.stderr)
        return 2
    report = run(args)
    report["broken"] = broken(report)
    (Path(args.out) / "drills.json").write_text(json.dumps(report, indent=2))
    print(f"links: {args.delay_ms:g} ms ± {args.jitter_ms:g} ms, {args.loss:.1%} loss, {args.rate_mbit:g} Mbit/s "
          f"({report['backend']}); heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s; partitions of {args.partition_s:g} s")
    print(f"{'drill':15} {'worker':6} {'learner noticed s':>18} {'worker noticed s':>17} {'rejoined s':>11} "
          f"{'steps during':>13}")
    for drill in ("partition_one", "partition_all"):
        seen = report[drill]
        for name, times in seen["workers"].items():
            print(f"{drill:15} {name:6} {times['learner_noticed_s'] or float('nan'):18.2f} "
                  f"{times['worker_noticed_s'] or float('nan'):17.2f} {times['rejoined_after_heal_s']:11.2f} "
                  f"{seen['steps_during_cut']:13d}")
    for drill in ("lossy_weights", "bandwidth_drop"):
        seen = report[drill]
        print(f"{drill}: {seen['direction']} links {seen['shape']}; before {seen['before']}; during {seen['during']}")
    rebooted = report["learner_reboot"]
    print(f"learner reboot ({rebooted['links']['loss']:.0%} loss, down {rebooted['down_s']:g} s): listening "
          f"{rebooted['listening_after_start_s']:.2f} s after its start, workers joined after "
          f"{ {k: round(v, 2) for k, v in rebooted['joined_after_start_s'].items()} } s; resumed from step "
          f"{rebooted['resumed_from_step']} (killed at {rebooted['step_at_kill']}), {rebooted['steps']} steps in all, "
          f"{rebooted['trained_twice']} of {rebooted['trained_ids']} trained ids twice")
    for k in (1, 2):
        print(f"w{k}: {report[f'w{k}_tally']}")
    run_ = report["run"]
    print(f"run: {run_['steps']} steps; duplicates {run_['duplicates']}, re-sent after training and refused "
          f"{run_['trained_twice_refused']}, unaccounted rollouts {run_['unaccounted']} (below 0: sent after the "
          "workers' last heartbeats)")
    print("every promise held" if not report["broken"] else "BROKEN: " + "; ".join(report["broken"]))
    return 0 if not report["broken"] else 1


if __name__ == "__main__":
    sys.exit(main())
