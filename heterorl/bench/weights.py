"""``heterorl bench weights``: weights published as deltas against whole versions, over the updates of a real
RL run: the bytes per version, and the time from ``publish`` until a worker sampled with them could start.

Workloads: the tiny model (the shipped ``add3-sft-base``, 3-digit addition, 32 prompts x 8, GRPO, lr 1e-4) and
SmolLM2-135M-Instruct (2-digit addition through its chat template, 4 prompts x 4, 16 new tokens, GEPO, at each
of ``--lrs``). Each runs ``--steps`` real steps (`rollout_datums` + `optimize_batch`, Adam at a constant learning
rate, no warm-up); version v is the float32 master after step v, and it travels in bfloat16 (the inference
dtype, for both models here; ``runtime.weights_dtype=auto`` would send the tiny one in float32).

1. Per version: its bytes whole in float32 and in bfloat16, the bytes of the step from version v - 1
   (`encode_step`) and the ratio, the fraction of elements whose bf16 bits changed, the encodings chosen (tensors
   per method), and the seconds to encode the step and to apply it (`apply_steps`, checksums included). The
   applied bytes must equal the bf16 cast of the master, or the bench stops with an error.
2. Publish -> applied: a real `LearnerServer` and ``--workers`` `WorkerClient` threads on loopback, each worker
   behind its own weights link of ``--bandwidths`` bits/s (`DelayLink`: the learner holds the version's notice
   back until the link has carried what the worker will fetch), with ``transport.weights_deltas`` on and off.
   Version 0 reaches every worker first, untimed and not charged to the links; then each version is published
   once every worker applied the one before (nothing queues), timed from just before `publish` until the
   slowest worker's ``wait_weights`` returned and it loaded the state into its bfloat16 model. A whole SmolLM2
   version (269 MB in bf16, its tied embedding once) takes 22 s over 100 Mbit/s, so the runs with deltas off
   replay only the first ``--full-versions``.

SmolLM2 as shipped answers sums in prose and almost never gets them right, so its reward (`number_reward`) also pays
for a number: its groups then carry a learning signal. A batch that still carries none is drawn again (up to
8 times), so every version is one optimizer step. The captured versions wait on disk for the replays: memory
holds one float32 state at a time.

Goals: SmolLM2 at lr 1e-6 sends >= 20x fewer bytes than whole bf16 versions, and a version is applied over
100 Mbit/s in < 2 s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import queue
import random
import re
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from heterorl.bench.weight_workers import applied_times, load_versions
from heterorl.config import Config, TransportConfig, load_config, packaged
from heterorl.errors import HeteroRLError

BF16 = torch.bfloat16
MODELS = ("tiny", "smollm2")
TINY_LR = 1e-4
GOAL_RATIO = 20.0  # SmolLM2 at lr 1e-6: whole bf16 bytes / delta bytes
GOAL_LR = 1e-6
GOAL_SECONDS = 2.0  # publish -> applied over 100 Mbit/s
GOAL_BITS_PER_S = 100e6
MAX_DRAWS = 8  # batches drawn for one step before a workload is declared to carry no learning signal
TIMEOUT_S = 120.0  # a worker's wait for a version, beyond the time its link needs to carry it whole
_HOST = "tcp://127.0.0.1:0"
_SMOLLM2 = """
seed: 0
task:
  name: arithmetic
  options: {digits: 2, ops: "+", eval_size: 16, answer_format: hash}
  chat_template: true
  reward_fn: heterorl.bench.weights:number_reward
