"""``heterorl bench engine``: sampling tokens/s of the torch engine vs transformers ``generate``.

Both run the same model, prompts, batch, sampling settings and seed, in one
process, alternating, best of ``--repeats``. EOS is ignored by both, so every
sample is exactly ``--max-tokens`` long and both do the same amount of work.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench engine", description=__doc__)
    parser.add_argument("--policy", default="maze-sft-base", help="maze-sft-base (shipped), smollm2, or a folder")
    parser.add_argument("--batch", type=int, default=256, help="sequences per generate call")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from heterorl.engines import SamplingParams, TorchEngine
    from heterorl.tasks import make_task
    from heterorl.cli import quiet_transformers
    from heterorl.textcodec import encode

    quiet_transformers()
    from heterorl.policies import load_policy

    model, tokenizer = load_policy(args.policy)  # "maze-sft-base" (shipped), "smollm2" or a folder
    task = make_task("maze")
    rng = random.Random(0)
    prompts = [encode(tokenizer, task.sample_train(rng).prompt) for _ in range(args.batch)]
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    input_ids = torch.tensor(prompts)  # maze prompts of one size share a length: no padding needed

    def ours() -> int:
        groups = engine.generate(prompts, params)
        return sum(len(s.tokens) for g in groups for s in g)

    @torch.inference_mode()
    def hf() -> int:
        torch.manual_seed(0)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                             temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                             min_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    rates = {"heterorl TorchEngine": [], "transformers generate": []}
    ours(), hf()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("heterorl TorchEngine", ours), ("transformers generate", hf)):
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    best = {name: max(r) for name, r in rates.items()}
    print(f"policy={args.policy} batch={args.batch} max_tokens={args.max_tokens} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (best of)")
    for name, rate in best.items():
        print(f"  {name:24s} {rate:10.0f} tokens/s")
    print(f"  ratio (ours / generate)  {best['heterorl TorchEngine'] / best['transformers generate']:10.2f}x")
    return 0
