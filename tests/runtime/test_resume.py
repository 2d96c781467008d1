"""A learner killed with kill -9 and restarted with --resume always resumes (docs/RELIABILITY.md, "Crash and resume"):
its versions never go backwards from what a worker has seen, no trajectory is trained twice and no fresh one is
dropped as already trained, each step is logged once, restarting is not finishing, and a damaged checkpoint is an
error that names the file and the checkpoint to use instead."""

import json
import random
import re
import shutil
import signal

import numpy as np
import pytest
import torch
import zmq

from heterorl.config import TransportConfig, load_config
from heterorl.engines.base import SampleOutput
from heterorl.errors import HeteroRLError
from heterorl.policies import load_policy
from heterorl.runs import keep_metrics_until, read_metrics
from heterorl.runtime.checkpoints import PUBLISHED, read_checkpoint
from heterorl.runtime.launch import serve_learner
from heterorl.runtime.learner import Learner
from heterorl.runtime.worker import new_session, stamp_groups
from heterorl.tasks import make_task, make_task_from
from heterorl.training.session import AdamParams, Datum, TrainingClient
from heterorl.transport import LearnerServer, TransportError, WorkerClient
from heterorl.transport.protocol import (
    BYE_LEARNER_STOPPING,
    BYE_REFUSED,
    BYE_RUN_FINISHED,
    Bye,
    Hello,
    TrajectoryContract,
    decode,
    encode,
)
from tests.conftest import maze_run, ports_held_for_a_restart, run_cli, trajectory, wait_until
from tests.runtime.test_processes import endpoint, spawn

# a step takes about 0.1 s: the run goes on long after the last kill, which cannot come after its end however
# late the test sees the step it waits for
STEPS, GROUPS_PER_STEP = 24, 4
FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, hello_interval_s=0.1)


def resume_run(run_dir, steps: int) -> str:
    return maze_run(run_dir, steps, eval_size=8, eval_every=100,
                    runtime={"checkpoint_every": 3, "learner_timeout_s": 120},
                    buffer={"policy": "admission", "max_staleness_steps": 1},
                    transport={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0},
                    logging={"save_policy": False})


def write_config(tmp_path, steps: int = STEPS):
    path = tmp_path / "run.yaml"
    path.write_text(resume_run(tmp_path / "run", steps))
    return path


def last_step(run) -> int:
    try:
        return max((r["step"] for r in read_metrics(run / "metrics.jsonl")), default=-1)
    except (OSError, ValueError):  # not there yet, or a line half-written
        return -1


def at_kill(run) -> dict:
    """What a killed learner left: the steps it logged, its checkpoint and the newest version it published."""
    records = read_metrics(run / "metrics.jsonl")
    state = json.loads((run / "checkpoints" / "learner_state.json").read_text())
    published = json.loads((run / "checkpoints" / PUBLISHED).read_text())["version"]
    logged = [r["policy/version"] for r in records if "policy/version" in r]
    return {"steps_at_kill": max(r["step"] for r in records), "checkpoint_step": state["step"],
            "checkpoint_version": state["version"], "version_before": max([published, *logged])}


# -- kill -9, with workers running ------------------------------------------------------------------


# (once this step is logged: stop the learner with this signal and resume it, restart w1); checkpoints every 3
# steps. SIGINT: the learner stops after its step in progress, with a checkpoint, and says so to its workers.
SCHEDULE = [(1, signal.SIGKILL, True), (2, None, True), (4, signal.SIGKILL, False), (7, signal.SIGINT, False),
            (10, signal.SIGKILL, True)]  # checkpoints every 3 steps: kills at 1 (after step 0's), 4, 7, 10


