"""``heterorl bench service``: the session primitives remote (a `heterorl serve` process on this machine, over
HTTP on loopback) against the same calls local, side by side in one run; and the OpenAI-compatible endpoint's
requests/s under concurrent clients.

Workloads on the shipped ``add3-sft-base`` (``--base``): ``forward_backward`` + ``optim_step`` of a batch of
``--batch`` datums (groups of 8 completions of 3-digit sums, GEPO), and ``sample`` of ``--prompts`` prompts ×
``--group-size``.
Rounds alternate local / remote; each figure is the median of ``--repeats`` after a warm-up. The service runs
with the same torch threads as this process (``--threads``). Goal: remote / local ≤ 1.15×.

With Tinker's SDK installed (``--tinker``, the default then), the same work also goes through it to the same
service (docs/SERVICE.md, "From Tinker"): the same sequences as Tinker datums (every position scored, no prompt
shared) with ``importance_sampling``, against the same datums and loss run locally as the service runs them; and
the samples as ``--prompts`` concurrent requests of ``--group-size``, as the SDK sends them.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BASE = "add3-sft-base"
GOAL = 1.15


def _datums(tokenizer, n: int, seed: int = 0) -> list:
    from heterorl.training.session import Datum

    rng, datums = random.Random(seed), []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt = tokenizer.encode(f"{a}+{b}=")
        completion = tokenizer.encode(str(a + b + rng.choice([0, 1, 10]))) + [tokenizer.eos_token_id]
        datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt), reward=float(rng.random() < 0.5),
                            group_id=i // 8, behaviour_logprobs=[-0.3] * len(completion)))
    return datums


def _time(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def start_service(*options: str, state_dir: str | None = None,
                  timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """A `heterorl serve` process on a free loopback port that it picks itself (``--bind 127.0.0.1:0``), with
    ``options`` (e.g. ``--threads 1``) and its log in ``state_dir`` (a new temporary folder when None); returns
    (the process, its URL) once it prints the URL it serves on. No port is chosen here and released, so no other
    process can take it between the choice and the bind."""
    state = state_dir or tempfile.mkdtemp(prefix="heterorl-bench-service-")
    log_path = os.path.join(state, "serve.log")
    with open(log_path, "w") as log:  # (a pipe nobody reads would stall the service once full)
        process = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "serve", "--bind", "127.0.0.1:0",
                                    "--state-dir", state, "--log-level", "warning", *options],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=state, env={**os.environ})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"serving training sessions on (http://\S+)", open(log_path).read())
        if found:
            return process, found.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"heterorl serve exited: {open(log_path).read()[-2000:]}")
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"heterorl serve did not say where it serves within {timeout_s:g} s: "
                       f"{open(log_path).read()[-2000:]}")


def _completions_rate(url: str, model: str, clients: int, seconds: float, max_tokens: int,
                      api_key: str | None = None) -> float:
    """/v1/completions answered per second to ``clients`` clients, each sending one request after another."""
    import httpx

    done, stop = [0] * clients, threading.Event()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"model": model, "prompt": f"{100 + i}+{200 + i}=",
                                                        "max_tokens": max_tokens, "temperature": 1.0})
                r.raise_for_status()
                done[i] += 1
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    return sum(done) / (time.perf_counter() - start)


def _tinker_times(url: str, datums: list, prompts: list[list[int]], args) -> dict[str, list[float]]:
    """Seconds per round through Tinker's SDK against the service at ``url``, and of the same Tinker datums run
    locally as the service runs them: {"step", "local step", "sample"}."""
    import numpy as np
    import tinker
    from tinker import types

    from heterorl.policies import load_policy
    from heterorl.service.tinker import losses, protobuf
    from heterorl.training.session import AdamParams, TrainingClient

    rows = []  # (tokens, targets, sampler log-probs, advantages) per datum: every position
    for d in datums:
        pad = d.prompt_len - 1
        rows.append((d.tokens[:-1], np.array(d.tokens[1:], dtype=np.int64),
                     np.array([0.0] * pad + d.behaviour_logprobs, dtype=np.float32),
                     np.array([0.0] * pad + [d.reward - 0.5] * d.completion_len, dtype=np.float32)))
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={
        "target_tokens": y, "logprobs": q, "advantages": a}) for t, y, q, a in rows]
    sdk = tinker.ServiceClient(base_url=f"{url}/tinker", api_key="tml-bench")
    training = sdk.create_lora_training_client(base_model=args.base, rank=8, seed=0).result()
    model, tokenizer = load_policy(args.base)
    from heterorl.service.client import lora_spec

    local = TrainingClient(model, tokenizer, seed=0, lora=lora_spec(8))
    built = losses.build([protobuf.Datum(t, {"target_tokens": y, "logprobs": q, "advantages": a})
                          for t, y, q, a in rows], "importance_sampling", {})
    adam = types.AdamParams(learning_rate=1e-5)
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)

    def sample() -> None:
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
        for future in futures:
            future.result()

    times: dict[str, list[float]] = {}
    for _ in range(2):
        times.setdefault("step", []).extend(_time(lambda: (training.forward_backward(sdk_data, "importance_sampling")
                                                           .result(), training.optim_step(adam).result()),
                                                  args.repeats))
        times.setdefault("local step", []).extend(_time(lambda: (local.forward_backward(*built).result(),
                                                                 local.optim_step(AdamParams(learning_rate=1e-5))
                                                                 .result()), args.repeats))
        times.setdefault("sample", []).extend(_time(sample, args.repeats))
    sdk.close("success").result()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="datums per forward_backward (default 64)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per sample call (default 32)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per sample (default 8)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per figure (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the service (default 1)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent /v1/completions clients (default 8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long they run (default 10)")
    parser.add_argument("--base", default=BASE, help=f"the base model, a name heterorl serve loads (default {BASE})")
    parser.add_argument("--tinker", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the same calls through Tinker's SDK (default: when it is installed)")
    args = parser.parse_args(argv)
    if args.tinker is None:
        import importlib.util

        args.tinker = importlib.util.find_spec("tinker") is not None
    import torch

    from heterorl.engines.base import SamplingParams
    from heterorl.policies import load_policy, quiet_transformers
    from heterorl.service.client import connect
    from heterorl.training.session import AdamParams, TrainingClient

    quiet_transformers()
    torch.set_num_threads(args.threads)
    process, url = start_service("--threads", str(args.threads))
    try:
        service = connect(url)
        model, tokenizer = load_policy(args.base)
        clients = {"local": TrainingClient(model, tokenizer, seed=0), "remote": service.create_training_client(
            args.base, seed=0)}
        datums = _datums(tokenizer, args.batch)
        samplers = {name: c.save_weights_and_get_sampling_client() for name, c in clients.items()}
        prompts = [tokenizer.encode(f"{random.Random(i).randint(100, 999)}+{i + 100}=") for i in range(args.prompts)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
        results: dict = {"local": {}, "remote": {}}
        for _ in range(2):  # alternate: each side measured twice, interleaved
            for name, c in clients.items():
                step = _time(lambda: (c.forward_backward(datums, loss_fn="gepo").result(),
                                      c.optim_step(AdamParams(learning_rate=1e-5)).result()), args.repeats)
                sample = _time(lambda: samplers[name].sample(prompts, args.group_size, params).result(),
                               args.repeats)
                results[name].setdefault("step", []).extend(step)
                results[name].setdefault("sample", []).extend(sample)
        if args.tinker:
            tinker_times = _tinker_times(url, datums, prompts, args)
        rate = _completions_rate(url, samplers["remote"].model, args.clients, args.seconds, args.max_tokens)
        print(f"{args.base}: forward_backward + optim_step of {args.batch} datums (GEPO); sample of {args.prompts} x "
              f"{args.group_size}, {args.max_tokens} new tokens; {args.threads} torch thread(s) on each side; "
              f"median of {2 * args.repeats}")
        for what, label in (("step", "forward_backward + optim_step"), ("sample", "sample")):
            local, remote = (statistics.median(results[n][what]) for n in ("local", "remote"))
            ratio = remote / local
            print(f"  {label:<30} local {local * 1e3:8.1f} ms | remote {remote * 1e3:8.1f} ms | remote / local "
                  f"{ratio:.3f}x (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'})")
        if args.tinker:
            step, local_step, sample = (statistics.median(tinker_times[k]) for k in ("step", "local step", "sample"))
            print(f"  Tinker SDK: forward_backward + optim_step (importance_sampling on the same sequences as Tinker "
                  f"datums) local {local_step * 1e3:8.1f} ms | SDK {step * 1e3:8.1f} ms | SDK / local "
                  f"{step / local_step:.3f}x")
            local_sample = statistics.median(results["local"]["sample"])
            print(f"  Tinker SDK: sample as {args.prompts} concurrent requests of {args.group_size}: SDK "
                  f"{sample * 1e3:8.1f} ms | SDK / local (one call) {sample / local_sample:.3f}x")
        print(f"  /v1/completions, {args.clients} concurrent clients, {args.max_tokens} tokens each: "
              f"{rate:.1f} requests/s")
        service.close()
    finally:
        process.terminate()
        process.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
