"""Multi-turn episodes through the whole system: a learner and rollout workers as real processes over ZeroMQ,
taking weights between turns; and the same task in the simulated execution."""

import json

import pytest
import yaml

from heterorl.runs import read_metrics
from tests.conftest import run_cli


def _run(run_dir, steps: int, **sections) -> str:
    run = {
        "seed": 0,
        "task": {"name": "maze_walk", "options": {"size": 4, "eval_size": 8}},
        "policy": {"model": "tiny", "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2,
                                             "intermediate_size": 64}},
        "rollout": {"group_size": 4, "max_tokens": 3, "max_turns": 5},
        "loss": {"name": "gepo"},
        "rl": {"steps": steps, "prompts_per_step": 4, "eval_every": steps},
        "runtime": {"workers": 2, "groups_per_call": 2},
        "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled", "progress": False},
    }
    for name, values in sections.items():
        run[name] = {**run.get(name, {}), **values}
    return yaml.safe_dump(run, sort_keys=False)


def _check(run_dir, steps: int) -> dict:
    """What holds whatever the arrival order: every step trained episodes of several turns, their environments
    ended every one of them (counted), and every rollout generated is accounted for."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        assert 1 < record["rollout/turns_mean"] <= 5 and 0 < record["rollout/env_tokens_frac"] < 1
        assert 0 <= record["staleness/episode_versions_mean"] and 0 <= record["staleness/episode_versions_span_mean"]
    outcomes = summary["reward_outcomes"]
    assert outcomes and all(name.startswith("episode:") for name in outcomes), outcomes
    assert set(outcomes) <= {"episode:done", "episode:max_turns", "episode:budget"}, outcomes
    rollouts = summary["rollouts"]
    assert rollouts["trained"] > 0, rollouts
    assert rollouts["generated"] == rollouts["trained"] + rollouts["left_over"] + sum(rollouts["discarded"].values())
    return summary


@pytest.mark.slow
def test_a_live_async_run_trains_episodes_whose_turns_take_newer_weights(tmp_path):
    (tmp_path / "run.yaml").write_text(_run(tmp_path / "run", 3, runtime={"inflight_updates": True}))
    out = run_cli("train", "--config", str(tmp_path / "run.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr
    _check(tmp_path / "run", 3)
    assert "reward outcomes:" in out.stdout and "episode:" in out.stdout


def test_the_simulated_execution_trains_episodes_with_the_same_accounting(tmp_path):
    (tmp_path / "run.yaml").write_text(_run(tmp_path / "run", 2, runtime={"execution": "simulated"}))
    out = run_cli("train", "--config", str(tmp_path / "run.yaml"))
    assert out.returncode == 0, out.stdout + out.stderr
    _check(tmp_path / "run", 2)