policy: {model: smollm2}
rollout: {group_size: 4, max_tokens: 16}
loss: {name: gepo}
optim: {warmup_steps: 0}
rl: {prompts_per_step: 4}
"""
_NUMBER = re.compile(r"-?\d+")


def number_reward(prompt: str, completion: str, answer: str) -> float:
    """1 for the right number anywhere in the completion, 0.5 for any other number, 0 for none."""
    numbers = _NUMBER.findall(completion)
    return 1.0 if answer in numbers else 0.5 if numbers else 0.0


@dataclass(frozen=True)
class Workload:
    """A model at a learning rate, with the run config its RL steps take."""

    model: str  # "tiny" | "smollm2"
    lr: float
    config: Config = field(repr=False)

    @property
    def label(self) -> str:
        return f"{self.model} lr {self.lr:.0e}"


def workloads(models: list[str], lrs: list[float], steps: int) -> list[Workload]:
    """The tiny model at `TINY_LR` (the shipped add3_rl.yaml, no warm-up) and SmolLM2 at each of ``lrs``."""
    out = []
    if "tiny" in models:
        overrides = [f"optim.lr={TINY_LR}", "optim.warmup_steps=0", f"rl.steps={steps}"]
        out.append(Workload("tiny", TINY_LR, load_config(packaged("add3_rl.yaml"), overrides)))
    if "smollm2" in models:
        for lr in lrs:
            out.append(Workload("smollm2", lr, load_config(text=_SMOLLM2, overrides=[f"optim.lr={lr}",
                                                                                      f"rl.steps={steps}"])))
    return out


@dataclass
class VersionRow:
    """One version against the one before it."""

    version: int
    fp32_bytes: int
    bf16_bytes: int
    delta_bytes: int
    changed_frac: float  # the share of elements whose bf16 bits changed
    methods: dict  # encoding -> tensors
    method_bytes: dict  # encoding -> bytes
    encode_s: float
    apply_s: float
    draws: int = 1  # batches sampled for this step (more when one carried no learning signal)
    reward_mean: float = 0.0

    @property
    def ratio(self) -> float:
        return self.bf16_bytes / self.delta_bytes


@dataclass
class TransferRow:
    """Publish -> applied over one link speed, for one count of workers, deltas on or off."""

    bits_per_s: float
    workers: int
    deltas: bool
    seconds: list  # per version: until the slowest worker applied it
    publish_s: list  # per version: the `publish` call itself (cast, pack, checksums, the step)
    link_bytes: list  # per version: what one worker's link carried
    stats: dict  # the workers' weights counters, summed

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


# -- 1. the versions of a real run, and their deltas ------------------------------------------------------

def _train_step(training, sampler, task, cfg: Config, rng: random.Random, step: int) -> tuple[int, float]:
    """One optimizer step on fresh problems, drawn again while a batch carries no learning signal:
    (batches drawn, their last mean reward)."""
    from heterorl.loops.sync_rl import rollout_datums
    from heterorl.training.step import optimize_batch

    for draw in range(1, MAX_DRAWS + 1):
        problems = [task.sample_train(rng) for _ in range(cfg.rl.prompts_per_step)]
        datums, stats = rollout_datums(sampler, task, problems, cfg, seed=cfg.seed * 100_003 + step * MAX_DRAWS + draw)
        if optimize_batch(training, datums, cfg, cfg.rl.steps * cfg.rl.updates_per_batch)["optim/updates"]:
            return draw, stats["rollout/reward_mean"]
    raise HeteroRLError(f"step {step}: {MAX_DRAWS} batches in a row carried no learning signal (every group scored "
                        "alike); raise rl.prompts_per_step or rollout.group_size")


def measure_version(layout, previous: np.ndarray, state: dict, version: int,
                    applied: np.ndarray) -> tuple[VersionRow, np.ndarray]:
    """Version ``version`` (the float32 ``state``) as a step from the bf16 bytes ``previous``, encoded, applied
    into ``applied`` (a buffer reused from version to version, as a worker's are) and checked; its row and its
    bf16 bytes. Raises HeteroRLError when the applied bytes are not the cast."""
    from heterorl.transport.weights import pack_state_dict
    from heterorl.transport.weights.deltas import apply_steps, encode_step, tensor_checksums

    packed = pack_state_dict(state, version, dtype=BF16)
    step = encode_step(layout, previous, packed.buffer, version - 1, version)
    checksums = tensor_checksums(layout, packed.buffer)  # the learner's, sent in the header
    start = time.perf_counter()
    apply_steps(layout, previous, version - 1, step.blob, version, applied, checksums)
    apply_s = time.perf_counter() - start
    if not np.array_equal(applied, packed.buffer):
        raise HeteroRLError(f"version {version}: the applied delta differs from the bf16 cast of the master in "
                            f"{int(np.count_nonzero(applied != packed.buffer))} bytes")
    sent = [state[name] for name in packed.header.names]  # (a tied tensor once)
    elements = sum(t.numel() for t in sent)
    row = VersionRow(version, sum(t.numel() * t.element_size() for t in sent), len(packed.buffer),
                     len(step.blob), step.changed / elements, dict(step.methods), dict(step.method_bytes),
                     step.seconds, apply_s)
    return row, packed.buffer


def capture(workload: Workload, steps: int, folder: Path) -> tuple[list[VersionRow], torch.nn.Module]:
    """Run the workload's steps; each version's float32 master goes to ``folder/V.pt``. The rows of versions
    1..steps and the trained model."""
    from heterorl.policies import load_policy
    from heterorl.tasks import make_task_from
    from heterorl.training.session import TrainingClient
    from heterorl.transport.weights import pack_state_dict
    from heterorl.transport.weights.deltas import Layout

    cfg = workload.config
    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(cfg.rl.base or cfg.policy.model, alphabet=task.alphabet(), tiny=cfg.policy.tiny)
    training = TrainingClient(model, tokenizer, seed=cfg.seed)
    sampler = training.live_sampling_client()  # the master itself: no copy per step
    rng, rows = random.Random(cfg.seed), []
    try:
        torch.save(training.model.state_dict(), folder / "0.pt")
        first = pack_state_dict(training.model.state_dict(), 0, dtype=BF16)
        layout, previous = Layout.of(first.header), first.buffer
        applied = np.zeros_like(previous)  # (its pages touched before the first apply is timed)
        for version in range(1, steps + 1):
            draws, reward = _train_step(training, sampler, task, cfg, rng, version)
            state = training.model.state_dict()
            torch.save(state, folder / f"{version}.pt")
            row, previous = measure_version(layout, previous, state, version, applied)
            rows.append(dataclasses.replace(row, draws=draws, reward_mean=reward))
    finally:
        sampler.close()
        training.close()
    return rows, training.model


# -- 2. publish -> applied through bandwidth-limited links --------------------------------------------------

class MeteredLink:
    """One worker's weights link: a `DelayLink` of ``bytes_per_s`` once armed (before, notices pass at once),
    and the bytes it was charged."""

    def __init__(self, name: str, bytes_per_s: float) -> None:
        from heterorl.config import LinkDelayConfig
        from heterorl.delay.links import DelayLink

        self.link = DelayLink(LinkDelayConfig(kind="constant", constant_s=0.0, bandwidth_bytes_per_s=bytes_per_s), name)
        self.armed = False
        self.charged: list[int] = []

    def schedule(self, now_s: float, size_bytes: int) -> float | None:
        if not self.armed:
            return now_s
        self.charged.append(size_bytes)
        return self.link.schedule(now_s, size_bytes)


def replay(folder: Path, versions: int, models: list, bits_per_s: float, deltas: bool, bf16_bytes: int) -> TransferRow:
    """Publish versions 0..``versions`` from ``folder`` to one worker per model (bf16 copies of the policy)."""
    from heterorl.transport import LearnerServer, WorkerClient

    config = TransportConfig(weights_deltas=deltas)
    links: dict[str, MeteredLink] = {}

    def link_of(worker_id: str):
        links[worker_id] = MeteredLink(f"{worker_id}/weights", bits_per_s / 8)
        return links[worker_id].schedule

    timeout_s = TIMEOUT_S + 2 * bf16_bytes * 8 / bits_per_s
    server = LearnerServer(_HOST, config, weights_delay=link_of)
    clients = [WorkerClient(server.control_endpoint, f"w{i}", config) for i in range(len(models))]
    reports: queue.Queue = queue.Queue()
    seconds, publish_s = [], []
    try:
        for client in clients:
            client.wait_ready(TIMEOUT_S)
        threads = [threading.Thread(target=load_versions, args=(c, m.load_state_dict, versions, timeout_s, reports),
                                    daemon=True)
                   for c, m in zip(clients, models)]
        for thread in threads:
            thread.start()
        for version in range(versions + 1):
            for link in links.values():
                link.armed = version > 0  # version 0 is every worker's starting point, not measured
            state = torch.load(folder / f"{version}.pt", weights_only=True)
            start = time.perf_counter()
            server.publish(version, state, dtype=BF16)
            published = time.perf_counter()
            applied = applied_times(reports, version, len(clients), timeout_s)
            if version:
                seconds.append(max(applied) - start)
                publish_s.append(published - start)
        for thread in threads:
            thread.join(timeout_s)
    finally:
        for client in clients:
            client.close()
        server.close()
    stats = sum((Counter(c.stats) for c in clients), Counter())  # (read once their I/O threads stopped)
    return TransferRow(bits_per_s, len(models), deltas, seconds, publish_s, next(iter(links.values())).charged,
                       {k: v for k, v in stats.items() if k.startswith("weights/")})


# -- report ------------------------------------------------------------------------------------------------

def _rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:g} Mbit/s"


def _mb(nbytes: float) -> float:
    return nbytes / 1e6


def print_versions(rows: list[VersionRow]) -> None:
    print(f"  {'v':>3} {'fp32 MB':>9} {'bf16 MB':>9} {'delta MB':>9} {'bf16/delta':>10} {'changed':>8} "
          f"{'encode s':>9} {'apply s':>8}  methods (tensors)")
    for r in rows:
        methods = ", ".join(f"{name} {n}" for name, n in sorted(r.methods.items()))
        print(f"  {r.version:>3} {_mb(r.fp32_bytes):>9.2f} {_mb(r.bf16_bytes):>9.2f} {_mb(r.delta_bytes):>9.3f} "
              f"{r.ratio:>9.2f}x {r.changed_frac:>8.2%} {r.encode_s:>9.3f} {r.apply_s:>8.3f}  {methods}")
    print(f"  applied == bf16 cast of the master: all {len(rows)} versions (checked byte for byte)", flush=True)


def print_transfer(row: TransferRow | None) -> None:
    """One row of the publish -> applied table (None: its header)."""
    if row is None:
        print(f"  {'link':>11} {'workers':>7} {'deltas':>6} {'versions':>8} {'median s':>9} {'max s':>8} "
              f"{'publish s':>9} {'link MB/version':>15}", flush=True)
        return
    print(f"  {_rate(row.bits_per_s):>11} {row.workers:>7} {'on' if row.deltas else 'off':>6} {len(row.seconds):>8} "
          f"{row.median_s:>9.3f} {max(row.seconds):>8.3f} {statistics.median(row.publish_s):>9.3f} "
          f"{_mb(statistics.mean(row.link_bytes)):>15.3f}", flush=True)


def _time_ratios(transfers: list[TransferRow], bits_per_s: float) -> dict[int, float]:
    """Workers -> median time with deltas off / on over links of ``bits_per_s``, on the versions both replayed."""
    by = {(r.workers, r.deltas): r for r in transfers if r.bits_per_s == bits_per_s}
    return {w: by[w, False].median_s / statistics.median(by[w, True].seconds[:len(by[w, False].seconds)])
            for w, d in sorted(by) if d and (w, False) in by}


def headline(results: dict) -> dict:
    """The ratios per workload and the two goals, as printed."""
    print("\nheadline (measured side by side in this run; times: the slowest worker, median over versions)")
    print(f"  {'workload':<18} {'bytes bf16/delta':>16} {'worst version':>13}  time off/on at "
          f"{_rate(GOAL_BITS_PER_S)} (workers: ratio)")
    goals: dict = {}
    for label, r in results.items():
        ratio = sum(v.bf16_bytes for v in r["versions"]) / sum(v.delta_bytes for v in r["versions"])
        times = _time_ratios(r["transfers"], GOAL_BITS_PER_S)
        shown = ", ".join(f"{w}: {t:.1f}x" for w, t in times.items()) or "not measured"
        print(f"  {label:<18} {ratio:>15.1f}x {min(v.ratio for v in r['versions']):>12.1f}x  {shown}")
        r["headline"] = {"bytes_ratio": ratio, "time_ratio_by_workers": times}
    goal = next((r for w, r in results.items() if w.startswith("smollm2") and r["lr"] == GOAL_LR), None)
    if goal is None:
        print(f"goals: not measured (they are for SmolLM2 at lr {GOAL_LR:.0e}: --models smollm2 --lrs {GOAL_LR:g})")
        return goals
    ratio = goal["headline"]["bytes_ratio"]
    goals["bytes"] = {"ratio": ratio, "target": GOAL_RATIO, "met": ratio >= GOAL_RATIO}
    print(f"goal: SmolLM2 at lr {GOAL_LR:.0e} sends {ratio:.1f}x fewer bytes than whole bf16 versions "
          f"(target >= {GOAL_RATIO:g}x): {'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    for r in (r for r in goal["transfers"] if r.deltas and r.bits_per_s == GOAL_BITS_PER_S):
        met = r.median_s < GOAL_SECONDS
        goals[f"seconds_{r.workers}_workers"] = {"median_s": r.median_s, "max_s": max(r.seconds), "met": met}
        print(f"goal: a SmolLM2 version applied over {_rate(GOAL_BITS_PER_S)}, {r.workers} worker(s): median "
              f"{r.median_s:.2f} s, max {max(r.seconds):.2f} s (target < {GOAL_SECONDS:g} s): "
              f"{'met' if met else 'NOT met'}")
    if not any(k.startswith("seconds") for k in goals):
        print(f"goal: the time over {_rate(GOAL_BITS_PER_S)}: not measured "
              f"(add {GOAL_BITS_PER_S / 1e6:g}e6 to --bandwidths)")
    return goals


# -- entry point ------------------------------------------------------------------------------------------

def _bench_workload(workload: Workload, args) -> dict:
    """Capture the workload's versions, then replay them over every link speed, worker count and mode."""
    start = time.perf_counter()
    cfg, full = workload.config, min(args.full_versions, args.steps)
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-weights-") as tmp:
        rows, model = capture(workload, args.steps, Path(tmp))
        print(f"\n{workload.label}: {args.steps} RL steps of {cfg.rl.prompts_per_step} prompts x "
              f"{cfg.rollout.group_size}, {cfg.loss.name}, {sum(p.numel() for p in model.parameters()):,} "
              f"parameters ({time.perf_counter() - start:.0f} s); each version against the one before, in bf16")
        print_versions(rows)
        print(f"  publish -> applied (the slowest worker; deltas off: the first {full} version(s) only, "
              "--full-versions)")
        print_transfer(None)
        models = [copy.deepcopy(model).to(BF16).eval() for _ in range(max(args.workers))]
        del model
        transfers = []
        for bits, workers, deltas in itertools.product(args.bandwidths, args.workers, (True, False)):
            transfers.append(replay(Path(tmp), args.steps if deltas else full, models[:workers], bits, deltas,
                                    rows[0].bf16_bytes))
            print_transfer(transfers[-1])
    seconds = time.perf_counter() - start
    print(f"  {seconds:.0f} s in all", flush=True)
    return {"lr": workload.lr, "versions": rows, "transfers": transfers, "seconds": seconds}


def _list_of(kind: type):
    """An argparse type: comma-separated numbers of ``kind``, each > 0."""
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 1,4") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one number, each > 0")
        return values
    return parse


