"""``heterorl bench lora``: LoRA against full fine-tuning, in one run, side by side.

1. **Learning** (``--steps``; skip with ``--skip learning``): synchronous GRPO on 3-digit addition answered
   ``#### N`` from the shipped ``arith-hash-sft-base`` (the tiny model; the packaged arith_rl.yaml, 32 prompts
   x 8), once training the whole model (lr 1e-4, the sweep's) and once a rank-16 adapter on every
   projection (lr 1e-3), the same steps and seed, each in its own process. Per run: held-out greedy success
   before and after (256 problems), minutes, the process's peak resident memory, the training state (weights,
   gradients and Adam moments, from the tensors themselves) and the bytes of one version on the wire (the
   whole model at ``runtime.weights_dtype=auto``, or the adapter).
2. **Weights** (``--model``, ``--ranks``, ``--bandwidth``; skip with ``--skip weights``): per rank, a LoRA session
   on the model takes ``--versions`` real optimizer steps (cross-entropy on a fixed batch of sums, lr 1e-4).
   Each version goes through a real `LearnerServer` to a `WorkerClient` behind a weights link of
   ``--bandwidth`` bits/s (`DelayLink`), three ways, taking turns: the merged weights in bfloat16 whole (deltas
   off: what a system without deltas sends), the same with deltas (``lora.publish: merged``), and the adapter
   alone in float32 with deltas (``lora.publish: adapter``). Timed from just
   before ``publish`` until the worker applied it to its bfloat16 model (the adapter merged into its own base by
   `lora.Merger` first). Version 0 reaches both workers first, untimed and not charged to the links.
3. **Sampling** (skip with ``--skip sampling``): the torch engine on the model with a trained rank-r adapter
   merged into its weights against kept beside them (``lora.apply``): samples/s of the same prompts
   (``--samples`` completions of 32 tokens), alternating rounds, median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from heterorl.bench.weights import MeteredLink
from heterorl.config import LoraConfig, TransportConfig
from heterorl.errors import HeteroRLError

BF16 = torch.bfloat16
TIMEOUT_S = 120.0  # a worker's wait for a version, beyond the time its link needs to carry it whole
LEARNING = (("full fine-tuning", ["optim.lr=1e-4"]), ("LoRA rank 16", ["optim.lr=1e-3", "lora.rank=16"]))


# -- 1. learning ------------------------------------------------------------------------------------------

def _learn(overrides: list[str], steps: int, out: str) -> None:
    """One learning run (in its own process): its result and what it held, written to ``out``."""
    from heterorl.config import load_config, packaged
    from heterorl.loops.sync_rl import run_sync_rl
    from heterorl.policies import load_policy
    from heterorl.tasks import make_task_from
    from heterorl.training.session import TrainingClient
    from heterorl.transport.weights import pack_state_dict, wire_dtype_for

    torch.set_num_threads(2)
    run = [f"rl.steps={steps}", f"rl.eval_every={steps}", "task.options.eval_size=256", "logging.wandb_mode=disabled"]
    cfg = load_config(packaged("arith_rl.yaml"), [*run, *overrides])
    training = TrainingClient(*load_policy(cfg.rl.base), seed=cfg.seed, lora=cfg.lora)
    result = run_sync_rl(cfg, training, make_task_from(cfg.task))
    trainable = training.trainable_parameters()
    moments = sum(t.numel() * t.element_size() for s in training.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim())
    weights = sum(p.numel() * p.element_size() for p in training.model.parameters())
    form = "adapter" if training.lora is not None else "whole"
    _, state = training.save_weights_for_sampler(form).result()
    dtype = wire_dtype_for(cfg.runtime.weights_dtype, state)
    Path(out).write_text(json.dumps({
        "base": result.base_success, "final": result.final_success, "minutes": result.minutes,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable": sum(p.numel() for p in trainable),
        "state_mb": (weights + sum(p.numel() * 4 for p in trainable) + moments) / 1e6,
        "version_mb": pack_state_dict(state, 1, dtype=dtype).header.total_bytes / 1e6, "dtype": str(dtype)}))


def learning(steps: int) -> list[dict]:
    import multiprocessing

    rows = []
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-lora-") as folder:
        for name, overrides in LEARNING:  # each in a fresh process: its peak memory is its own
            out = str(Path(folder) / f"{len(rows)}.json")
            process = multiprocessing.get_context("spawn").Process(target=_learn, args=(overrides, steps, out))
            process.start()
            process.join()
            if process.exitcode != 0:
                raise HeteroRLError(f"the {name} run failed (exit code {process.exitcode}); its error is above")
            rows.append({"name": name, **json.loads(Path(out).read_text())})
    print(f"\n1. learning: {steps} steps of synchronous GRPO from arith-hash-sft-base (tiny), same seed")
    print(f"  {'':>18} | held-out before -> after | minutes | peak RSS | training state | trainable | version")
    for r in rows:
        print(f"  {r['name']:>18} | {r['base']:.3f} -> {r['final']:.3f}          | {r['minutes']:7.2f} | "
              f"{r['peak_rss_mb']:5.0f} MB | {r['state_mb']:9.1f} MB  | {r['trainable']:9,d} | "
              f"{r['version_mb']:.3f} MB ({r['dtype'].removeprefix('torch.')})")
    full, adapter = rows
    print(f"  LoRA / full: success gain {(adapter['final'] - adapter['base']):+.3f} vs "
          f"{(full['final'] - full['base']):+.3f}; training state {adapter['state_mb'] / full['state_mb']:.2f}x; "
          f"bytes per version {adapter['version_mb'] / full['version_mb']:.3f}x; "
          f"minutes {adapter['minutes'] / full['minutes']:.2f}x")
    return rows


# -- 2. weights on the wire -----------------------------------------------------------------------------------

def _batch(tokenizer, n: int = 8) -> list:
    from heterorl.training.session import Datum

    datums = []
    for i in range(n):
        a, b = 17 * i + 23, 31 * i + 45
        prompt = tokenizer.encode(f"What is {a} + {b}? Answer: ")
        completion = tokenizer.encode(f"#### {a + b}") + [tokenizer.eos_token_id]
        datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt)))
    return datums


class _Path:
    """One way of sending versions: a `LearnerServer`, a worker behind its link, and its model."""

    def __init__(self, name: str, bits_per_s: float, model, merger=None, deltas: bool = True) -> None:
        from heterorl.transport import LearnerServer, WorkerClient

        self.name, self.model, self.merger = name, model, merger
        self.link = MeteredLink(f"{name}/weights", bits_per_s / 8)
        config = TransportConfig(weights_deltas=deltas)
        self.server = LearnerServer("tcp://127.0.0.1:0", config, weights_delay=lambda _: self.link.schedule)
        self.client = WorkerClient(self.server.control_endpoint, name, config)
        self.client.wait_ready(TIMEOUT_S)
        self.seconds: list[float] = []

    def send(self, version: int, state: dict, dtype, adapter: dict | None, timeout_s: float) -> None:
        self.link.armed = version > 0
        start = time.perf_counter()
        self.server.publish(version, state, dtype=dtype,
                            describe=(lambda h: setattr(h, "adapter", adapter)) if adapter else None)
        got = self.client.wait_weights(version - 1, timeout_s)
        if got is None or got[0] != version:
            raise HeteroRLError(f"{self.name}: version {version} did not arrive within {timeout_s:.0f} s")
        received = got[1]
        if self.merger is not None:
            received = self.merger.merge(received, received.adapter)
        self.model.load_state_dict(received)
        if version:
            self.seconds.append(time.perf_counter() - start)
        self.client.set_version_held(version)

    def close(self) -> None:
        self.client.close()
        self.server.close()


def weights(model_name: str, rank: int, versions: int, bits_per_s: float) -> dict:
    """Merged bf16 versions against adapter-only float32 ones, for ``versions`` real steps of a rank-``rank``
    adapter."""
    from heterorl.policies import load_policy
    from heterorl.training import lora
    from heterorl.training.session import AdamParams, TrainingClient

    base, tokenizer = load_policy(model_name)
    worker_base = copy.deepcopy(base)
    training = TrainingClient(base, tokenizer, seed=0, lora=LoraConfig(rank=rank, alpha=2.0 * rank))
    datums = _batch(tokenizer)
    whole = _Path("whole", bits_per_s, copy.deepcopy(worker_base).to(BF16), deltas=False)
    merged = _Path("merged", bits_per_s, copy.deepcopy(worker_base).to(BF16))
    adapter = _Path("adapter", bits_per_s, copy.deepcopy(worker_base).to(BF16),
                    lora.Merger(worker_base.state_dict(), lora.base_hash(worker_base), BF16))
    whole_bf16 = sum(t.numel() * 2 for t in worker_base.state_dict().values())  # (tied tensors: an upper bound)
    timeout_s = TIMEOUT_S + 2 * whole_bf16 * 8 / bits_per_s
    del worker_base
    try:
        for version in range(versions + 1):
            if version:
                training.forward_backward(datums, loss_fn="cross_entropy").result()
                training.optim_step(AdamParams(learning_rate=1e-4)).result()
            _, state = training.save_weights_for_sampler().result()
            _, tensors = training.save_weights_for_sampler("adapter").result()  # (of the same weights)
            order = [(whole, state, BF16, None), (merged, state, BF16, None),
                     (adapter, tensors, torch.float32, training.adapter_meta)]
            for path, sent, dtype, meta in order if version % 2 == 0 else order[::-1]:
                path.send(version, sent, dtype, meta, timeout_s)
    finally:
        for path in (whole, merged, adapter):
            path.close()
    return {"rank": rank, **{f"{p.name}_mb": statistics.mean(p.link.charged) / 1e6 for p in (whole, merged, adapter)},
            **{f"{p.name}_s": statistics.median(p.seconds) for p in (whole, merged, adapter)}}


def print_weights(rows: list[dict], model_name: str, bits_per_s: float, versions: int) -> None:
    print(f"\n2. weights: {model_name}, {versions} versions (real steps, lr 1e-4) over {bits_per_s / 1e6:g} Mbit/s, "
          "publish -> applied, median")
    for r in rows:
        print(f"  rank {r['rank']:>3} | whole (bf16) {r['whole_mb']:7.2f} MB {r['whole_s']:6.2f} s | merged (bf16, "
              f"deltas) {r['merged_mb']:7.2f} MB {r['merged_s']:6.2f} s | adapter (fp32, deltas) "
              f"{r['adapter_mb']:6.2f} MB {r['adapter_s']:6.2f} s")
        print(f"  {'':>8} | whole / adapter: bytes {r['whole_mb'] / r['adapter_mb']:6.1f}x, time "
              f"{r['whole_s'] / r['adapter_s']:5.1f}x | merged / adapter: bytes "
              f"{r['merged_mb'] / r['adapter_mb']:5.1f}x, "
              f"time {r['merged_s'] / r['adapter_s']:5.1f}x")


# -- 3. sampling -------------------------------------------------------------------------------------------------

def sampling(model_name: str, rank: int, samples: int, rounds: int) -> dict:
    """samples/s with a trained adapter merged into the weights vs kept unmerged beside them (bf16)."""
    from heterorl.engines.base import SamplingParams
    from heterorl.policies import load_policy
    from heterorl.training import lora
    from heterorl.training.session import AdamParams, SamplingClient, TrainingClient

    base, tokenizer = load_policy(model_name)
    plain = copy.deepcopy(base)
    training = TrainingClient(base, tokenizer, seed=0, lora=LoraConfig(rank=rank, alpha=2.0 * rank))
    training.forward_backward(_batch(tokenizer), loss_fn="cross_entropy").result()
    training.optim_step(AdamParams(learning_rate=1e-3)).result()
    merged = training.frozen_copy().to(BF16)
    _, adapter = training.save_weights_for_sampler("adapter").result()
    unmerged = lora.inject(plain.to(BF16), training.lora)
    lora.load_adapter(unmerged, adapter)
    prompts = [tokenizer.encode(f"What is {11 * i} + {7 * i}?") for i in range(4)]
    params = SamplingParams(max_tokens=32, ignore_eos=True, seed=0)
    per_prompt = max(1, samples // len(prompts))
    samplers = {"merged": SamplingClient.for_model(merged, tokenizer),
                "unmerged": SamplingClient.for_model(unmerged, tokenizer)}
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(rounds):
        for name, sampler in samplers.items():
            start = time.perf_counter()
            sampler.sample(prompts, per_prompt, params).result()
            times[name].append(time.perf_counter() - start)
    n = per_prompt * len(prompts)
    return {"rank": rank, **{name: n / statistics.median(t) for name, t in times.items()}}


def print_sampling(rows: list[dict], model_name: str, rounds: int) -> None:
    print(f"\n3. sampling: {model_name} in bf16, 32 new tokens per completion, median of {rounds} alternating rounds")
    for r in rows:
        print(f"  rank {r['rank']:>3} | merged {r['merged']:6.2f} samples/s | unmerged {r['unmerged']:6.2f} "
              f"samples/s | merged / unmerged {r['merged'] / r['unmerged']:4.2f}x")


def _ranks(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="the policy of parts 2 and 3 (default smollm2)")
    parser.add_argument("--ranks", type=_ranks, default=[8, 32], help="adapter ranks of parts 2 and 3 (default 8,32)")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="the weights link in bits/s (default 100e6)")
    parser.add_argument("--versions", type=int, default=3, help="timed versions per rank in part 2 (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps of each learning run (default 40)")
    parser.add_argument("--samples", type=int, default=16, help="completions per sampling round (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="sampling rounds per way (default 3)")
    parser.add_argument("--skip", action="append", default=[], choices=["learning", "weights", "sampling"],
                        help="leave a part out (repeatable)")
    args = parser.parse_args(argv)
    if min(args.versions, args.steps, args.samples, args.rounds) < 1:
        parser.error("--versions, --steps, --samples and --rounds must be >= 1")
    if "learning" not in args.skip:
        learning(args.steps)
    if "weights" not in args.skip:
        print_weights([weights(args.model, r, args.versions, args.bandwidth) for r in args.ranks], args.model,
                      args.bandwidth, args.versions)
    if "sampling" not in args.skip:
        print_sampling([sampling(args.model, r, args.samples, args.rounds) for r in args.ranks], args.model,
                       args.rounds)
    return 0


__all__ = ["learning", "main", "sampling", "weights"]
