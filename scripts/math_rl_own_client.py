"""The step of tinker-cookbook's `math_rl` recipe (`env=arithmetic`) written over heterorl's own client, to time the
recipe's run through Tinker's SDK against (docs/SERVICE.md, "From Tinker"). It uses the same model
(SmolLM2-135M-Instruct, LoRA rank 8), the same prompts (the cookbook's role_colon renderer and one-shot prefix),
the same batch (8 problems × 4 samples, 8 new tokens, temperature 1), the same reward (correct + 0.1 × (format −
1)) and advantages (reward − group mean), and Adam at the same settings. It goes against a `heterorl serve`
process on this machine.

heterorl's datums share each group's prompt (the trainer packs a group behind one copy of its prompt), where Tinker's
score every position. heterorl's `importance_sampling` is a token mean where Tinker's is a sum; under Adam the
step is nearly the same. heterorl's sampler has no stop strings, so every sample runs to 8 tokens and is graded
up to its stop string.

    python scripts/math_rl_own_client.py --steps 16 --lr 1e-3
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--groups", type=int, default=8, help="problems per step (the recipe's groups_per_batch)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv

    from heterorl.bench.service import start_service
    from heterorl.engines import SamplingParams
    from heterorl.service.client import connect
    from heterorl.training.session import AdamParams, Datum

    process, url = start_service()
    try:
        service = connect(url)
        training = service.create_lora_training_client("smollm2", rank=8, seed=0)
        tokenizer = training.tokenizer
        renderer = renderers.get_renderer("role_colon", tokenizer)
        prefix, stop = ArithmeticEnv.standard_fewshot_prefix(), "\n\nUser:"
        rng = random.Random(0)
        sampler = training.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        adam = AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=None)
        timings = []
        for step in range(args.steps):
            started = time.perf_counter()
            problems = [(rng.randint(0, 100), rng.randint(0, 100)) for _ in range(args.groups)]
            prompts = [renderer.build_generation_prompt([*prefix, {"role": "user", "content": f"What is {x} + {y}?"}])
                       .to_ints() for x, y in problems]
            groups = sampler.sample(prompts, args.group_size, params).result()
            sampled = time.perf_counter()
            datums, rewards = [], []
            for (x, y), prompt, group in zip(problems, prompts, groups):
                scores = []
                for sample in group:
                    text = tokenizer.decode(sample.tokens, skip_special_tokens=True)
                    answer, stopped = text.split(stop)[0], stop in text
                    numbers = re.findall(r"-?\d+", answer.replace(",", ""))
                    scores.append(float(bool(numbers) and int(numbers[-1]) == x + y) + 0.1 * (float(stopped) - 1))
                mean = sum(scores) / len(scores)
                datums += [Datum(tokens=prompt + s.tokens, prompt_len=len(prompt), advantage=r - mean,
                                 behaviour_logprobs=s.logprobs) for s, r in zip(group, scores)]
                rewards += scores
            training.forward_backward(datums, loss_fn="importance_sampling").result()
            training.optim_step(adam).result()
            sampler = training.save_weights_and_get_sampling_client()
            done = time.perf_counter()
            timings.append((sampled - started, done - sampled, done - started))
            print(f"step {step}: reward {sum(rewards) / len(rewards):.3f}  sample {sampled - started:.1f} s  "
                  f"train {done - sampled:.1f} s  total {done - started:.1f} s", flush=True)
        sample, train, total = (statistics.mean(t[i] for t in timings) for i in range(3))
        print(f"mean per step: sample {sample:.1f} s, train {train:.1f} s, total {total:.1f} s")
        service.close()
    finally:
        process.terminate()
        process.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
