"""The learner + rollout workers as real processes over ZeroMQ: train, sync/async, crashes, kill -9, resume."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from heterorl.runs import read_metrics
from heterorl.runtime.preloaded import ForkedChild
from tests.conftest import ENV, REPO, maze_run, run_cli, trajectory, wait_until


def write_config(tmp_path: Path, steps: int = 6, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(maze_run(tmp_path / "run", steps, eval_size=32, eval_every=3, runtime={"checkpoint_every": 2},
                             transport={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0}) + extra)
    return path


def spawn(*args, log: Path) -> ForkedChild:
    """`heterorl ARGS` in a process of its own, its output in ``log``: forked from a process that has imported
    what it needs, as `heterorl train` starts the learner and the workers (heterorl.runtime.preloaded), which
    saves each about 3 CPU seconds of imports. The log exists (empty) when this returns."""
    log.write_bytes(b"")
    return ForkedChild(list(args), log, ENV, cwd=REPO)


def learner_step(run_dir: Path) -> int:
    path = run_dir / "checkpoints" / "learner_state.json"
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError):
        return -1


def endpoint(run_dir: Path) -> str | None:
    path = run_dir / "endpoints.json"
    return json.loads(path.read_text())["control"] if path.exists() else None


@pytest.mark.slow
def test_train_async_runs_learner_and_workers_and_reports(tmp_path):
    out = run_cli("train", "--config", str(write_config(tmp_path, steps=4)), "runtime.inflight_updates=true",
                  "runtime.weights_dtype=bfloat16")
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["mode"] == "async" and summary["workers"] == 2
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        for key in ("staleness/versions_hist", "staleness/seconds_mean", "learner/idle_frac", "workers/idle_frac",
                    "throughput/tokens_per_s", "buffer/groups", "optim/updates", "pace/ahead_steps",
                    "cores/learner_threads"):
            assert key in record, key
        # per token: with in-flight updates a trajectory may carry several versions (how many: timing)
        assert 0 <= record["staleness/token_versions_mean"] <= record["staleness/versions_max"]
        assert 0.0 <= record["staleness/spanning_frac"] <= 1.0
        # which groups make a batch depends on arrival order: a batch whose groups all scored alike runs no
        # update, and then records why instead of the loss's metrics (docs/RUNTIME.md)
        if record["optim/updates"] > 0:
            assert "is/weight_var" in record and "kl/k3" in record and "optim/skip_reason" not in record, record
        else:
            assert record["optim/skip_reason"] == "no_signal" and "is/weight_var" not in record, record
    assert summary["steps_without_update"] == sum(r["optim/updates"] == 0 for r in records)
    # paced (the default): the fleet starts no group the run will not train, and nothing is discarded
    rollouts = summary["rollouts"]
    assert rollouts["generated"] == rollouts["trained"] > 0 and rollouts["wasted_frac"] == 0.0, rollouts
    assert not any(rollouts["discarded"].values()) and rollouts["left_over"] == 0
    assert "0.0% wasted" in out.stdout
    # the workers sampled with the bf16 cast of the learner's weights, sent as deltas after the first
    weights = summary["weights"]
    assert weights["dtype"] == "bfloat16" and weights["versions"] == 5 and weights["bytes_ratio"] > 1.5, weights
    assert sum(summary["staleness_hist"]) == sum(summary["staleness_seconds_hist"].values()) == 4 * 4
    # both workers took part: the learner waited for both to hold its weights before its first step
    assert max(r["workers/alive"] for r in records) == 2 and records[-1]["transport/rejected"] == 0
    assert "held-out greedy success" in out.stdout and "staleness mean" in out.stdout
    for name in ("learner", "worker-0", "worker-1"):
        assert (run / "logs" / f"{name}.log").exists()
    assert "ended the run" in (run / "logs" / "worker-0.log").read_text()  # workers left on the learner's bye


@pytest.mark.slow
def test_sync_mode_trains_on_policy(tmp_path):
    out = run_cli("train", "--config", str(write_config(tmp_path, steps=4)), "--mode", "sync")
    assert out.returncode == 0, out.stdout + out.stderr
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert len(records) == 4
    assert all(r["staleness/versions_max"] == 0 for r in records)  # every batch sampled by the newest weights
    # the summary splits the fleet by engine: here two torch workers, every trained trajectory theirs
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    torch_engine = summary["engines"]["torch"]
    assert list(summary["engines"]) == ["torch"] and torch_engine["staleness_max"] == 0
    assert torch_engine["trajectories_trained"] == sum(r["engine/torch/trajectories"] for r in records) == 4 * 4 * 4
    # the training–inference mismatch is measured on the tokens of every update's first forward (all at
    # staleness 0 here): the learner's teacher-forced log-probs and the torch engine's agree to float32 rounding
    measured = sum(r.get("mismatch/torch/tokens", 0) for r in records)
    assert torch_engine["mismatch_tokens"] == measured
    if any(r["optim/updates"] > 0 for r in records):
        assert measured > 0 and torch_engine["mismatch_abs_max"] < 1e-3, torch_engine
        assert torch_engine["is_ratio_var"] < 1e-6
    assert "by sampling engine" in out.stdout
    assert summary["rollouts"]["wasted_frac"] == 0.0, summary["rollouts"]
    # the run's staleness histograms count every group trained; the weights went out as deltas after the first
    assert summary["staleness_hist"] == [4 * 4] and sum(summary["staleness_seconds_hist"].values()) == 4 * 4
    weights = summary["weights"]
    assert weights["dtype"] == "float32" and weights["deltas"] and weights["versions"] == 5, weights
    assert 1.0 < weights["bytes_ratio"] and weights["step_bytes_mean"] < weights["version_bytes"], weights
    assert "weights: 5 versions" in out.stdout and "samples/s" in out.stdout
    for name in ("worker-0", "worker-1"):  # sync: each fetched every version it sampled, one step at a time
        log = (tmp_path / "run" / "logs" / f"{name}.log").read_text()
        found = re.search(r"weights: (\d+) versions whole, (\d+) as deltas, 0 resyncs", log)
        assert found and found.group(1) == "1" and int(found.group(2)) >= 3, log[-2000:]


def test_train_restarts_a_crashed_worker_gives_it_up_and_stops(tmp_path):
    config = write_config(tmp_path)
    out = run_cli("train", "--config", str(config), "task.reward_fn=tests.crashing_reward:score",
                  "runtime.worker_restarts=1")
    assert out.returncode == 2, out.stdout + out.stderr
    # each worker crashes, is restarted once, crashes again and is given up; the last one given up stops the run
    assert out.stderr.count(" restarted (pid ") == 2, out.stderr
    assert "has used its 1 restart(s) of the last hour (runtime.worker_restarts): given up" in out.stderr
    assert "every rollout worker has failed and been given up" in out.stderr
    assert "reward service unreachable" in out.stderr  # the crashed worker's log tail


def test_a_vllm_worker_without_its_venv_is_a_clear_error_before_anything_starts(tmp_path):
    out = run_cli("train", "--config", str(write_config(tmp_path)), "runtime.engines=[torch,vllm]",
                  f"runtime.vllm_python={tmp_path / 'no-venv' / 'python'}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "runtime.vllm_python" in out.stderr and "make vllm" in out.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no learner was started
    out = run_cli("train", "--config", str(write_config(tmp_path)), "runtime.engines=[torch,tpu]", "--dry-run")
    assert out.returncode == 2 and "runtime.engines" in out.stderr and "torch, vllm" in out.stderr


def test_train_refuses_to_overwrite_a_run_and_resume_needs_one(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    out = run_cli("train", "--config", str(write_config(tmp_path)))
    assert out.returncode == 2 and "--resume" in out.stderr
    out = run_cli("train", "--resume", str(tmp_path / "elsewhere"))
    assert out.returncode == 2 and "train_config.yaml" in out.stderr


def misfit_policy(folder: Path) -> Path:
    """maze-sft-base's tokenizer and vocabulary with a wider MLP: a policy whose weights no version of the
    learner's (maze-sft-base) fits."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from heterorl.policies import shipped_policy

    shutil.copytree(shipped_policy("maze-sft-base"), folder)
    config = AutoConfig.from_pretrained(folder)
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def run_with_a_misfit_worker(tmp_path: Path, engine: str, python: str = sys.executable) -> None:
    """A learner, a torch worker and a worker of ``engine`` whose policy the learner's weights do not fit: the
    misfit refuses the first version with a clear error and leaves; the learner stops waiting for it and trains
    every step on the other worker's rollouts."""
    config = write_config(tmp_path, steps=4, extra="")
    run = tmp_path / "run"
    learner = spawn("learner", "--config", str(config), "runtime.fleet_wait_s=600", log=tmp_path / "learner.log")
    workers = []
    try:
        address = wait_until(lambda: endpoint(run), 120, "the learner to listen")
        workers.append(spawn("rollout", "--connect", address, "--worker-id", "w-torch", log=tmp_path / "w0.log"))
        misfit = subprocess.Popen(
            [python, "-m", "heterorl.cli", "rollout", "--connect", address, "--worker-id", f"w-{engine}-misfit",
             "--engine", engine, "--policy", str(misfit_policy(tmp_path / "misfit"))],
            stdout=(tmp_path / "w1.log").open("w"), stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        workers.append(misfit)
        assert misfit.wait(600) != 0
        log = (tmp_path / "w1.log").read_text()
        assert "do not fit" in log and "mlp" in log, log[-3000:]
        assert learner.wait(600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert workers[0].wait(60) == 0
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 4 and list(summary["engines"]) == ["torch"], summary["engines"]
        # the learner did not wait out fleet_wait_s for the worker that left
        assert summary["minutes"] < 5
    finally:
        for proc in [learner, *workers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_worker_whose_policy_the_weights_do_not_fit_leaves_and_the_run_goes_on(tmp_path):
    run_with_a_misfit_worker(tmp_path, "torch")


@pytest.mark.slow
def test_a_killed_worker_does_not_stop_the_run_and_garbage_is_counted(tmp_path):
    # admission control keeps at most two steps of data ahead of the learner, and w1 is paused while w0
    # restarts, so the run cannot finish before w0 is back, however slow the machine
    config = write_config(tmp_path, steps=10, extra="buffer: {policy: admission, max_staleness_steps: 1}\n")
    run = tmp_path / "run"
    learner = spawn("learner", "--config", str(config), log=tmp_path / "learner.log")
    workers = {}
    try:
        address = wait_until(lambda: endpoint(run), 120, "the learner to listen")
        for name in ("w0", "w1"):
            workers[name] = spawn("rollout", "--connect", address, "--worker-id", name, log=tmp_path / f"{name}.log")
        log = tmp_path / "learner.log"
        wait_until(lambda: learner_step(run) >= 2 and "worker w0 joined" in log.read_text(), 240, "two steps and w0")
        workers["w1"].send_signal(signal.SIGSTOP)
        workers["w0"].send_signal(signal.SIGKILL)
        # the killed w0 falls silent past heartbeat_timeout_s (3 s) and is marked dead, however fast this machine:
        # only then does it come back (nothing samples meanwhile, so the run cannot end without it)
        wait_until(lambda: "worker w0 silent for" in log.read_text(), 240, "the killed w0 to be marked dead")
        workers["w0-again"] = spawn("rollout", "--connect", address, "--worker-id", "w0",
                                    log=tmp_path / "w0-again.log")
        # a stranger sends garbage and a forged trajectory while the run goes on
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 10_000)  # closing waits until all 200 frames are out
        raw.connect(address)
        for i in range(200):
            raw.send(os.urandom(64) if i % 2 else b"\x82\xa1v\x01\xa4kind\xaatrajectory")
        raw.close()
        ctx.term()
        wait_until(lambda: "worker w0 rejoined" in log.read_text(), 240, "w0 to rejoin")
        workers["w1"].send_signal(signal.SIGCONT)
        assert learner.poll() is None and learner_step(run) < 10  # the run went on without w0 and takes it back
        assert learner.wait(400) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 10 and summary["transport_rejected"] >= 200
        assert "marked dead" in (tmp_path / "learner.log").read_text()
    finally:
        for p in [learner, *workers.values()]:
            if p.poll() is None:
                p.kill()


def test_a_worker_with_a_skewed_clock_does_not_corrupt_staleness(tmp_path):
    """Staleness in seconds is measured on the learner's clock (when the version was published), so a
    worker whose clock runs ten minutes ahead changes nothing."""
    from heterorl.config import load_config
    from heterorl.policies import load_policy
    from heterorl.runtime.learner import Learner, learner_settings
    from heterorl.tasks import make_task_from
    from heterorl.training.session import TrainingClient
    from heterorl.transport import LearnerServer, WorkerClient

    # one hand-made worker, not the two the config names: start on its first data
    cfg = load_config(write_config(tmp_path, steps=2), overrides=["runtime.fleet_wait_s=0"])
    task = make_task_from(cfg.task)
    model, tokenizer = load_policy("maze-sft-base")
    training = TrainingClient(model, tokenizer, seed=0)
    server = LearnerServer("tcp://127.0.0.1:0", cfg.transport, admission_control=True, settings=learner_settings(cfg))
    skew_s = 600.0
    stop = threading.Event()

    def skewed_worker():
        client = WorkerClient(server.control_endpoint, "skewed", cfg.transport)
        client.wait_ready(20)
        version, n = -1, 0
        while not stop.is_set():
            got = client.latest_weights()
            if got:
                version = got[0]
            if version < 0:
                time.sleep(0.05)
                continue
            for j in range(4):
                now = time.time() + skew_s
                traj = trajectory(trajectory_id=f"s-{n}-{j}", group_id=f"s-{n}", sampler_id="skewed", group_size=4,
                                  completion_len=2, version=version, reward=float(j % 2), generation_start=now - 1.0,
                                  generation_end=now, sent_at=0.0)
                try:
                    client.send(traj, timeout_s=0.5)
                except Exception:
                    pass
            n += 1
        client.close()

    thread = threading.Thread(target=skewed_worker, daemon=True)
    thread.start()
    records = []

    class Logger:
        def log(self, step, metrics):
            records.append(metrics)

    try:
        result = Learner(cfg, training, task, server, tmp_path / "run", logger=Logger()).run()
    finally:
        stop.set()
        server.close()
        thread.join(10)
    assert result.steps == 2
    steps = [r for r in records if "staleness/seconds_mean" in r]
    assert len(steps) == 2
    assert all(0 <= r["staleness/seconds_mean"] < 60 for r in steps), [r["staleness/seconds_mean"] for r in steps]


def test_ctrl_c_stops_every_process(tmp_path):
    config = write_config(tmp_path, steps=200)
    train = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "train", "--config", str(config)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    run = tmp_path / "run"
    try:
        wait_until(lambda: (run / "logs" / "worker-1.log").exists() and endpoint(run), 120, "the fleet to start")
        time.sleep(2)
        pids = [int(pid) for pattern in (str(run / "train_config.yaml"), endpoint(run)) for pid in subprocess.run(
            ["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]
        assert len(pids) >= 3  # the learner and two workers (and the launcher itself)
        train.send_signal(signal.SIGINT)
        _, stderr = train.communicate(timeout=60)
        assert train.returncode == 130, stderr
        assert f"heterorl train --resume {run}" in stderr and "Traceback" not in stderr, stderr
        time.sleep(1)
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and
                 "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        assert not alive, f"processes left behind: {alive}"
    finally:
        if train.poll() is None:
            train.kill()
