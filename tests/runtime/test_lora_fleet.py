"""A LoRA learner and its workers as real processes: each version on the wire is the adapter alone, workers
sample with exactly the learner's weights (merged or unmerged), and a worker on another base is refused."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from heterorl.policies import shipped_policy
from tests.conftest import ENV, REPO, run_cli, wait_until
from tests.runtime.test_processes import endpoint, spawn

BASE = "arith-hash-sft-base"


def write_config(tmp_path: Path, steps: int, **lora) -> Path:
    config = {
        "seed": 0, "task": {"name": "arithmetic", "options": {"digits": 3, "ops": "+", "eval_size": 32}},
        "rollout": {"group_size": 4, "max_tokens": 12}, "optim": {"lr": 1e-3},
        "rl": {"base": BASE, "steps": steps, "prompts_per_step": 4, "eval_every": steps},
        "runtime": {"workers": 2, "groups_per_call": 2, "threads": 1, "checkpoint_every": 2},
        "lora": {"rank": 8, **lora},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def adapter_bytes(rank: int = 8, layers: int = 4) -> int:
    """float32 bytes of a rank-``rank`` adapter on the 7 projections of the shipped tiny model."""
    return 4 * layers * rank * (4 * 256 + 3 * 640)


@pytest.mark.slow
def test_a_lora_run_sends_only_the_adapter_and_workers_sample_with_the_learners_weights(tmp_path):
    # workers merge the adapter into their base (`lora.apply: merged`); `unmerged` workers, torch and vLLM, are
    # run live by tests/runtime/test_vllm_fleet.py, and the torch engine's adapter layers by tests/training
    out = run_cli("train", "--config", str(write_config(tmp_path, 3)))
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    weights = summary["weights"]
    assert weights["version_bytes"] == adapter_bytes() and weights["dtype"] == "float32"
    whole = sum(f.stat().st_size for f in shipped_policy(BASE).glob("*.safetensors"))
    assert weights["version_bytes"] < whole / 10
    # at staleness 0 the workers' log-probs are the learner's: they rebuilt its weights from base + adapter
    torch_engine = summary["engines"]["torch"]
    assert torch_engine["mismatch_tokens"] > 0 and torch_engine["mismatch_abs_max"] < 1e-4
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert (run / "policy" / "config.json").is_file()  # the merged policy, a plain model folder
    checkpoint = json.loads((run / "checkpoints" / "learner_state.json").read_text())["weights"]
    assert (run / "checkpoints" / checkpoint).stat().st_size < 4 * adapter_bytes()  # adapter + Adam, no base
    # the adapter checkpoint resumes
    out = run_cli("train", "--resume", str(run), "rl.steps=4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed at step" in (run / "logs" / "learner.log").read_text()
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def other_base(folder: Path) -> Path:
    """The shipped base with one weight nudged: same shapes and tokenizer, another base."""
    from heterorl.policies import load_policy, save_policy

    model, tokenizer = load_policy(BASE)
    model.model.norm.weight.data.add_(1e-3)
    save_policy(model, tokenizer, folder)
    return folder


@pytest.mark.slow
def test_a_worker_on_another_base_is_refused_with_the_reason_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    learner = spawn("learner", "--config", str(write_config(tmp_path, 2)), "runtime.fleet_wait_s=600",
                    log=tmp_path / "learner.log")
    workers = []
    try:
        address = wait_until(lambda: endpoint(run), 120, "the learner to listen")
        workers.append(spawn("rollout", "--connect", address, "--worker-id", "w-good", log=tmp_path / "w0.log"))
        wrong = subprocess.Popen(
            [sys.executable, "-m", "heterorl.cli", "rollout", "--connect", address, "--worker-id", "w-wrong",
             "--policy", str(other_base(tmp_path / "other"))],
            stdout=(tmp_path / "w1.log").open("w"), stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        workers.append(wrong)
        assert wrong.wait(300) != 0
        log = (tmp_path / "w1.log").read_text()
        assert "is not the base the learner's adapter is trained on" in log, log[-3000:]
        assert learner.wait(600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert workers[0].wait(60) == 0
        assert json.loads((run / "summary.json").read_text())["steps"] == 2
    finally:
        for proc in [learner, *workers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp_path / "other", ignore_errors=True)