def _models(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(MODELS):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated subset of {','.join(MODELS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=_models, default=list(MODELS),
                        help="tiny, smollm2 or both (default: tiny,smollm2)")
    parser.add_argument("--steps", type=int, default=5,
                        help="RL steps per workload: the versions measured (default: 5)")
    parser.add_argument("--lrs", type=_list_of(float), default=[1e-6, 1e-5],
                        help="SmolLM2's learning rates (default: 1e-6,1e-5)")
    parser.add_argument("--workers", type=_list_of(int), default=[1, 4],
                        help="worker counts to replay to (default: 1,4)")
    parser.add_argument("--bandwidths", type=_list_of(float), default=[100e6, 1e9],
                        help="each worker's weights link, in bits/s (default: 100e6,1e9)")
    parser.add_argument("--full-versions", type=int, default=2,
                        help="versions replayed with deltas off: whole versions are slow on a slow link (default: 2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the measurements as JSON here")
    args = parser.parse_args(argv)
    if min(args.steps, args.full_versions) < 1:
        parser.error(f"--steps {args.steps} and --full-versions {args.full_versions} must be >= 1")
    from heterorl.policies import quiet_transformers

    quiet_transformers()
    print(f"weights in bf16 over loopback, each worker behind its own link ({', '.join(map(_rate, args.bandwidths))}); "
          f"{args.steps} versions per workload; torch threads {torch.get_num_threads()}")
    results = {w.label: _bench_workload(w, args) for w in workloads(args.models, args.lrs, args.steps)}
    goals = headline(results)
    if args.out is not None:
        out = {label: {**r, "versions": [dataclasses.asdict(v) for v in r["versions"]],
                       "transfers": [dataclasses.asdict(t) for t in r["transfers"]]} for label, r in results.items()}
        args.out.write_text(json.dumps({"args": vars(args), "workloads": out, "goals": goals}, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
