"""A minibatch the loss refuses on one learner rank only is skipped on every rank: no rank waits forever in the
gradient all-reduce, both report the skip, and the weights stay the same on every rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from heterorl.config import load_config
from heterorl.policies import TinyModelConfig, build_tiny_policy
from heterorl.training.session import TrainingClient
from heterorl.training.step import BAD_BATCH, SkippedUpdate, optimize_batch
from tests.runtime.test_ddp import ALPHABET, OVERRIDES, batches

TIMEOUT_S = 600  # both ranks finish in seconds (minutes on a busy machine); one left in the all-reduce waits 30 min
POISONED_GROUP = 1  # with 2 ranks, groups 1 and 3 are rank 1's share of the minibatch: rank 0 sees none of it


def _client() -> TrainingClient:
    model, tokenizer = build_tiny_policy(ALPHABET, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                                   num_kv_heads=2, intermediate_size=64, seed=3))
    return TrainingClient(model, tokenizer, seed=0, data_parallel=True)


def _poisoned_then_clean(vocab: int):
    """Two batches: in the first, one group's behaviour log-probs make the loss not finite; the second is clean."""
    poisoned, clean = batches(vocab, steps=2)
    for d in poisoned:
        if d.group_id == POISONED_GROUP:
            d.behaviour_logprobs = [-1e30] * d.completion_len
    return poisoned, clean


def _weights(training: TrainingClient) -> dict:
    return {k: v.detach().clone() for k, v in training.model.state_dict().items()}


def _rank_main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks meet in a file (no port to pick: gloo binds its own free ones)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        # the poisoned minibatch is the only one; the bound on a group's log-ratio off, so that the loss refuses it
        cfg = load_config(None, OVERRIDES + ["rl.updates_per_batch=1", "rl.max_log_ratio=null"])
        training = _client()
        poisoned, clean = _poisoned_then_clean(len(training.tokenizer))
        before = _weights(training)
        skipped: list[SkippedUpdate] = []
        refused = optimize_batch(training, poisoned, cfg, total_updates=2, shard=(rank, world), skipped=skipped)
        after_refused = _weights(training)
        trained = optimize_batch(training, clean, cfg, total_updates=2, shard=(rank, world))
        torch.save({"before": before, "after_refused": after_refused, "after_trained": _weights(training),
                    "refused": refused, "trained": trained, "skipped": [(s.rows, s.reason) for s in skipped]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_minibatch_refused_on_one_rank_is_skipped_on_every_rank(tmp_path):
    ranks = mp.start_processes(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s: one waits in an all-reduce the other "
                            "skipped")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for out in (rank0, rank1):
        assert out["refused"] == {"optim/updates": 0, "optim/bad_batches": 1, "optim/skip_reason": BAD_BATCH}
        [(rows, _)] = out["skipped"]
        assert rows == list(range(16))  # the whole minibatch, not the rank's share
        assert all(torch.equal(out["after_refused"][k], v) for k, v in out["before"].items())  # no update ran
        assert out["trained"]["optim/updates"] == 1  # DDP trains on after a forward that had no backward
    assert "not finite" in rank1["skipped"][0][1]  # the rank that refused says why ...
    assert "rank(s) [1] refused" in rank0["skipped"][0][1]  # ... the other names it
    moved = max((rank0["after_trained"][k] - v).abs().max().item() for k, v in rank0["before"].items())
    assert moved > 1e-4
    for k, v in rank0["after_trained"].items():
        torch.testing.assert_close(rank1["after_trained"][k], v, atol=0, rtol=0)  # the ranks stay identical


def test_one_rank_skips_without_any_collective(monkeypatch):
    """World size 1: a refused minibatch is skipped without touching torch.distributed."""
    def no_collective(*args, **kwargs):
        raise AssertionError("a single process ran a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    training = _client()
    poisoned, _ = _poisoned_then_clean(len(training.tokenizer))
    cfg = load_config(None, OVERRIDES + ["rl.updates_per_batch=1", "rl.max_log_ratio=null"])
    before = _weights(training)
    skipped: list[SkippedUpdate] = []
    metrics = optimize_batch(training, poisoned, cfg, total_updates=1, skipped=skipped)
    assert metrics == {"optim/updates": 0, "optim/bad_batches": 1, "optim/skip_reason": BAD_BATCH}
    assert [s.rows for s in skipped] == [list(range(16))] and "not finite" in skipped[0].reason
    assert all(torch.equal(_weights(training)[k], v) for k, v in before.items())
