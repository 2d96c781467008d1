"""The SFT base and RL from it: measured success with fixed seeds."""

import json

import pytest

from heterorl.cli import SFT_BASE, packaged
from heterorl.config import load_config
from heterorl.evaluation import evaluate
from heterorl.metrics import read_metrics
from heterorl.policies import load_policy
from heterorl.session import TrainingClient
from heterorl.sft import run_sft
from heterorl.sync_rl import minibatches, run_sync_rl
from heterorl.session import Datum
from heterorl.tasks import make_task


def _maze(cfg):
    return make_task(cfg.task.name, dict(cfg.task.options))


def test_shipped_base_is_deliberately_partial():
    cfg = load_config(packaged("maze_sft.yaml"))
    model, tok = load_policy(str(packaged(SFT_BASE)))
    sampler = TrainingClient(model, tok).save_weights_and_get_sampling_client()
    task = _maze(cfg)
    success = evaluate(sampler, task, task.eval_problems(), cfg.rollout.max_tokens).success
    assert 0.35 <= success <= 0.60
    recorded = json.loads((packaged(SFT_BASE) / "sft_summary.json").read_text())
    assert success == pytest.approx(recorded["success"], abs=0.02)


@pytest.mark.slow
def test_short_remake_of_the_base_follows_the_recorded_curve():
    cfg = load_config(packaged("maze_sft.yaml"), ["sft.steps=60", "sft.eval_every=1000"])
    task = _maze(cfg)
    model, tok = load_policy("tiny", alphabet=task.alphabet(), tiny=cfg.policy.tiny)
    losses = {}
    run_sft(cfg, TrainingClient(model, tok, seed=cfg.seed), task, progress=lambda s, m: losses.update({s: m["sft/loss"]}))
    recorded = {r["step"]: r["sft/loss"] for r in read_metrics(packaged(SFT_BASE) / "sft_metrics.jsonl")}
    for step in (1, 10, 30, 60):
        assert losses[step] == pytest.approx(recorded[step], rel=0.02), step
    assert losses[60] < 0.6 * losses[1]


@pytest.mark.slow
def test_short_rl_run_improves_held_out_success():
    cfg = load_config(packaged("maze_rl.yaml"), ["rl.steps=20", "rl.eval_every=10", "logging.wandb_mode=disabled"])
    task = _maze(cfg)
    model, tok = load_policy(str(packaged(SFT_BASE)))
    result = run_sync_rl(cfg, TrainingClient(model, tok, seed=cfg.seed), task)
    assert result.final_success >= result.base_success + 0.03, result.history


def test_minibatches_keep_groups_whole():
    datums = [Datum(tokens=[1, 2], prompt_len=1, group_id=g) for g in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4)]
    batches = minibatches(datums, 2)
    assert [[d.group_id for d in b] for b in batches] == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4]]
    assert sum(len(b) for b in minibatches(datums, 7)) == 10