@pytest.mark.slow
def test_a_learner_killed_between_checkpoints_resumes_and_its_workers_carry_on(tmp_path):
    """kill -9 at three points (before the first periodic checkpoint, about one step after one, about one after
    another) and an interrupted learner, with w0 running throughout and w1 restarted with the learner and while
    it lives: versions only go up, no trajectory is trained twice, none is dropped as already trained or as a
    duplicate, each step is logged once, the workers wait for a learner that stopped and leave on the final bye.
    Admission control keeps the workers from sampling far more than is trained, so that a restarted w1 reusing
    its old ids would run into ids the learner has seen or trained."""
    config, run = write_config(tmp_path), tmp_path / "run"
    lives: dict[str, int] = {}
    learners = [spawn("learner", "--config", str(config), log=tmp_path / "learner-0.log")]
    workers = {}

    def restart(name: str) -> None:
        if name in workers:
            workers[name].send_signal(signal.SIGKILL)
            workers[name].wait(30)
        lives[name] = lives.get(name, -1) + 1
        workers[name] = spawn("rollout", "--connect", address, "--worker-id", name,
                              log=tmp_path / f"{name}-{lives[name]}.log")

    kills = []
    try:
        address = wait_until(lambda: endpoint(run), 120, "the learner to listen")
        restart("w0")
        restart("w1")
        for at_step, stop, restart_w1 in SCHEDULE:
            wait_until(lambda: last_step(run) >= at_step, 240, f"step {at_step}")
            if stop is None:
                if restart_w1:
                    restart("w1")
                continue
            learners[-1].send_signal(stop)
            assert learners[-1].wait(30) == (0 if stop == signal.SIGINT else -stop)
            with ports_held_for_a_restart(run):  # until the resumed learner binds them again
                kills.append({"signal": stop.name, **at_kill(run)})
                if stop == signal.SIGINT:  # stopped, not killed: no step is lost
                    assert kills[-1]["checkpoint_step"] == kills[-1]["steps_at_kill"], kills[-1]
                if restart_w1:
                    restart("w1")
                log = tmp_path / f"learner-{len(learners)}.log"
                learners.append(spawn("learner", "--config", str(config), "--resume", log=log))
                # it drops the metrics after its checkpoint before it listens: the next wait reads its own steps
                wait_until(lambda: "learner listening" in log.read_text(), 120, "the resumed learner to listen")
        assert learners[-1].wait(300) == 0, log.read_text()[-3000:]
        for name, worker in workers.items():
            assert worker.wait(60) == 0, name  # they left on the final bye, not on a restart's
    finally:
        for p in [*learners, *workers.values()]:
            if p.poll() is None:
                p.kill()

    records = read_metrics(run / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == list(range(STEPS + 1))  # each step logged once, none lost
    trained = [r for r in records if r["step"] > 0]
    versions = [r["policy/version"] for r in trained]
    assert versions == sorted(set(versions))  # strictly increasing
    for kill in kills:
        after = next(r for r in trained if r["step"] == kill["checkpoint_step"] + 1)
        kill["version_after"] = after["policy/version"]
        # every version the killed learner published (and its workers may hold) is older than the resumed ones
        assert kill["version_after"] > kill["version_before"], kill
    for r in trained:
        assert r["workers/version_held_max"] <= r["policy/version"], r  # no worker ahead of its learner
        assert r["buffer/dropped_trained"] == 0 and r["transport/duplicates"] == 0, r
    state = json.loads((run / "checkpoints" / "learner_state.json").read_text())
    trained_groups = {tid.rsplit("-", 1)[0] for tid in state["trained_ids"]}
    # every step took 4 whole groups, each counted once: no group (nor any of its trajectories) trained twice
    assert state["step"] == STEPS and state["tally"]["groups_trained"] == len(trained_groups) == STEPS * GROUPS_PER_STEP
    assert len(state["trained_ids"]) == STEPS * GROUPS_PER_STEP * 4  # and each of their 4 trajectories once
    assert all(key.startswith(("w0|w0-", "w1|w1-")) for key in state["trained_ids"])  # namespaced by worker
    sessions = {key.split("-")[1] for key in state["trained_ids"] if key.startswith("w1|")}
    assert len(sessions) >= 2  # w1's lives stamped ids of their own
    for name in ("w0", "w1"):
        assert "ended the run" in (tmp_path / f"{name}-{lives[name]}.log").read_text()
    survivor = (tmp_path / "w0-0.log").read_text()
    assert "learner said bye to w0: learner stopping" in survivor  # the interrupted learner said it stops ...
    assert survivor.count("rejoined") >= len(kills)  # ... and w0 went on with each resumed learner
    print("\nkills:", json.dumps(kills))


# -- the parts, without processes -----------------------------------------------------------------


class _Publisher:
    """What `Learner.publish` and `_admit` need of a server: ``publish``, ``set_admission``, ``permits_left``
    (a server made with admission control)."""

    def __init__(self) -> None:
        self.published, self.admission, self.ahead = [], None, None

    def publish(self, version: int, state: dict, dtype=None) -> None:
        self.published.append(version)

    def set_admission(self, cap: int | None, ahead: int = 1, max_lag: int | None = None) -> None:
        self.admission, self.ahead, self.max_lag = cap, ahead, max_lag

    def permits_left(self) -> int:
        return 0


@pytest.fixture
def learner_parts(tmp_path):
    cfg = load_config(text=resume_run(tmp_path / "run", STEPS))
    task = make_task_from(cfg.task)

    def make() -> tuple[Learner, TrainingClient]:
        model, tokenizer = load_policy("maze-sft-base")
        training = TrainingClient(model, tokenizer, seed=0)
        return Learner(cfg, training, task, _Publisher(), tmp_path / "run"), training

    return make


def _train_once(training: TrainingClient) -> None:
    tokens = [5, 6, 7, 8, 9, 10]
    training.forward_backward([Datum(tokens=tokens, prompt_len=3)]).result()
    training.optim_step(AdamParams(learning_rate=1e-3)).result()


def test_a_worker_may_hold_permits_for_runtime_permit_calls_calls_and_the_weights_lag_is_passed_on(tmp_path):
    model, tokenizer = load_policy("maze-sft-base")
    for calls in (1, 2):
        cfg = load_config(text=resume_run(tmp_path / f"run{calls}", STEPS),
                          overrides=[f"runtime.permit_calls={calls}", "runtime.max_weights_lag=5"])
        learner = Learner(cfg, TrainingClient(model, tokenizer, seed=0), make_task_from(cfg.task), _Publisher(),
                          tmp_path / f"run{calls}")
        learner._admit()
        assert learner.server.ahead == calls * cfg.runtime.groups_per_call and learner.server.max_lag == 5


def test_a_resumed_learner_publishes_above_every_version_published_before(learner_parts, tmp_path):
    learner, training = learner_parts()
    learner.save_checkpoint()  # step 0, version 0
    _train_once(training)
    learner.state.step = 3
    learner.publish()
    learner.save_checkpoint()  # step 3, version 1
    for _ in range(3):  # the learner publishes versions 2..4 and is killed before its next checkpoint
        learner.publish()
    checkpoint = read_checkpoint(tmp_path / "run")
    assert (checkpoint.state.step, checkpoint.training_state["version"], checkpoint.newest_published) == (3, 1, 4)
    assert set(checkpoint.published_wall_s) == {"2", "3", "4"}  # the staleness clock of the lost versions
    resumed, training2 = learner_parts()
    resumed.resume(checkpoint)
    assert resumed.publish() == 5 and resumed.server.published == [5]
    resumed._admit()  # its server counts the groups started since the resume: the fleet may start two steps' worth,
    assert resumed.server.admission == 2 * GROUPS_PER_STEP  # as at the start of the run (max_staleness_steps 1)
    assert {"2", "3", "4", "5"} <= set(resumed.state.publish_wall_s)
    for name, p in training.model.state_dict().items():  # the checkpoint's weights, under the new version
        assert np.array_equal(p.numpy(), training2.model.state_dict()[name].numpy()), name
    # checkpoint files: the latest, the previous and its weights; nothing else (no temp file, no older weights)
    resumed.state.step = 6
    resumed.save_checkpoint()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["checkpoint-000003.pt", "checkpoint-000006.pt", "learner_state.json",
                     "learner_state.prev.json", PUBLISHED]


def _two_checkpoints(learner_parts, tmp_path):
    learner, training = learner_parts()
    learner.state.step = 3
    learner.publish()
    learner.save_checkpoint()
    _train_once(training)
    learner.state.step = 6
    learner.publish()
    learner.save_checkpoint()
    return tmp_path / "run" / "checkpoints"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "truncated weights": ("checkpoint-000006.pt", _truncate, "truncated"),
    "garbage weights": ("checkpoint-000006.pt", lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)),
                        "truncated, not a checkpoint"),
    "bad JSON": ("learner_state.json", lambda p: p.write_text('{"step": 6, "trained_ids": ['), "not valid JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_an_error_naming_it_and_the_good_one(learner_parts, tmp_path, damage):
    folder = _two_checkpoints(learner_parts, tmp_path)
    name, spoil, what = DAMAGE[damage]
    spoil(folder / name)
    (tmp_path / "run.yaml").write_text(resume_run(tmp_path / "run", STEPS))
    out = run_cli("learner", "--config", str(tmp_path / "run.yaml"), "--resume", timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("heterorl: error: cannot resume"), out.stderr
    assert str(folder / name) in out.stderr and what in out.stderr, out.stderr
    assert "previous checkpoint (step 3" in out.stderr and "learner_state.prev.json" in out.stderr, out.stderr
    # the way out it names works: copy the previous learner state over the latest
    command = re.search(r"`(cp [^`]+)`", out.stderr).group(1).split()
    shutil.copy(command[1], command[2])
    assert read_checkpoint(tmp_path / "run").state.step == 3


def test_with_no_good_checkpoint_left_the_error_says_so(learner_parts, tmp_path):
    folder = _two_checkpoints(learner_parts, tmp_path)
    _truncate(folder / "checkpoint-000006.pt")
    (folder / "learner_state.prev.json").write_text("garbage")
    with pytest.raises(HeteroRLError, match="No good checkpoint remains .*learner_state.prev.json"):
        read_checkpoint(tmp_path / "run")
    (folder / "checkpoint-000006.pt").unlink()
    (folder / "learner_state.prev.json").unlink()
    with pytest.raises(HeteroRLError, match="no training state at .*checkpoint-000006.pt. No good checkpoint remains "
                                            ".*learner_state.prev.json does not exist"):
        read_checkpoint(tmp_path / "run")


def test_a_garbage_record_of_the_newest_version_is_an_error_naming_it(learner_parts, tmp_path):
    folder = _two_checkpoints(learner_parts, tmp_path)
    (folder / PUBLISHED).write_text("{}")
    with pytest.raises(HeteroRLError, match=f"{PUBLISHED} is not a record of the newest version"):
        read_checkpoint(tmp_path / "run")


def test_a_learner_without_resume_refuses_a_run_that_has_a_checkpoint(learner_parts, tmp_path):
    _two_checkpoints(learner_parts, tmp_path)
    cfg = load_config(text=resume_run(tmp_path / "run", STEPS))
    with pytest.raises(HeteroRLError, match="already holds a run: pass --resume"):
        serve_learner(cfg, "tcp://127.0.0.1:0")


def test_metrics_after_the_checkpoint_are_dropped_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "policy/version": s + 1}) + "\n" for s in range(7)]
    path.write_text("".join(lines) + '{"step": 7, "policy/vers')  # a line a killed learner left half-written
    keep_metrics_until(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    inode = path.stat().st_ino
    keep_metrics_until(path, 3)
    assert path.stat().st_ino == inode  # nothing to drop: not rewritten


def test_trajectory_ids_carry_the_worker_session():
    task = make_task("maze", {"size": 5})
    problem = task.sample_train(random.Random(0))
    sample = SampleOutput(tokens=[5, 6], logprobs=[-0.1, -0.2], stop_reason="stop", text="R")
    first, second = new_session(), new_session()
    assert first != second and re.fullmatch(r"[0-9a-f]{12}", first)
    (group,) = stamp_groups(task, "w0", 0, 3, [problem], [[1, 2]], [[sample]], 1.0, 2.0, session=first)
    assert group[0].group_id == f"w0-{first}-0" and group[0].trajectory_id == f"w0-{first}-0-0"
    (group,) = stamp_groups(task, "w0", 0, 3, [problem], [[1, 2]], [[sample]], 1.0, 2.0)
    assert group[0].trajectory_id == "w0-0-0"  # the simulation: one life, no session


# -- restarting is not finishing ------------------------------------------------------------------


def test_a_stopping_learner_is_waited_for_and_a_finished_run_ends_the_worker():
    server = LearnerServer("tcp://127.0.0.1:0", FAST)
    address = server.control_endpoint
    client = WorkerClient(address, "w0", FAST)
    restarted = None
    try:
        client.wait_ready(10)
        server.close(BYE_LEARNER_STOPPING)
        wait_until(lambda: not client.learner_alive, 10, "the worker to take the learner for gone")
        assert not client.finished.is_set() and client.refused is None
        restarted = LearnerServer(address, FAST, weights_address=server.weights_endpoint)
        client.wait_ready(10)  # it kept saying hello: the restarted learner has it back
        assert not client.finished.is_set()
        restarted.close(BYE_RUN_FINISHED)
        assert client.finished.wait(5) and client.refused is None
    finally:
        client.close()
        if restarted is not None:
            restarted.close()


def test_a_refused_worker_stops_with_the_reason():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = WorkerClient(f"tcp://127.0.0.1:{port}", "w0", FAST)
    try:
        assert router.poll(10_000)
        peer, *frames = router.recv_multipart()
        assert isinstance(decode(frames), Hello)
        router.send_multipart([peer, *encode(Bye("learner", f"{BYE_REFUSED}worker id taken by another key"))])
        with pytest.raises(TransportError, match="refused worker w0: refused: worker id taken"):
            client.wait_ready(10)
        assert client.finished.is_set()
    finally:
        client.close()
        router.close(0)
        ctx.term()


def test_a_resumed_server_takes_the_versions_its_predecessor_published():
    """A restarted learner's server, before it publishes anything, takes trajectories stamped with the versions
    the learner before it published (its workers hold them) and none newer; its first version goes above them."""
    contract = TrajectoryContract(vocab_size=100, max_sequence_len=100)
    server = LearnerServer("tcp://127.0.0.1:0", FAST, contract=contract, published_before=7)
    client = WorkerClient(server.control_endpoint, "w0", FAST, version_held=7)
    try:
        ready = client.wait_ready(10)
        assert ready.newest_version == -1  # nothing to fetch before the first publish
        client.send_many([trajectory(trajectory_id=f"w0-a-{v}-0", group_id=f"w0-a-{v}", sampler_id="w0",
                                     group_size=1, version=v) for v in (7, 8)], 5)
        wait_until(lambda: server.stats["accepted"] + server.stats["rejected"] >= 2, 10, "both trajectories")
        assert server.stats["accepted"] == 1 and server.stats["rejected/version_ahead"] == 1
        with pytest.raises(TransportError, match="not newer than 7"):
            server.publish(7, {"w": torch.zeros(2)})
        server.publish(8, {"w": torch.zeros(2)})
        got = client.wait_weights(7, 10)
        assert got is not None and got[0] == 8
    finally:
        client.close()
        server.close()


def test_ctrl_c_of_train_stops_its_learner_by_sigint_and_prints_the_resume_command(tmp_path):
    """A real `heterorl train` and a real SIGINT to it alone (a terminal's Ctrl-C: its children lead sessions of
    their own): the learner ends its step with a checkpoint, its summary says SIGINT (not the SIGTERM the
    launcher stops processes with), and the launcher prints the step, the checkpoint and `train --resume`."""
    from tests.conftest import interrupted_cli

    run_dir = tmp_path / "run"
    stopped = interrupted_cli("train", "runtime.workers=1", "rl.steps=400", "rl.eval_every=400",
                              "task.options.eval_size=16", f"logging.run_dir={run_dir}", "logging.progress=false",
                              "logging.wandb_mode=disabled", "logging.save_policy=false", run_dir=run_dir)
    out, err = stopped.stdout, stopped.stderr
    assert stopped.returncode == 130, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and 1 <= summary["steps"] < 400
    checkpoint = read_checkpoint(run_dir).state.step
    assert checkpoint == summary["steps"]
    assert (f"stopped by SIGINT at step {summary['steps']} of 400; its last checkpoint is step {checkpoint}" in err
            and f"To go on: heterorl train --resume {run_dir}" in err), err
    assert "Traceback" not in err and "held-out greedy success" in out


def test_a_learner_stopped_while_it_waits_for_its_fleet_says_it_trains_nothing(learner_parts, caplog, monkeypatch):
    import logging

    learner, _ = learner_parts()
    monkeypatch.setattr(learner.server, "workers", lambda: [], raising=False)
    learner.request_stop("SIGTERM")
    caplog.set_level(logging.WARNING, logger="heterorl")
    learner._await_fleet()
    assert "SIGTERM while waiting for the fleet (0 of 2 workers ready): no training; stopping" in caplog.text
    assert "training starts with them" not in caplog.text
