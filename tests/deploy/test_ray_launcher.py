"""`heterorl train --launcher ray` on real Ray: a local Ray for one machine, and a multi-node cluster (a head and two
worker nodes, each its own raylet) on this machine for placement by resource and a node killed mid-run."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heterorl.bench.elastic import read_records
from heterorl.config import load_config
from heterorl.deploy import ray_launcher
from heterorl.deploy.ray_launcher import check_resources, fitting_nodes
from heterorl.errors import HeteroRLError
from heterorl.runtime.accounting import rollouts_lost
from tests.conftest import ENV, REPO, maze_run, run_cli, wait_until

pytest.importorskip("ray")


def run_config(tmp_path: Path, name: str, steps: int, **sections) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(maze_run(tmp_path / name, steps, eval_size=8, eval_every=100, **sections))
    return path


def processes_of(run_dir: Path) -> list[str]:
    """The command lines of live processes started for ``run_dir``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "heterorl.cli" in command and str(run_dir) in command and state != "Z":
            found.append(command)
    return found


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "ray_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_sync_run_on_ray_equals_the_local_launchers_bit_for_bit(tmp_path):
    """Same config, same seed, sync: the learner's 2 DDP ranks (as Ray actors joined by a TCPStore on rank 0's
    node) and 2 workers end with the very weights the local launcher (torchrun, child processes) ends with."""
    ranks = {"learner_ranks": 2, "checkpoint_every": 0}
    local = run_cli("train", "--config", str(run_config(tmp_path, "local", 2, runtime=ranks)), "--mode", "sync")
    assert local.returncode == 0, local.stdout + local.stderr
    on_ray = run_cli("train", "--config", str(run_config(tmp_path, "ray", 2, runtime=ranks)), "--mode", "sync",
                     "--launcher", "ray")
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr
    run = tmp_path / "ray"
    weights = [(tmp_path / name / "policy" / "model.safetensors").read_bytes() for name in ("local", "ray")]
    assert weights[0] == weights[1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollouts"]["trained"] == 2 * 4 * 4
    launcher = summary["launcher"]
    assert launcher["name"] == "ray" and launcher["shared_run_dir"] and launcher["start_s"] > 0, launcher
    assert summary["worker_restarts"] == {} and launcher["given_up"] == {}
    placed = {e["name"] for e in events(run) if e["event"] == "placed"}
    assert placed == {"learner", "learner-rank1", "worker-0", "worker-1"}
    for name in ("learner", "learner-rank1", "worker-0", "worker-1"):
        assert (run / "logs" / f"{name}.log").is_file()
    assert "ended the run" in (run / "logs" / "worker-0.log").read_text()  # they left on the learner's bye
    assert "held-out greedy success" in on_ray.stdout
    assert processes_of(run) == []


@pytest.mark.slow
def test_a_killed_node_s_worker_is_replaced_and_ctrl_c_leaves_nothing_behind(tmp_path):
    """scripts/ray_cluster_drill.py: a head (resource learner_node) and two worker nodes (rollout_node); the learner
    is placed on the head, the workers on the rollout nodes; worker-0's node is killed after step 2 and Ray brings
    worker-0 back on the other node, where it joins the learner again and the run goes on; Ctrl-C then stops the
    run, and no actor, placement group or process of it is left."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "ray_cluster_drill.py"), "--out",
                          str(tmp_path / "drill"), "--timeout-s", "240"], capture_output=True, text=True, env=ENV,
                         cwd=REPO, timeout=600)
    report = json.loads((tmp_path / "drill" / "drill.json").read_text())
    assert out.returncode == 0, json.dumps(report, indent=2) + out.stderr[-3000:]
    assert report["placement"] == {"learner": "head", "worker-0": report["placement"]["worker-0"],
                                   "worker-1": report["placement"]["worker-1"]}
    assert {report["placement"]["worker-0"], report["placement"]["worker-1"]} <= {"rollout-0", "rollout-1"}
    assert report["replaced_on"] == "the other rollout node" and report["worker_restarts"] == {"worker-0": 1}
    assert 0 < report["kill_to_actor_restarted_s"] <= report["kill_to_rejoined_s"]
    assert report["steps_after_rejoin"] >= 3 and report["rollouts"]["lost"] == 0
    assert report["driver_exit"] == 130 and report["stopped_by"] == "SIGTERM"
    assert report["leftovers"] == {"actors_alive": 0, "placement_groups": 0, "processes": []}


@pytest.mark.slow
def test_a_failed_worker_is_restarted_by_ray_and_a_learner_that_dies_stops_the_workers(tmp_path):
    """A worker's process killed: its actor exits and Ray starts it again, and the new process joins the learner.
    Then the learner killed: the run fails naming it, and each worker is stopped with the reason in its log."""
    run = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "train", "--config",
                               str(run_config(tmp_path, "run", 100000)), "--launcher", "ray"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        learner = wait_until(lambda: next((e for e in events(run) if e["event"] == "started"), None), 120,
                             "the learner's start")
        worker = wait_until(lambda: next((e for e in events(run) if e["name"] == "worker-0"), None), 120,
                            "worker-0's start")
        wait_until(lambda: "joined learner" in (run / "logs" / "worker-0.log").read_text(), 120, "worker-0 joining")
        os.kill(worker["pid"], signal.SIGKILL)
        restarted = wait_until(lambda: next((e for e in events(run) if e["event"] == "restarted"), None), 120,
                               "worker-0's restart")
        assert restarted["name"] == "worker-0" and restarted["pid"] != worker["pid"]
        log = run / "logs" / "worker-0.log"
        wait_until(lambda: "joined learner" in log.read_text().split("started again")[-1], 120, "the new worker-0")
        os.kill(learner["pid"], signal.SIGKILL)
        _, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 2 and "the learner failed (exit -9)" in err, err[-3000:]
    assert "exited with status -9: its actor exits for Ray to restart it" in log.read_text()
    for name in ("worker-0", "worker-1"):
        log = (run / "logs" / f"{name}.log").read_text()
        assert f"--- heterorl train stops {name}: the learner failed (exit -9)" in log, log[-2000:]
    assert processes_of(run) == []


@pytest.mark.slow
def test_an_elastic_fleet_grows_onto_an_added_node_and_shrinks_with_a_removed_one(tmp_path, monkeypatch):
    """cluster.ray.workers_per_node=1 on the drill's cluster with one rollout node: after step 2 a second rollout
    node is added, and the driver starts a worker there (its CURVE key allowed by the running learner) that joins
    and is trained from; then the first node is removed without warning, and its worker is removed from the fleet
    (not restarted, not given up) while the run goes on. Nothing generated is lost, no group is trained twice."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from ray_cluster_drill import OVERRIDES, learner_step

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    run = tmp_path / "run"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"learner_node": 1},
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    head, driver = cluster.head_node.node_id, None
    try:
        first = cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
        cluster.wait_for_nodes()
        with (tmp_path / "driver.log").open("wb") as log:
            driver = subprocess.Popen([sys.executable, "-m", "heterorl.cli", "train", "--launcher", "ray",
                                       "--address", cluster.address, "--config", "maze_rl.yaml", *OVERRIDES,
                                       f"logging.run_dir={run}", "cluster.ray.workers_per_node=1", "runtime.workers=1",
                                       "logging.group_log=true"],
                                      stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)

        def running(what: str):
            return lambda: f"{what}; driver exit {driver.poll()}:\n{(tmp_path / 'driver.log').read_text()[-3000:]}"

        def placed_on(node_id: str):
            return next((e["name"] for e in events(run) if e["event"] == "placed" and e["node_id"] == node_id), None)

        wait_until(lambda: learner_step(run) >= 2, 240, running("learner step 2"), step_s=0.2)
        second = cluster.add_node(num_cpus=2, resources={"rollout_node": 2})
        joiner = wait_until(lambda: placed_on(second.node_id), 120, running("a worker on the added node"), step_s=0.2)
        wait_until(lambda: f"worker {joiner} joined" in (run / "logs" / "learner.log").read_text(), 120,
                   running(f"{joiner} joining the learner"), step_s=0.2)
        wait_until(lambda: any(g["worker"] == joiner for g in read_records(run)), 120,
                   running(f"a group of {joiner} trained"), step_s=0.2)
        cluster.remove_node(first, allow_graceful=False)
        removed = wait_until(lambda: next((e for e in events(run) if e["event"] == "node_removed"), None), 120,
                             running("the first node's workers removed"), step_s=0.2)
        step = learner_step(run)
        wait_until(lambda: learner_step(run) >= step + 2, 120, running("2 steps after the removal"), step_s=0.2)
        driver.send_signal(signal.SIGINT)  # as Ctrl-C
        assert driver.wait(120) == 130, (tmp_path / "driver.log").read_text()[-3000:]
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        finally:
            ray.shutdown()
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        cluster.shutdown()
    names = {node.node_id: f"worker-{node.node_id[:8]}-0" for node in (first, second)}
    placed = {e["name"]: e["node_id"] for e in events(run) if e["event"] == "placed"}
    assert placed == {"learner": head, **{name: node for node, name in names.items()}}
    added = {e["node_id"]: e["workers"] for e in events(run) if e["event"] == "node_added"}
    assert added == {node: [name] for node, name in names.items()} and joiner == names[second.node_id]
    assert removed["node_id"] == first.node_id and removed["workers"] == [names[first.node_id]]
    groups = read_records(run)
    assert sum(g["worker"] == joiner for g in groups) >= 1
    assert len({(g["worker"], g["group_id"]) for g in groups}) == len(groups)  # none trained twice
    summary = json.loads((run / "summary.json").read_text())
    rollouts, launcher = summary["rollouts"], summary["launcher"]
    assert rollouts_lost(rollouts) == 0, rollouts
    assert summary["worker_restarts"] == {} and launcher["given_up"] == {}, summary
    assert launcher["nodes_added"] == [second.node_id] and launcher["workers_removed"] == [names[first.node_id]]
    assert alive == []
    wait_until(lambda: processes_of(run) == [], 30, lambda: processes_of(run))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1): a node in "
                    "its own mount namespace")
