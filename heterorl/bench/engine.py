"""``heterorl bench engine``: sampling tokens/s of the torch engine vs transformers ``generate`` (and vLLM).

Both run the same model, prompts, batch, sampling settings and seed, in one
process, alternating, best of ``--repeats``. EOS is ignored by both, so every
sample is exactly ``--max-tokens`` long and both do the same amount of work.
Measured twice: ``--batch`` distinct prompts, then the same number of rows as
groups (``--batch / --group-size`` prompts × ``--group-size`` samples, as RL
draws them; ``generate`` gets ``num_return_sequences``). Last, the training
forward + backward of that grouped batch (GRPO on random rewards): each group
packed behind one copy of its prompt vs one row per sequence. With ``--engine vllm`` (run from a Python that
has vLLM, e.g. ``.venv-vllm/bin/heterorl``) vLLM samples the same prompts with the same settings, in float32
like the others unless ``--vllm-dtype`` says otherwise and on as many cores as torch's threads, and its ratio to
the torch engine is printed too. With ``--episodes``, multi-turn rollouts instead (`_bench_episodes`): the torch
engine reusing each context's earlier turns vs prefilling every context whole. With ``--stream`` (vLLM),
heterorl/bench/stream.py: a vLLM worker's batch loop against streaming, with and without in-flight updates.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--stream" in argv:  # a bench of its own (heterorl/bench/stream.py): batch vs streaming on vLLM
        from heterorl.bench.stream import main as stream

        return stream([a for a in argv if a != "--stream"])
    parser = argparse.ArgumentParser(prog="heterorl bench engine", description=__doc__)
    parser.add_argument("--policy", default="maze-sft-base", help="maze-sft-base (shipped), smollm2, or a folder")
    parser.add_argument("--batch", type=int, default=256, help="sequences per generate call")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt in the grouped measurement")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                        help="vllm: add vLLM to the sampling comparisons (needs vLLM: `make vllm`)")
    parser.add_argument("--no-training", action="store_true", help="measure sampling only")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the dtype vLLM runs in (the torch engine and generate stay in the policy's: float32)")
    parser.add_argument("--episodes", action="store_true",
                        help="measure multi-turn rollouts instead (maze_walk): prefix reuse vs whole prefills")
    parser.add_argument("--stream", action="store_true",
                        help="with --engine vllm: batch vs streaming vs streaming with in-flight updates on a "
                             "long-tailed workload (`--stream --help` for its options)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.episodes:
        return _bench_episodes(args.repeats)

    from heterorl.engines import SamplingParams, TorchEngine
    from heterorl.policies import quiet_transformers
    from heterorl.rollout.textcodec import encode_prompt
    from heterorl.tasks import make_task

    quiet_transformers()
    from heterorl.policies import load_policy

    model, tokenizer = load_policy(args.policy)  # "maze-sft-base" (shipped), "smollm2" or a folder
    task = make_task("maze")
    rng = random.Random(0)
    prompts = [encode_prompt(tokenizer, task.sample_train(rng).prompt) for _ in range(args.batch)]
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    input_ids, attention_mask = _left_padded(prompts, tokenizer.pad_token_id)

    def ours() -> int:
        groups = engine.generate(prompts, params)
        return sum(len(s.tokens) for g in groups for s in g)

    @torch.inference_mode()
    def hf() -> int:
        torch.manual_seed(0)
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=True,
                             temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                             min_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id)
        return (out.shape[1] - input_ids.shape[1]) * out.shape[0]

    grouped = prompts[: max(1, args.batch // args.group_size)]

    def ours_grouped() -> int:
        groups = engine.generate(grouped, params, num_samples=args.group_size)
        return sum(len(s.tokens) for g in groups for s in g)

    @torch.inference_mode()
    def hf_grouped() -> int:
        torch.manual_seed(0)
        ids, mask = _left_padded(grouped, tokenizer.pad_token_id)
        out = model.generate(ids, attention_mask=mask, do_sample=True,
                             temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                             min_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id,
                             num_return_sequences=args.group_size)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    runs = [(f"{args.batch} distinct prompts", {"heterorl TorchEngine": ours, "transformers generate": hf}),
            (f"{len(grouped)} prompts x {args.group_size} samples",
             {"heterorl TorchEngine": ours_grouped, "transformers generate": hf_grouped})]
    vllm = None
    if args.engine == "vllm":
        from heterorl.engines.vllm_engine import VLLMEngine
        from heterorl.policies import policy_folder

        vllm = VLLMEngine(policy_folder(args.policy), eos_token_id=tokenizer.eos_token_id, dtype=args.vllm_dtype,
                          max_num_seqs=max(args.batch, 1), cpu_threads=torch.get_num_threads())
        runs[0][1]["vLLM"] = lambda: sum(len(s.tokens) for g in vllm.generate(prompts, params) for s in g)
        runs[1][1]["vLLM"] = lambda: sum(len(s.tokens) for g in vllm.generate(grouped, params, args.group_size)
                                         for s in g)
    print(f"policy={args.policy} max_tokens={args.max_tokens} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} (best of)" + (f" vllm_dtype={args.vllm_dtype}" if vllm is not None else ""))
    try:
        for title, fns in runs:
            best = _best_rates(fns, args.repeats)
            print(f"sampling, {title}:")
            for name, rate in best.items():
                print(f"  {name:24s} {rate:10.0f} tokens/s")
            print(f"  ratio (ours / generate)  {best['heterorl TorchEngine'] / best['transformers generate']:10.2f}x")
            if "vLLM" in best:
                print(f"  ratio (vLLM / ours)      {best['vLLM'] / best['heterorl TorchEngine']:10.2f}x")
                print(f"  ratio (vLLM / generate)  {best['vLLM'] / best['transformers generate']:10.2f}x")
    finally:
        if vllm is not None:
            vllm.close()
    if not args.no_training:
        _bench_training(model, tokenizer, engine, grouped, args)
    return 0


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as ``generate`` takes a batch of them: padded on the left, with the attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _best_rates(fns: dict, repeats: int) -> dict[str, float]:
    """Best tokens/s of each ``fn() -> tokens`` over ``repeats`` alternating rounds, after one warm-up each."""
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: max(r) for name, r in rates.items()}


def _bench_training(model, tokenizer, engine, prompts: list, args) -> None:
    """forward_backward of one grouped rollout batch, packed behind shared prompts vs one row per datum."""
    import copy

    from heterorl.engines import SamplingParams
    from heterorl.training.session import Datum, TrainingClient

    rng = random.Random(1)
    groups = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                     seed=1), num_samples=args.group_size)
    datums = [Datum(tokens=p + s.tokens, prompt_len=len(p), reward=float(rng.random() < 0.5), group_id=g,
                    behaviour_logprobs=s.logprobs) for g, (p, group) in enumerate(zip(prompts, groups)) for s in group]
    tokens = sum(len(d.tokens) for d in datums)
    clients = {"packed (shared prompts)": TrainingClient(copy.deepcopy(model), tokenizer, share_prompts=True),
               "one row per datum": TrainingClient(copy.deepcopy(model), tokenizer, share_prompts=False)}

    def step(client):
        def run() -> int:
            client.forward_backward(datums, "grpo").result()  # gradients accumulate: harmless here
            return tokens
        return run

    best = _best_rates({name: step(c) for name, c in clients.items()}, args.repeats)
    print(f"training forward+backward, {len(datums)} sequences ({tokens} tokens, "
          f"mean completion {sum(d.completion_len for d in datums) / len(datums):.1f}):")
    for name, rate in best.items():
        print(f"  {name:24s} {rate:10.0f} sequence tokens/s")
    print(f"  ratio (packed / per row) {best['packed (shared prompts)'] / best['one row per datum']:10.2f}x")


def _bench_episodes(repeats: int) -> int:
    """Multi-turn rollouts as heterorl/configs/maze_walk_rl.yaml draws them (32 mazes x 8 episodes from the shipped
    maze-walk-sft-base, one move a turn): the torch engine reusing each context's earlier turns vs prefilling
    every context whole, ``repeats`` runs each, alternating, same problems and seed; each run's seconds and the
    token-positions its forwards prefilled (padding included) and decoded."""
    import copy

    from heterorl.config import load_config, packaged
    from heterorl.engines import SamplingParams
    from heterorl.policies import load_policy, quiet_transformers
    from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
    from heterorl.tasks import make_task_from
    from heterorl.training.session import SamplingClient

    quiet_transformers()
    cfg = load_config(packaged("maze_walk_rl.yaml"))
    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(cfg.rl.base)
    rng = random.Random(0)
    problems = [task.sample_train(rng) for _ in range(cfg.rl.prompts_per_step)]
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature, seed=0)
    samplers, counts = {}, {}
    for name in ("reuse", "whole"):
        samplers[name] = SamplingClient.for_model(copy.deepcopy(model), tokenizer)
        samplers[name].engine.supports_prefix_reuse = name == "reuse"  # the episode runner asks for reuse if so
        counts[name] = {"prefilled": 0, "decoded": 0}

        def count(module, args, kwargs, tally=counts[name]) -> None:
            ids = kwargs["input_ids"]
            tally["prefilled" if ids.shape[1] > 1 else "decoded"] += ids.numel()

        samplers[name].engine.model.register_forward_pre_hook(count, with_kwargs=True)
    limits = EpisodeLimits.of(cfg.rollout, samplers["reuse"].engine.max_positions)
    print(f"multi-turn rollouts: {cfg.task.name}, {len(problems)} problems x {cfg.rollout.group_size} episodes "
          f"({cfg.rl.base}), threads={torch.get_num_threads()}")
    episodes, seconds_of = {}, {"reuse": [], "whole": []}
    for run in range(1, repeats + 1):
        for name, sampler in samplers.items():
            sampler.engine.prefixes.clear()  # (the same problems again: no run reuses another's contexts)
            counts[name].update(prefilled=0, decoded=0)
            start = time.perf_counter()
            _, groups = rollout_groups(sampler, task, problems, cfg.rollout.group_size, params, limits=limits)
            seconds = time.perf_counter() - start
            episodes[name] = [s for g in groups for s in g]
            seconds_of[name].append(seconds)
            print(f"  {name}  run {run}  {seconds:6.2f} s   prefilled {counts[name]['prefilled']:7,d} "
                  f"token-positions, decoded {counts[name]['decoded']:6,d}")
    same = [(a, b) for a, b in zip(episodes["reuse"], episodes["whole"]) if a.tokens == b.tokens]
    worst = max((abs(x - y) for a, b in same for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    print(f"  episodes with the same tokens both ways: {len(same)}/{len(episodes['reuse'])}, "
          f"max |delta log p| {worst:.1e}")
    print(f"  ratio (reuse / whole): {sum(seconds_of['reuse']) / sum(seconds_of['whole']):.2f}x the time, "
          f"{counts['reuse']['prefilled'] / max(counts['whole']['prefilled'], 1):.2f}x the prefilled tokens")
    return 0
