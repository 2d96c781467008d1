"""``heterorl bench losses``: forward+backward time of every gepo loss, relative to ``grpo``.

One realistic batch (default 256 sequences × 512 tokens, 32 prompts × 8,
completion lengths 64..512, behaviour log-probs a few versions stale), CPU,
fp32. The learner log-probs come out of a small differentiable op
(log-sigmoid of a linear map of fixed features), so backward does real work
through a graph. Losses run round-robin in one process, after a warm-up; each
time is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gepo


def make_inputs(batch: int, length: int, group_size: int, features: int = 8, seed: int = 0) -> dict:
    """Data of one batch (no gradient anywhere yet) and the parameters of the op that makes log p."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    hidden = torch.randn(batch, length, features, generator=gen)
    weight = torch.randn(features, generator=gen) * 0.5
    bias = torch.tensor(2.0)
    with torch.no_grad():
        logp = torch.nn.functional.logsigmoid(hidden @ weight + bias)
    staleness = torch.randint(0, 4, (batch, 1), generator=gen).expand(batch, length)
    return {
        "hidden": hidden, "weight": weight, "bias": bias, "mask": mask,
        "behaviour_logprobs": logp + 0.1 * staleness * torch.randn(batch, length, generator=gen),
        "rewards": torch.randint(0, 2, (batch,), generator=gen).float(),
        "group_ids": torch.arange(batch) // group_size,
        "policy_versions": (10 - staleness).contiguous(),
    }


def forward_backward(name: str, config, inputs: dict) -> float:
    """Seconds for: make log p (with gradient), build the batch, the loss, its backward."""
    weight = inputs["weight"].clone().requires_grad_(True)
    start = time.perf_counter()
    logprobs = torch.nn.functional.logsigmoid(inputs["hidden"] @ weight + inputs["bias"])
    batch = gepo.LossBatch(logprobs=logprobs, mask=inputs["mask"], behaviour_logprobs=inputs["behaviour_logprobs"],
                           rewards=inputs["rewards"], group_ids=inputs["group_ids"],
                           policy_versions=inputs["policy_versions"], current_version=10)
    loss, _ = gepo.get_loss(name).fn(batch, config)
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench losses", description=__doc__)
    parser.add_argument("--batch", type=int, default=256, help="sequences")
    parser.add_argument("--length", type=int, default=512, help="completion tokens (padded length T)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier timings when other work shares the cores)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    inputs = make_inputs(args.batch, args.length, args.group_size)
    names = [n for n in gepo.loss_names() if n != "cross_entropy"]
    configs = {n: gepo.make_loss_config(n, {"advantage": "group_normalized"} if n == "importance_sampling" else {})
               for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(args.warmup + args.repeats):
        for name in names:  # round-robin, so that machine noise hits every loss alike
            seconds = forward_backward(name, configs[name], inputs)
            if repeat >= args.warmup:
                times[name].append(seconds)
    median = {n: statistics.median(t) for n, t in times.items()}
    print(f"batch={args.batch}x{args.length} fp32 CPU threads={torch.get_num_threads()} "
          f"repeats={args.repeats} (median, after {args.warmup} warm-up rounds)")
    print(f"  {'loss':22s} {'fwd+bwd ms':>10s} {'vs grpo':>8s}")
    for name in sorted(names, key=median.get):
        print(f"  {name:22s} {1000 * median[name]:10.2f} {median[name] / median['grpo']:7.2f}x")
    return 0