def test_a_node_that_does_not_share_the_run_dir_has_its_metrics_and_logs_gathered(tmp_path):
    """A node started by `ray start` in its own mount and PID namespaces, where the run dir's folder is a fresh
    tmpfs, holds every process of the run (the head holds no CPU): they write into that node's run dir, and the
    driver gathers the metrics (its progress), the logs and the summary into its own; checkpoints and the
    policy stay on the node."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    private = tmp_path / "node"
    private.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    node = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
                             "--kill-child=SIGKILL", "--", "sh", "-c", f"mount -t tmpfs tmpfs {private} && exec "
                             f"{sys.executable} -m ray.scripts.scripts start --address={cluster.address} "
                             "--num-cpus=4 --block --disable-usage-stats"],
                            stdout=(tmp_path / "node.log").open("wb"), stderr=subprocess.STDOUT, env=ENV)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 120, "the second node")
        finally:
            ray.shutdown()
        out = run_cli("train", "--config", str(run_config(tmp_path, "node/run", 2)), "--mode", "sync", "--launcher",
                      "ray", "--address", cluster.address, "cluster.ray.start_timeout_s=60")
    finally:
        node.kill()
        node.wait()
        cluster.shutdown()
    assert out.returncode == 0, out.stdout + out.stderr + (tmp_path / "node.log").read_text()[-2000:]
    run = private / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["launcher"]["shared_run_dir"] is False
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2]
    assert "learner done" in (run / "logs" / "learner.log").read_text()
    for name in ("worker-0", "worker-1"):
        assert "ended the run" in (run / "logs" / f"{name}.log").read_text()
    assert not (run / "checkpoints").exists() and not (run / "policy").exists()  # on the node's own disk
    assert "held-out greedy success" in out.stdout


def test_a_resource_no_node_has_is_refused_before_anything_starts(tmp_path):
    out = run_cli("train", "--config", str(run_config(tmp_path, "run", 2)), "--launcher", "ray",
                  "cluster.worker.resources.gpu_node=1", timeout=180)
    assert out.returncode == 2
    assert "cannot place a rollout worker (cluster.worker), which asks for CPU=1, gpu_node=1: no node has " \
           "resource 'gpu_node'" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()


def test_no_cluster_at_the_address_is_said_at_once(tmp_path):
    with socket.socket() as bound:  # bound, not listening: a connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        began = time.monotonic()
        out = run_cli("train", "--config", str(run_config(tmp_path, "run", 2)), "--launcher", "ray", "--address",
                      address, timeout=120)
    assert out.returncode == 2 and f"no Ray cluster at {address}: Connection refused" in out.stderr, out.stderr
    assert time.monotonic() - began < 60


def test_an_address_without_the_ray_launcher_is_refused(tmp_path):
    out = run_cli("train", "--address", "auto", "--dry-run")
    assert out.returncode == 2 and "add --launcher ray" in out.stderr


def test_without_ray_installed_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(HeteroRLError, match=r"pip install 'heterorl\[ray\]'"):
        ray_launcher.train_on_ray(load_config(text=f"logging: {{run_dir: {tmp_path}/run}}"))


def test_one_machine_settings_and_a_spread_resharding_learner_are_refused():
    devices = load_config(overrides=['runtime.worker_devices=["0"]'])
    with pytest.raises(HeteroRLError, match="cluster.worker.num_gpus"):
        ray_launcher._refuse_one_machine_settings(devices)
    spread = load_config(overrides=["runtime.learner_ranks=2", "runtime.learner_sharding=fsdp",
                                    "cluster.ray.placement=SPREAD"])
    with pytest.raises(HeteroRLError, match="STRICT_PACK or runtime.weights_fanout=gather"):
        ray_launcher._refuse_one_machine_settings(spread)
    ray_launcher._refuse_one_machine_settings(load_config(overrides=["runtime.learner_ranks=2",
                                                                     "cluster.ray.placement=SPREAD"]))


def node(**resources) -> dict:
    return {"Alive": True, "Resources": {"CPU": 4.0, "memory": 8 * 2**30, **resources}}


def test_check_resources_names_what_no_node_has():
    two_ranks = load_config(overrides=["runtime.learner_ranks=2", "cluster.learner.num_gpus=1"])
    check_resources([node(GPU=2.0)], two_ranks)  # STRICT_PACK: both ranks' GPUs on one node
    with pytest.raises(HeteroRLError, match="the learner's 2 rank\\(s\\) on one node .*GPU=2: no node has that much"):
        check_resources([node(GPU=1.0), node(GPU=1.0)], two_ranks)
    spread = load_config(overrides=["runtime.learner_ranks=2", "cluster.learner.num_gpus=1",
                                    "cluster.ray.placement=SPREAD"])
    check_resources([node(GPU=1.0), node(GPU=1.0)], spread)  # one rank a node
    labelled = load_config(overrides=["cluster.worker.resources.rollout_node=1"])
    with pytest.raises(HeteroRLError, match="no node has resource 'rollout_node'"):
        check_resources([node(), {**node(rollout_node=1.0), "Alive": False}], labelled)  # a dead node does not count
    check_resources([node(), node(rollout_node=1.0)], labelled)
    with pytest.raises(HeteroRLError, match="CPU=1, memory=32 GiB: no node has that much of it .* CPU=4, memory=8 GiB"):
        check_resources([node()], load_config(overrides=["cluster.worker.memory_gib=32"]))


def test_elastic_workers_go_to_every_alive_node_that_can_hold_one():
    cfg = load_config(overrides=["cluster.worker.resources.rollout_node=1", "cluster.worker.num_cpus=2"])
    nodes = [{**node(learner_node=1.0), "NodeID": "head"}, {**node(rollout_node=2.0), "NodeID": "rollout"},
             {**node(rollout_node=1.0), "NodeID": "dead", "Alive": False},
             {**node(rollout_node=1.0, CPU=1.0), "NodeID": "small"}]
    assert list(fitting_nodes(nodes, cfg)) == ["rollout"]
