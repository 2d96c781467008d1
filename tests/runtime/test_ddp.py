"""Learner data parallelism: 2 ranks (gloo, CPU) end with the same weights as 1 rank on the same batches, the whole
model's or a LoRA adapter's."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from heterorl.config import LoraConfig, load_config
from heterorl.policies import TinyModelConfig, build_tiny_policy
from heterorl.training.session import Datum, TrainingClient
from heterorl.training.step import optimize_batch

ALPHABET = "abcdefgh"
OVERRIDES = ["loss.name=gepo", "rl.prompts_per_step=4", "rl.updates_per_batch=2", "optim.lr=1e-3",
             "optim.grad_clip_norm=1.0"]


def batches(vocab: int, steps: int = 3, groups: int = 4, group_size: int = 4) -> list[list[Datum]]:
    """Fixed random batches of whole groups: tokens, behaviour log-probs and 0/1 rewards."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        datums = []
        for gid in range(groups):
            prompt = torch.randint(2, vocab, (5,), generator=g).tolist()
            for _ in range(group_size):
                n = int(torch.randint(2, 7, (1,), generator=g))
                completion = torch.randint(2, vocab, (n,), generator=g).tolist()
                datums.append(Datum(tokens=prompt + completion, prompt_len=5,
                                    reward=float(torch.randint(0, 2, (1,), generator=g)), group_id=gid,
                                    behaviour_logprobs=(-torch.rand(n, generator=g) * 3).tolist(),
                                    policy_versions=[0] * n))
        out.append(datums)
    return out


LORA = LoraConfig(rank=4, alpha=8.0)


def train(rank: int, world: int, lora: bool = False) -> dict:
    """The trained weights: the whole state dict, or (``lora``) the adapter's tensors."""
    cfg = load_config(None, [*OVERRIDES, *(["optim.lr=1e-2"] if lora else [])])
    model, tokenizer = build_tiny_policy(ALPHABET, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                                   num_kv_heads=2, intermediate_size=64, seed=3))
    training = TrainingClient(model, tokenizer, seed=0, data_parallel=True, lora=LORA if lora else None)
    for datums in batches(len(tokenizer)):
        optimize_batch(training, datums, cfg, total_updates=6, shard=(rank, world))
    if lora:
        return training.save_weights_for_sampler("adapter").result()[1]
    return {k: v.detach().clone() for k, v in training.model.state_dict().items()}


def _rank_main(rank: int, world: int, rendezvous: str, out_path: str, lora: bool) -> None:
    """One rank; the ranks meet in the file ``rendezvous`` (no port to pick: gloo binds its own free ones)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        state = train(rank, world, lora)
        if rank == 0:
            torch.save(state, out_path)
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_rank(tmp_path):
    single = train(0, 1)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "rendezvous"), str(out), False), nprocs=2, join=True)
    double = torch.load(out)
    base = {k: v for k, v in build_tiny_policy(ALPHABET, TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, seed=3))[0]
        .state_dict().items()}
    moved = max((single[k] - base[k]).abs().max().item() for k in single)
    diff = max((single[k] - double[k]).abs().max().item() for k in single)
    assert moved > 1e-3  # training changed the weights ...
    assert diff < 1e-5, diff  # ... and two ranks changed them exactly as one did


def test_two_ranks_train_a_lora_adapter_as_one_rank_does(tmp_path):
    single = train(0, 1, lora=True)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "rendezvous"), str(out), True), nprocs=2, join=True)
    double = torch.load(out)
    assert set(single) == set(double) and all(".lora_" in name for name in single)
    moved = max(single[k].abs().max().item() for k in single if ".lora_B" in k)  # B starts at 0
    diff = max((single[k] - double[k]).abs().max().item() for k in single)
    assert moved > 1e-3  # the adapter trained ...
    assert diff < 1e-5, diff  # ... and two ranks trained it exactly as one did


def test_too_many_ranks_for_the_batch_is_a_clear_error():
    from heterorl.errors import HeteroRLError
    from heterorl.runtime.learner import Learner, Ranks

    class FakeRanks(Ranks):
        def __init__(self):
            self.rank, self.world = 0, 8

    cfg = load_config(None, OVERRIDES)
    import heterorl.runtime.learner as learner_module

    original = learner_module.Ranks
    learner_module.Ranks = FakeRanks
    try:
        with pytest.raises(HeteroRLError, match="8 learner ranks"):
            Learner(cfg, None, None, None, "/tmp/unused")
    finally:
        learner_module.Ranks = original
