"""``heterorl bench engine --engine vllm --stream``: a vLLM worker's sampling with and without a batch barrier.

One `StreamingVLLMEngine`, one long-tailed workload, three ways of feeding it, side by side in one run:

``batch``             the worker's batch loop: ``--in-flight`` groups submitted together, the next call when the
                      slowest has ended; new weights loaded between calls;
``stream``            up to ``--in-flight`` groups in the engine, a new one submitted whenever one ends; a new version
                      waits until the groups in flight have ended (no in-flight updates);
``stream+inflight``   the same, new versions loaded while the groups run (recompute: exact log-probs).

The workload: every group is ``--group-size`` samples of one prompt whose length is drawn from a long tail
(``--mean-tokens`` x LogNormal(0, ``--sigma``), capped to the model's context, EOS ignored so that every sample is
exactly that long), the same sequence of groups for each mode. A publisher thread plays the learner: a new
version (the same weights, loaded in full each time) every ``--publish-every`` seconds. Printed per mode:
samples/s and tokens/s, the engine's occupancy (sequences in flight over ``--in-flight`` x group size, averaged
over time: each count weighted by how long it held), the per-token staleness when its group was delivered
(versions behind the newest published, and seconds since its version stopped being the newest), and the versions
loaded with the mean time a load held the caller (pause, load, resume). Each mode runs ``--repeats`` times, the
modes interleaved; the row shown is each mode's median run by samples/s, and the ratios are against ``batch``'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import threading
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench engine --engine vllm --stream", description=__doc__)
    parser.add_argument("--policy", default="add3-sft-base", help="a shipped policy or a Hugging Face folder")
    parser.add_argument("--groups", type=int, default=96, help="groups sampled in each mode")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=16,
                        help="groups in the engine at once: batch mode's call, streaming's bound")
    parser.add_argument("--engine", choices=("vllm",), default="vllm", help=argparse.SUPPRESS)
    parser.add_argument("--mean-tokens", type=float, default=16.0, help="median completion length of the tail")
    parser.add_argument("--sigma", type=float, default=1.0, help="the tail's LogNormal sigma")
    parser.add_argument("--publish-every", type=float, default=1.0, help="seconds between new versions")
    parser.add_argument("--threads", type=int, default=None, help="vLLM's CPU threads (default: vLLM's rule)")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--inflight-kv", choices=("recompute", "keep"), default="recompute",
                        help="what becomes of the requests' keys and values at an in-flight update")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved (median shown)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from heterorl.engines import SamplingParams
    from heterorl.engines.vllm_stream import StreamingVLLMEngine
    from heterorl.policies import load_policy, policy_folder, quiet_transformers

    quiet_transformers()
    model, tokenizer = load_policy(args.policy)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    context = model.config.max_position_embeddings
    rng = random.Random(args.seed)
    prompt = tokenizer.encode("123+456=", add_special_tokens=False) or [1]
    lengths = [max(1, min(context - len(prompt) - 1, round(args.mean_tokens * rng.lognormvariate(0, args.sigma))))
               for _ in range(args.groups)]
    work = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=args.seed + i)
            for i, n in enumerate(lengths)]
    started = time.monotonic()
    engine = StreamingVLLMEngine(policy_folder(args.policy), eos_token_id=tokenizer.eos_token_id,
                                 dtype=args.vllm_dtype, cpu_threads=args.threads, inflight_kv=args.inflight_kv,
                                 max_num_seqs=max(256, args.in_flight * args.group_size))
    mean = sum(lengths) / len(lengths)
    print(f"policy={args.policy} groups={args.groups} x {args.group_size} lengths: mean {mean:.1f} "
          f"median {sorted(lengths)[len(lengths) // 2]} max {max(lengths)} tokens; {args.in_flight} groups a "
          f"call or in flight; a version every {args.publish_every} s; in-flight KV {args.inflight_kv}; "
          f"vLLM started in {time.monotonic() - started:.1f} s")
    runs: dict[str, list[dict]] = {mode: [] for mode in ("batch", "stream", "stream+inflight")}
    try:
        for _ in range(args.repeats):  # interleaved, so that a busy stretch of the machine hits every mode
            for mode, results in runs.items():
                results.append(_run_mode(engine, mode, prompt, work, state, args))
    finally:
        engine.close()
    rows = {mode: _median_row(results) for mode, results in runs.items()}
    base = rows["batch"]
    print(f"{'mode':18s} {'samples/s':>10s} {'tokens/s':>10s} {'occupancy':>10s} {'stale v':>8s} {'stale s':>8s} "
          f"{'loads':>6s} {'ms/load':>8s} {'vs batch':>9s}")
    for mode, row in rows.items():
        print(f"{mode:18s} {row['samples_per_s']:10.1f} {row['tokens_per_s']:10.0f} {row['occupancy']:10.2f} "
              f"{row['staleness_versions']:8.2f} {row['staleness_s']:8.2f} {row['loads']:6d} {row['ms_per_load']:8.0f} "
              f"{row['samples_per_s'] / base['samples_per_s']:8.2f}x")
    return 0


def _median_row(results: list[dict]) -> dict:
    """The run with the median samples/s (its other columns with it)."""
    ranked = sorted(results, key=lambda row: row["samples_per_s"])
    return ranked[len(ranked) // 2]


class _Publisher:
    """The learner's side: a new version every ``every`` seconds, with the time each was published."""

    def __init__(self, every: float) -> None:
        self.every, self.published = every, [time.monotonic()]  # version v published at published[v]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.published.append(time.monotonic())

    @property
    def newest(self) -> int:
        return len(self.published) - 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _TimeWeighted:
    """The time-weighted mean of a count (the groups in flight): each value counts for as long as it held,
    so a busy stretch is not over-weighted by how often the loop looked at it."""

    def __init__(self) -> None:
        self.start = self.since = time.monotonic()
        self.value, self.area = 0, 0.0

    def set(self, value: int) -> None:
        now = time.monotonic()
        self.area += self.value * (now - self.since)
        self.since, self.value = now, value

    def mean(self) -> float:
        self.set(self.value)
        return self.area / max(1e-9, self.since - self.start)


