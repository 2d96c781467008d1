"""A mixed fleet over ZeroMQ (`make test-vllm`): one learner fed at once by a torch worker and a vLLM worker.

Synchronous mode, so that each worker samples its share of every batch whatever the arrival order: both
workers' trajectories are trained at every step, whichever engine is faster to start.
"""

import json
import re
import sys

import pytest

from heterorl.runs import read_metrics
from tests.conftest import run_cli
from tests.runtime.test_processes import run_with_a_misfit_worker

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")


ADD3 = '{name: arithmetic, options: {digits: 3, ops: "+", answer_format: digits, eval_size: 32, eval_seed: 54321}}'


def _train(tmp_path, *, task: str, rollout: str, rl: str, runtime: str, more: str = ""):
    """`heterorl train` on a config of the given sections (each a YAML flow mapping's inside), vLLM workers
    started with this interpreter; returns the run folder, the finished process and the last vLLM worker's log."""
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"""
seed: 0
task: {task}
rollout: {{{rollout}}}
rl: {{{rl}}}
runtime: {{{runtime}, vllm_python: {sys.executable}, vllm_kv_cache_gib: 0.25, fleet_wait_s: 300}}
logging: {{run_dir: {run}, wandb_mode: disabled, progress: false}}
{more}""")
    out = run_cli("train", "--config", str(config), timeout=900)
    logs = sorted((run / "logs").glob("worker-*.log"))
    log = logs[-1].read_text() if logs else ""
    assert out.returncode == 0, out.stdout + out.stderr + log[-3000:]
    return run, out, log


def test_a_torch_worker_and_a_vllm_worker_feed_one_learner(tmp_path):
    run, out, _ = _train(tmp_path, task=ADD3, rollout="group_size: 4, max_tokens: 6",
                         rl="base: add3-sft-base, steps: 3, prompts_per_step: 4, eval_every: 3",
                         runtime="mode: sync, workers: 2, engines: [torch, vllm], groups_per_call: 2",
                         more="loss: {name: gepo}")
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness/versions_max"] == 0 for r in records)
    torch_log = (run / "logs" / "worker-0.log").read_text()
    vllm_log = (run / "logs" / "worker-1.log").read_text()
    assert "vLLM engine on" in vllm_log and "vLLM engine on" not in torch_log
    for log in (torch_log, vllm_log):  # each sampled its share (2 groups) of each of the 3 batches
        sent = re.search(r"ended the run after (\d+) groups", log)
        assert sent and int(sent.group(1)) >= 6, log[-2000:]
        # each took the first version whole and the later ones as deltas, rebuilt and checked (vLLM: in place)
        weights = re.search(r"weights: (\d+) versions whole, (\d+) as deltas, (\d+) resyncs", log)
        assert weights and weights.group(1) == "1" and int(weights.group(2)) >= 2, log[-2000:]
    # the summary splits the fleet by engine, and the training–inference mismatch of each is measured at
    # staleness 0: vLLM in float32 agrees with the learner's teacher-forced log-probs to rounding, as torch does
    engines = json.loads((run / "summary.json").read_text())["engines"]
    assert sorted(engines) == ["torch", "vllm"], engines
    for name, e in engines.items():
        assert e["trajectories_trained"] > 0 and e["staleness_max"] == 0, (name, e)
        if e["mismatch_tokens"]:
            assert e["mismatch_abs_max"] < 1e-3 and e["is_ratio_var"] < 1e-6, (name, e)
    assert any(e["mismatch_tokens"] for e in engines.values()) or all(r["optim/updates"] == 0 for r in records)
    assert "by sampling engine" in out.stdout


def test_a_vllm_worker_the_weights_do_not_fit_leaves_and_the_run_goes_on(tmp_path):
    run_with_a_misfit_worker(tmp_path, "vllm", sys.executable)


def test_a_lora_run_feeds_a_torch_and_a_vllm_worker_adapters_kept_unmerged(tmp_path):
    """Each version is the adapter alone; the torch worker keeps it in adapter layers, the vLLM worker runs it
    as a vLLM LoRA adapter: at staleness 0 both sample with the learner's weights."""
    run, _, _ = _train(tmp_path, task='{name: arithmetic, options: {digits: 3, ops: "+", eval_size: 32}}',
                       rollout="group_size: 4, max_tokens: 12",
                       rl="base: arith-hash-sft-base, steps: 3, prompts_per_step: 4, eval_every: 3",
                       runtime="mode: sync, workers: 2, engines: [torch, vllm], groups_per_call: 2",
                       more="optim: {lr: 1.0e-3}\nlora: {rank: 8, apply: unmerged}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["weights"]["version_bytes"] < 10**6  # the adapter, not the 4 MB model
    engines = summary["engines"]
    assert sorted(engines) == ["torch", "vllm"], engines
    for name, e in engines.items():
        assert e["trajectories_trained"] > 0 and e["staleness_max"] == 0, (name, e)
        if e["mismatch_tokens"]:
            assert e["mismatch_abs_max"] < 1e-3, (name, e)
    assert any(e["mismatch_tokens"] for e in engines.values())


def test_a_streaming_vllm_worker_takes_weights_in_flight_and_feeds_an_async_learner(tmp_path):
    """runtime.vllm_streaming with in-flight updates: groups sent one by one as they end, versions loaded while
    requests run. Asserted only what cannot depend on timing: every step trains, the trajectories pass the
    learner's checks (versions per token included), and the vLLM samples agree with the learner's log-probs
    where they were drawn by the version trained."""
    run, _, log = _train(tmp_path, task=ADD3, rollout="group_size: 4, max_tokens: 6",
                         rl="base: add3-sft-base, steps: 4, prompts_per_step: 4, eval_every: 4",
                         runtime="mode: async, workers: 1, engines: [vllm], groups_per_call: 2, vllm_streaming: true, "
                                 "inflight_updates: true, max_versions_per_sample: 2",
                         more="loss: {name: gepo}")
    assert "vLLM engine on" in log and "streaming" in log
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    sent = re.search(r"ended the run after (\d+) groups", log)
    assert sent and int(sent.group(1)) >= 4, log[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engines"]["vllm"]["trajectories_trained"] >= 16
