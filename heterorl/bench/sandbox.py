"""``heterorl bench sandbox``: how fast the code task's sandbox scores programs, and what scoring costs a worker.

0. **Start-up cost** of each isolation (``--isolation``, default both: the jail, nsjail, and the weak sandbox):
   the median time to run a program that returns at once, ``--startup-runs`` times each, alternating. With
   ``--seccomp both`` the jail is measured with its seccomp filter and without it (``nsjail-noseccomp``), side by
   side; ``--seccomp off`` measures it without only.
1. **Tests per second** (``--programs`` programs of the `code` task, ``--tests`` hidden tests each, up to
   ``--parallel`` at once, wall-clock limit ``--wall-s``), per isolation, with 0 %, 50 % and 100 % of the
   programs hanging (they close their output and sleep: each runs until the wall clock and scores 0). The rest
   are the reference solutions. The jail's figures are also given as a ratio of the weak sandbox's.
2. **A worker's samples/s** (a fresh tiny policy, context 512, sampling ``--rounds`` batches of ``--programs``
   completions of the code task's prompts, 64 tokens each, with the torch engine): sampling alone, then sampling
   and scoring each batch with the same mixes of programs, scored after the batch is sampled, and scored while
   the next batch is sampled (`runtime.worker.Pipeline`, as a rollout worker does).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from heterorl.errors import HeteroRLError

HANG = "import os, time\ndef {entry}(*args):\n    os.close(1)\n    os.close(2)\n    time.sleep(3600)\n"
HANG_STDIO = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(3600)\n"
SHARES = (0.0, 0.5, 1.0)


def _programs(task, n: int, share: float, seed: int = 0) -> tuple[list, list[str]]:
    """``n`` training problems and, for each, its reference solution or (a ``share`` of them) a hang."""
    rng = random.Random(seed)
    problems = [task.sample_train(rng) for _ in range(n)]
    hanging = set(rng.sample(range(n), round(share * n)))
    programs = [(HANG.format(entry=p.data["entry"]) if p.data["entry"] else HANG_STDIO) if i in hanging
                else task.demonstration(p) for i, p in enumerate(problems)]
    return problems, programs


NO_SECCOMP = "-noseccomp"  # a variant's name: the jail without its seccomp filter


def _variants(isolations: list[str], seccomp: str) -> list[str]:
    """The sandboxes measured: each isolation, and the jail with (``nsjail``) and/or without its seccomp filter
    (``nsjail-noseccomp``) as ``seccomp`` says (on, off, both)."""
    variants = []
    for kind in isolations:
        if kind == "nsjail" and seccomp != "on":
            variants += [kind, kind + NO_SECCOMP] if seccomp == "both" else [kind + NO_SECCOMP]
        else:
            variants.append(kind)
    return variants


def _sandbox(variant: str, limits, parallel: int):
    from heterorl.tasks.sandbox import Sandbox

    return Sandbox(limits, parallel, isolation=variant.removesuffix(NO_SECCOMP),
                   seccomp=not variant.endswith(NO_SECCOMP))


def _code_task(args, variant: str):
    from heterorl.tasks import make_task
    from heterorl.tasks.sandbox import SandboxLimits

    task = make_task("code", {"tests": args.tests, "max_parallel": args.parallel, "wall_s": args.wall_s,
                              "cpu_s": args.wall_s, "allow_weak_sandbox": variant == "weak"})
    task.use_sandbox(_sandbox(variant, SandboxLimits(wall_s=args.wall_s, cpu_s=args.wall_s), args.parallel))
    return task


def startup_seconds(args) -> dict[str, float]:
    """The median seconds to run a program that returns at once, per sandbox, measured alternately."""
    from heterorl.tasks.sandbox import SandboxLimits, TestCase

    boxes = {kind: _sandbox(kind, SandboxLimits(wall_s=10.0), 1) for kind in args.variants}
    times: dict[str, list[float]] = {kind: [] for kind in boxes}
    for _ in range(args.startup_runs):
        for kind, box in boxes.items():
            start = time.perf_counter()
            if box.run("def f():\n    return 1\n", [TestCase(expected=1)], entry="f").reason != "ok":
                raise HeteroRLError(f"the {kind} sandbox failed a trivial program")
            times[kind].append(time.perf_counter() - start)
    for box in boxes.values():
        box.close()
    return {kind: statistics.median(values) for kind, values in times.items()}


def tests_per_second(args) -> list[dict]:
    rows = []
    for share in SHARES:
        for variant in args.variants:
            task = _code_task(args, variant)
            problems, programs = _programs(task, args.programs, share)
            start = time.perf_counter()
            rewards = task.reward_batch(problems, programs)
            seconds = time.perf_counter() - start
            expected = [0.0 if "time.sleep(3600)" in p else 1.0 for p in programs]
            if rewards != expected:
                raise HeteroRLError(f"the {variant} sandbox scored {rewards} where {expected} was due")
            rows.append({"share": share, "isolation": variant, "seconds": seconds,
                         "programs_per_s": len(programs) / seconds, "tests_per_s": len(programs) * args.tests / seconds,
                         "bound_s": args.wall_s * math.ceil(round(share * args.programs) / args.parallel),
                         "stats": dict(task.stats)})
            task.sandbox.close()
    return rows


def worker_samples_per_second(args) -> dict:
    """Samples/s of sampling alone, and of sampling and scoring ``--rounds`` batches, per share of hanging
    programs: scored after each batch is sampled, and scored while the next one is (`worker.Pipeline`, what a
    rollout worker does)."""
    from heterorl.config import TinyModelConfig
    from heterorl.engines.base import SamplingParams
    from heterorl.policies import load_policy
    from heterorl.runtime.rollouts import Pipeline
    from heterorl.tasks.rewards import score_all
    from heterorl.training.session import SamplingClient

    task = _code_task(args, args.variants[0])
    model, tokenizer = load_policy("tiny", alphabet=task.alphabet(), tiny=TinyModelConfig(max_positions=512))
    sampler = SamplingClient.for_model(model, tokenizer)
    params = SamplingParams(max_tokens=64, ignore_eos=True, seed=0)
    rows = {}
    for share in (None, *SHARES):
        problems, programs = _programs(task, args.programs, share or 0.0, seed=1)
        prompts = [tokenizer.encode(p.prompt) for p in problems]

        def score(groups) -> None:  # what a program of this mix would score, as the worker scores a batch
            samples = [group[0] for group in groups]
            for sample, program in zip(samples, programs):
                sample.text = program
            score_all(task, problems, samples)

        rates = []
        for pipelined in (False, True):
            pipeline, start = Pipeline(), time.perf_counter()
            for _ in range(args.rounds):
                groups = sampler.sample(prompts, 1, params).result()
                if share is not None and pipelined:
                    pipeline.submit(lambda g=groups: score(g))
                elif share is not None:
                    score(groups)
            pipeline.drain()
            pipeline.close()
            rates.append(args.rounds * args.programs / (time.perf_counter() - start))
            if share is None:
                break
        rows["sampling only" if share is None else f"{share:.0%} hanging"] = rates
    task.sandbox.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=32, help="programs per figure (default 32)")
    parser.add_argument("--tests", type=int, default=8, help="hidden tests per program (default 8)")
    parser.add_argument("--parallel", type=int, default=2, help="programs at once (default 2: the cores)")
    parser.add_argument("--wall-s", type=float, default=1.0, help="each program's time limit (default 1 s)")
    parser.add_argument("--rounds", type=int, default=3, help="batches per worker figure (default 3)")
    parser.add_argument("--isolation", default="nsjail,weak",
                        help="the sandboxes to measure, comma-separated (default nsjail,weak; the worker figures "
                             "use the first)")
    parser.add_argument("--seccomp", choices=("on", "off", "both"), default="on",
                        help="the jail with its seccomp filter (on, the default), without it (off: nsjail-noseccomp), "
                             "or both side by side")
    parser.add_argument("--startup-runs", type=int, default=20, help="runs per start-up figure (default 20)")
    parser.add_argument("--skip-worker", action="store_true", help="leave out part 2")
    args = parser.parse_args(argv)
    from heterorl.tasks.sandbox import ISOLATIONS

    args.isolation = [kind.strip() for kind in args.isolation.split(",") if kind.strip()]
    if not args.isolation or set(args.isolation) - set(ISOLATIONS):
        parser.error(f"--isolation: give some of {', '.join(ISOLATIONS)}, comma-separated")
    args.variants = _variants(args.isolation, args.seccomp)
    if min(args.programs, args.tests, args.parallel, args.rounds) < 1 or args.wall_s <= 0:
        parser.error("--programs, --tests, --parallel and --rounds must be >= 1, --wall-s > 0")
    startup = startup_seconds(args)
    print(f"0. start-up: the median of {args.startup_runs} runs of a program that returns at once")
    bare = "nsjail" + NO_SECCOMP
    for kind, seconds in startup.items():
        print(f"  {kind:>16} | {seconds * 1000:6.1f} ms per program"
              + (f" ({seconds / startup['weak']:4.2f}x the weak sandbox's)" if "weak" in startup and kind != "weak"
                 else "")
              + (f" ({seconds / startup[bare]:4.2f}x without seccomp)" if kind == "nsjail" and bare in startup else ""))
    print(f"\n1. the sandbox: {args.programs} programs x {args.tests} hidden tests, {args.parallel} at once, "
          f"{args.wall_s:g} s limit each")
    rows = tests_per_second(args)
    weak = {row["share"]: row for row in rows if row["isolation"] == "weak"}
    unfiltered = {row["share"]: row for row in rows if row["isolation"] == bare}
    for row in rows:
        ratio = (f" ({row['tests_per_s'] / weak[row['share']]['tests_per_s']:4.2f}x weak)"
                 if row["isolation"] != "weak" and row["share"] in weak else "")
        if row["isolation"] == "nsjail" and row["share"] in unfiltered:
            ratio += f" ({row['tests_per_s'] / unfiltered[row['share']]['tests_per_s']:4.2f}x without seccomp)"
        print(f"  {row['isolation']:>16} | {row['share']:4.0%} hanging | {row['seconds']:6.2f} s (bound "
              f"{row['bound_s']:g} s + scoring) | {row['programs_per_s']:6.1f} programs/s | "
              f"{row['tests_per_s']:7.1f} tests/s{ratio} | {row['stats']}")
    if not args.skip_worker:
        rows = worker_samples_per_second(args)
        print(f"\n2. a worker: a tiny policy samples {args.rounds} batches of {args.programs} completions of 64 tokens "
              "and scores them")
        base = rows["sampling only"][0]
        print(f"  {'sampling only':>14} | {base:6.1f} samples/s")
        for name, (after, pipelined) in list(rows.items())[1:]:
            print(f"  {name:>14} | scored after sampling {after:6.1f} samples/s ({after / base:4.2f}x) | scored while "
                  f"the next batch samples {pipelined:6.1f} samples/s ({pipelined / base:4.2f}x)")
    return 0


__all__ = ["main", "tests_per_second", "worker_samples_per_second"]
