"""The command line, run as real processes."""

import json

import pytest

from heterorl.policies import load_policy
from heterorl.runs import read_metrics
from tests.conftest import run_cli


def test_help_names_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("demo", "sft", "rl", "bench", "keys"):
        assert command in out.stdout


def test_dry_run_prints_the_resolved_config():
    out = run_cli("demo", "--dry-run", "loss.name=grpo", "rollout.temperature=0.7")
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
    out = run_cli(*args, f"logging.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr


def test_sft_end_to_end_writes_policy_logs_and_wandb(tmp_path):
    policy = tmp_path / "policy"
    out = run_cli("sft", "sft.steps=12", "sft.eval_every=6", "sft.batch_size=16", "task.options.size=3",
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


def test_keys_makes_a_curve_pair_and_never_overwrites_one(tmp_path):
    import zmq.auth

    out = run_cli("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    public, secret = zmq.auth.load_certificate(str(tmp_path / "worker-7.key_secret"))
    assert len(public) == len(secret) == 40  # Z85 of 32-byte keys
    assert zmq.auth.load_certificate(str(tmp_path / "worker-7.key"))[1] is None  # the public file holds no secret
    assert (tmp_path / "worker-7.key_secret").stat().st_mode & 0o077 == 0
    again = run_cli("keys", "--name", "worker-7", "--out", str(tmp_path))
    assert again.returncode == 2 and "exists" in again.stderr
