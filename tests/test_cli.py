"""The command line, run as real processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from heterorl.metrics import read_metrics
from heterorl.policies import load_policy

ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}


def heterorl(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "heterorl.cli", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=600)


def test_help_names_every_command():
    out = heterorl("--help")
    assert out.returncode == 0
    for command in ("demo", "sft", "rl", "bench", "keys"):
        assert command in out.stdout


def test_dry_run_prints_the_resolved_config():
    out = heterorl("demo", "--dry-run", "loss.name=grpo", "rollout.temperature=0.7")
    assert out.returncode == 0, out.stderr
    assert "name: grpo" in out.stdout and "temperature: 0.7" in out.stdout
    assert "maze" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["rl", "rl.stepz=3"], "`rl.stepz`"),
    (["sft", "sft.steps=x"], "`sft.steps`"),
    (["sft", "--config", "/nonexistent.yaml"], "does not exist"),
    (["rl", "task.name=chess", "rl.steps=1"], "chess"),
    (["rl", "loss.name=nope", "rl.steps=1", "rl.base=maze-sft-base", "logging.wandb_mode=disabled"], "nope"),
    (["rl", "rl.base=/nonexistent/policy", "logging.wandb_mode=disabled"], "/nonexistent/policy"),
])
def test_bad_input_exits_2_with_a_message(args, message, tmp_path):
    out = heterorl(*args, f"logging.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr


def test_sft_end_to_end_writes_policy_logs_and_wandb(tmp_path):
    policy = tmp_path / "policy"
    out = heterorl("sft", "sft.steps=12", "sft.eval_every=6", "sft.batch_size=16", "task.options.size=3",
                   "task.options.eval_size=32", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1",
                   "policy.tiny.intermediate_size=64", f"sft.output={policy}",
                   f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false")
    assert out.returncode == 0, out.stderr
    assert "held-out greedy success" in out.stdout
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[0]["sft/loss"] > records[-1]["sft/loss"]
    assert [r["step"] for r in records if "eval/success" in r] == [6, 12]
    summary = json.loads((policy / "sft_summary.json").read_text())
    assert summary["steps"] == 12 and summary["config"]["sft"]["steps"] == 12
    model, tokenizer = load_policy(str(policy))
    assert tokenizer.decode(tokenizer("S.#\n>")["input_ids"]) == "S.#\n>"
    # wandb ran for real, offline, inside the run directory
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_bench_engine_prints_a_ratio():
    out = heterorl("bench", "engine", "--batch", "8", "--group-size", "4", "--max-tokens", "4", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio (ours / generate)")[1:]]
    assert len(ratios) == 2 and min(ratios) > 0  # distinct prompts, then groups
    assert "2 prompts x 4 samples" in out.stdout
    packed = float(out.stdout.split("ratio (packed / per row)")[1].split("x")[0])
    assert packed > 0


def test_bench_losses_times_every_loss_against_grpo():
    out = heterorl("bench", "losses", "--batch", "16", "--length", "32", "--repeats", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert {"gepo", "gepo_defensive", "gspo", "tis", "m2po", "decoupled_ppo"} <= set(rows)
    assert rows["grpo"][-1] == "1.00x" and float(rows["gepo"][-1].rstrip("x")) > 0


def test_bench_transport_measures_both_channels_against_raw_pyzmq():
    out = heterorl("bench", "transport", "--trajectories", "400", "--workers", "1,2", "--prompt-tokens", "64",
                   "--completion-tokens", "256", "--weights-mib", "8", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    ratios = [float(part.split("x")[0]) for part in out.stdout.split("ratio ")[1:]]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)  # 1 worker, 2 workers, weights
    assert "trajectories, 2 workers" in out.stdout and "receiver peak RSS" in out.stdout


def test_bench_async_runs_both_modes_and_prints_ratio_and_bound():
    out = heterorl("bench", "async", "--steps", "4", "--prompts", "4", "--group-size", "4")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("  sync ", "  async "))}
    assert set(rows) == {"sync", "async"} and all(float(r[1]) > 0 for r in rows.values())
    assert float(rows["sync"][-1]) == 0.0  # sync trains on-policy only
    ratio = float(out.stdout.split("async / sync:")[1].split("x")[0])
    bound = float(out.stdout.split("overlap bound of this workload:")[1].split("x")[0])
    assert ratio > 0 and 1.0 <= bound <= 2.0


def test_keys_makes_a_curve_pair_and_never_overwrites_one(tmp_path):
    import zmq.auth

    out = heterorl("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    public, secret = zmq.auth.load_certificate(str(tmp_path / "worker-7.key_secret"))
    assert len(public) == len(secret) == 40  # Z85 of 32-byte keys
    assert zmq.auth.load_certificate(str(tmp_path / "worker-7.key"))[1] is None  # the public file holds no secret
    assert (tmp_path / "worker-7.key_secret").stat().st_mode & 0o077 == 0
    again = heterorl("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert again.returncode == 2 and "exists" in again.stderr