def _run_mode(engine, mode: str, prompt: list[int], work: list, state: dict, args) -> dict:
    engine.load_version(engine.version + 1, state)
    offset = engine.version  # the publisher's version v is the engine's offset + v
    loads, load_s = 0, 0.0
    publisher = _Publisher(args.publish_every)
    samples, tokens, stale_versions, stale_seconds = 0, 0, [], []
    in_flight: dict[concurrent.futures.Future, int] = {}
    todo = list(range(len(work)))
    held = 0  # the publisher's version the engine holds

    def take(newest_only_when_idle: bool) -> None:
        nonlocal held, loads, load_s
        newest = publisher.newest
        if newest > held and not (newest_only_when_idle and in_flight):
            began = time.monotonic()
            engine.load_version(offset + newest, state)
            held, loads, load_s = newest, loads + 1, load_s + time.monotonic() - began

    def deliver(future) -> None:
        nonlocal samples, tokens
        in_flight.pop(future)
        now, newest = time.monotonic(), publisher.newest
        for sample in future.result():
            samples += 1
            tokens += len(sample.tokens)
            for version in sample.versions:
                v = version - offset
                stale_versions.append(newest - v)
                stale_seconds.append(now - publisher.published[v + 1] if v < newest else 0.0)

    occupancy = _TimeWeighted()
    start = time.monotonic()
    while todo or in_flight:
        if mode == "batch":
            take(newest_only_when_idle=True)
            for i in todo[:args.in_flight]:
                in_flight[engine.submit(prompt, work[i], args.group_size)] = i
            del todo[:args.in_flight]
            occupancy.set(len(in_flight))
            while in_flight:
                done, _ = concurrent.futures.wait(list(in_flight), timeout=0.01,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    deliver(future)
                occupancy.set(len(in_flight))
            continue
        take(newest_only_when_idle=mode == "stream")
        waiting_for_version = mode == "stream" and publisher.newest > held
        while todo and len(in_flight) < args.in_flight and not waiting_for_version:
            i = todo.pop(0)
            in_flight[engine.submit(prompt, work[i], args.group_size)] = i
        occupancy.set(len(in_flight))
        done, _ = concurrent.futures.wait(list(in_flight), timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            deliver(future)
        occupancy.set(len(in_flight))
    elapsed = time.monotonic() - start
    publisher.stop()
    return {"samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed,
            "occupancy": occupancy.mean() / args.in_flight,
            "staleness_versions": sum(stale_versions) / max(1, len(stale_versions)),
            "staleness_s": sum(stale_seconds) / max(1, len(stale_seconds)),
            "loads": loads, "ms_per_load": 1000 * load_s / max(1, loads)}
