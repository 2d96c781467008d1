"""``heterorl bench sandbox``: how fast the code task's sandbox scores programs, and what scoring costs a worker.

1. **Tests per second** (``--programs`` programs of the `code` task, ``--tests`` hidden tests each, up to
   ``--parallel`` at once, wall-clock limit ``--wall-s``), with 0 %, 50 % and 100 % of the programs looping
   forever (each runs until the limit and scores 0). The rest are the reference solutions.
2. **A worker's samples/s** (a fresh tiny policy, context 512, sampling ``--rounds`` batches of ``--programs``
   completions of the code task's prompts, 64 tokens each, with the torch engine): sampling alone, then sampling
   and scoring each batch with the same mixes of programs, scored after the batch is sampled, and scored while
   the next batch is sampled (`runtime.worker.Pipeline`, as a rollout worker does).
"""

from __future__ import annotations

import argparse
import random
import time

from heterorl.errors import HeteroRLError

LOOP = "def {entry}(*args):\n    while True:\n        pass\n"
LOOP_STDIO = "while True:\n    pass\n"
SHARES = (0.0, 0.5, 1.0)


def _programs(task, n: int, share: float, seed: int = 0) -> tuple[list, list[str]]:
    """``n`` training problems and, for each, its reference solution or (a ``share`` of them) a loop."""
    rng = random.Random(seed)
    problems = [task.sample_train(rng) for _ in range(n)]
    looping = set(rng.sample(range(n), round(share * n)))
    programs = [(LOOP.format(entry=p.data["entry"]) if p.data["entry"] else LOOP_STDIO) if i in looping
                else task.demonstration(p) for i, p in enumerate(problems)]
    return problems, programs


def tests_per_second(args) -> list[dict]:
    from heterorl.tasks import make_task

    rows = []
    for share in SHARES:
        task = make_task("code", {"tests": args.tests, "max_parallel": args.parallel, "wall_s": args.wall_s,
                                  "cpu_s": args.wall_s})
        problems, programs = _programs(task, args.programs, share)
        start = time.perf_counter()
        rewards = task.reward_batch(problems, programs)
        seconds = time.perf_counter() - start
        expected = [0.0 if "while True" in p else 1.0 for p in programs]
        if rewards != expected:
            raise HeteroRLError(f"the sandbox scored {rewards} where {expected} was due")
        rows.append({"share": share, "seconds": seconds, "programs_per_s": len(programs) / seconds,
                     "tests_per_s": len(programs) * args.tests / seconds, "stats": dict(task.stats)})
        task.sandbox.close()
    return rows


def worker_samples_per_second(args) -> dict:
    """Samples/s of sampling alone, and of sampling and scoring ``--rounds`` batches, per share of looping
    programs: scored after each batch is sampled, and scored while the next one is (`worker.Pipeline`, what a
    rollout worker does)."""
    from heterorl.config import TinyModelConfig
    from heterorl.engines.base import SamplingParams
    from heterorl.policies import load_policy
    from heterorl.runtime.worker import Pipeline
    from heterorl.tasks import make_task
    from heterorl.tasks.rewards import score_all
    from heterorl.training.session import SamplingClient

    task = make_task("code", {"tests": args.tests, "max_parallel": args.parallel, "wall_s": args.wall_s,
                              "cpu_s": args.wall_s})
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
        rows["sampling only" if share is None else f"{share:.0%} looping"] = rates
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
    parser.add_argument("--skip-worker", action="store_true", help="leave out part 2")
    args = parser.parse_args(argv)
    if min(args.programs, args.tests, args.parallel, args.rounds) < 1 or args.wall_s <= 0:
        parser.error("--programs, --tests, --parallel and --rounds must be >= 1, --wall-s > 0")
    print(f"1. the sandbox: {args.programs} programs x {args.tests} hidden tests, {args.parallel} at once, "
          f"{args.wall_s:g} s limit each")
    for row in tests_per_second(args):
        print(f"  {row['share']:4.0%} looping | {row['seconds']:6.2f} s | {row['programs_per_s']:6.1f} programs/s | "
              f"{row['tests_per_s']:7.1f} tests/s | {row['stats']}")
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
