"""`heterorl train --launcher ray`: the learner's ranks and the rollout workers as Ray actors (docs/DEPLOY.md).

The driver (this process) connects to a Ray cluster (``--address``, ``cluster.ray.address``) or starts a local
one, checks before anything starts that some node can hold each process's resources (``cluster.learner``,
``cluster.worker``), makes the run's CurveZMQ keys, reserves a placement group with one bundle per learner rank
(``cluster.ray.placement``), starts the ranks (`LearnerRank`), waits for rank 0's address (a free port on its
node) and starts ``runtime.workers`` rollout workers (`RolloutWorker`, scheduled SPREAD, restarted by Ray up to
``cluster.ray.max_restarts`` times) — or, elastic (``cluster.ray.workers_per_node``), that many on every node that
can hold one, each worker's key allowed by the learner as it starts. It then follows the run: progress from the
learner's metrics, workers restarted or given up, the learner's exit; elastic, nodes added to the cluster get
their workers and the workers of a node gone are removed. Logs and metrics land in the driver's run dir: written
there when the nodes share it, gathered from the nodes when they do not. Whatever ends the run, every actor is
stopped and killed, the placement group removed, and a local Ray shut down.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from heterorl.addresses import parse_host_port
from heterorl.config import Config, to_yaml, worker_command_word
from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically
from heterorl.runs import keep_metrics_until
from heterorl.runtime import launch
from heterorl.runtime.launch import METRICS, worker_argv, worker_engine

POLL_S = 0.5  # between looks at the learner and the workers
SCALE_S = 2.0  # between looks at the cluster's nodes (elastic: cluster.ray.workers_per_node)
GATHER_S = 2.0  # between gathers of the nodes' logs, when the run dir is not shared
# the driver's variables the nodes get (PYTHONPATH: a task of your own, task.name=pkg.mod:Class, imports there too)
PASSED_ENV = ("WANDB_", "HF_", "TRANSFORMERS_", "HETERORL_", "TOKENIZERS_", "PYTHONPATH")


def _import_ray():
    try:
        import ray
    except ImportError:
        raise HeteroRLError("--launcher ray needs Ray, which is not installed here: pip install 'heterorl[ray]' "
                            "(the same version on every node of the cluster)") from None
    return ray


def _refuse_one_machine_settings(cfg: Config) -> None:
    if cfg.runtime.learner_devices or cfg.runtime.worker_devices:
        raise HeteroRLError("runtime.learner_devices / runtime.worker_devices pick GPUs on one machine; under Ray "
                            "ask for them with cluster.learner.num_gpus / cluster.worker.num_gpus (Ray sets each "
                            "process's CUDA_VISIBLE_DEVICES)")
    resharding = cfg.runtime.learner_sharding == "fsdp" and cfg.runtime.weights_fanout == "reshard"
    if cfg.runtime.learner_ranks > 1 and resharding and cfg.cluster.ray.placement != "STRICT_PACK":
        raise HeteroRLError(f"cluster.ray.placement={cfg.cluster.ray.placement} may put the learner's ranks on "
                            "several nodes, but a resharding learner's ranks serve their slices from rank 0's host: "
                            "use cluster.ray.placement=STRICT_PACK or runtime.weights_fanout=gather")


def _demand(resources, ranks: int = 1) -> dict[str, float]:
    """The Ray resources ``ranks`` processes of one kind ask for (zeros left out; memory in bytes)."""
    demand = {"CPU": resources.num_cpus * ranks, "GPU": resources.num_gpus * ranks,
              "memory": (resources.memory_gib or 0) * 2**30 * ranks,
              **{name: amount * ranks for name, amount in resources.resources.items()}}
    return {name: amount for name, amount in demand.items() if amount}


def _shown(demand: dict[str, float]) -> str:
    return ", ".join(f"{name}={amount / 2**30:g} GiB" if name == "memory" else f"{name}={amount:g}"
                     for name, amount in sorted(demand.items()))


def _holds(node: dict, demand: dict[str, float]) -> bool:
    """Whether a node of `ray.nodes()` has, in all, what ``demand`` asks for (whatever it runs now)."""
    return all(node["Resources"].get(name, 0) >= amount for name, amount in demand.items())


def fitting_nodes(nodes: list[dict], cfg: Config) -> dict[str, dict]:
    """The alive nodes of ``nodes`` (`ray.nodes()`) that can hold a rollout worker (``cluster.worker``, its custom
    resources included), by node id: where elastic workers go."""
    demand = _demand(cfg.cluster.worker)
    return {node["NodeID"]: node for node in nodes if node.get("Alive") and _holds(node, demand)}


def _keypairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """A CurveZMQ key pair for each name: {name: (public text, secret text)}."""
    from heterorl.transport import make_keypair

    with tempfile.TemporaryDirectory() as folder:
        return {name: tuple(path.read_text() for path in make_keypair(folder, name)) for name in names}


def check_resources(nodes: list[dict], cfg: Config) -> None:
    """HeteroRLError, naming what is missing, when no alive node of ``nodes`` (`ray.nodes()`) could ever hold a
    rollout worker, or the learner's ranks (all on one node under STRICT_PACK, one each otherwise)."""
    alive = [node for node in nodes if node.get("Alive")]
    pack = cfg.cluster.ray.placement == "STRICT_PACK"
    wants = [("a rollout worker (cluster.worker)", _demand(cfg.cluster.worker)),
             (f"the learner's {cfg.runtime.learner_ranks} rank(s) on one node (cluster.learner, STRICT_PACK)"
              if pack else "a learner rank (cluster.learner)",
              _demand(cfg.cluster.learner, cfg.runtime.learner_ranks if pack else 1))]
    for who, demand in wants:
        if any(_holds(node, demand) for node in alive):
            continue
        missing = [name for name in demand if not any(name in node["Resources"] for node in alive)]
        have = "; ".join(_shown({k: v for k, v in node["Resources"].items()
                                 if not k.startswith("node:") and k != "object_store_memory"}) for node in alive)
        what = (f"no node has resource {', '.join(map(repr, missing))}" if missing else
                "no node has that much of it")
        raise HeteroRLError(f"the Ray cluster cannot place {who}, which asks for "
                            f"{_shown(demand)}: {what} (its {len(alive)} "
                            f"node(s) have: {have or 'nothing'}). Start nodes with it (`ray start "
                            "--resources='{\"NAME\": N}'`) or change the cluster section of the config")


class _Files:
    """The run dir's files the driver keeps: read where they are when the nodes share the run dir, else
    gathered from the actor that writes each (appended from where the last gather stopped)."""

    def __init__(self, ray, run_dir: Path) -> None:
        self.ray, self.run_dir, self.shared = ray, run_dir, True
        self._offsets: dict[str, int] = {}

    def gather(self, actor, relative: str, whole: bool = False) -> None:
        """Bring ``relative`` up to date from ``actor``'s node: appended from where the last gather stopped, or,
        the first time (or ``whole``), written afresh from the node's whole file (a resumed run's included)."""
        if self.shared:
            return
        offset = 0 if whole else self._offsets.get(relative, 0)
        try:
            data = self.ray.get(actor.read.remote(relative, offset), timeout=30)
        except Exception:  # a node lost or restarting: what was gathered before stays
            return
        if not data:
            return
        path = self.run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if whole:
            write_atomically(path, data)
        else:
            with path.open("ab" if offset else "wb") as f:
                f.write(data)
        self._offsets[relative] = offset + len(data)


class RayRun:
    """One run on a Ray cluster, from placement to the last actor killed (`run`)."""

    def __init__(self, ray, cfg: Config, *, resume: bool, progress, say=None) -> None:
        self.ray, self.cfg, self.resume, self.progress = ray, cfg, resume, progress
        self.run_dir = Path(cfg.logging.run_dir)
        self.per_node = cfg.cluster.ray.workers_per_node  # None: the fixed fleet below; N: elastic
        self.names = [] if self.per_node else [f"worker-{i}" for i in range(cfg.runtime.workers)]
        self.files = _Files(ray, self.run_dir)
        self.events = (self.run_dir / "logs" / "ray_events.jsonl")
        self.ranks: list = []
        self.workers: dict[str, object] = {}
        self.seen: dict[str, float] = {}  # each worker's actor start time (a new one: Ray restarted it)
        self.restarts: dict[str, int] = {}
        self.given_up: dict[str, str] = {}
        self.on_node: dict[str, list[str]] = {}  # elastic: each node's workers, while the node is alive
        self.nodes_added: list[str] = []  # elastic: the nodes that got workers after the run started
        self.removed: list[str] = []  # elastic: the workers of nodes gone (not given up: their node left)
        self.placement = None
        self._worker_spec: dict = {}
        self._endpoint = ""
        self._learner_public = ""
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    # -- placing and starting ------------------------------------------------------------------------------------
    def _spec(self, keys: dict[str, str], marker: str, files: dict[str, str] | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV)}
        return {"run_dir": str(self.run_dir), "cwd": os.getcwd(), "env": env, "marker": marker, "keys": keys,
                "files": files or {}}

    def _keys(self) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """The run's CurveZMQ keys (none when ``transport.allow_plaintext``): the learner's files, each worker's
        of the fixed fleet (an elastic worker's are made as it starts: `_allow`)."""
        if self.cfg.transport.allow_plaintext:
            return {}, {name: {} for name in self.names}
        pairs = _keypairs(["learner", *self.names])
        self._learner_public = pairs["learner"][0]
        learner = {"learner.key_secret": pairs["learner"][1],
                   **{f"allowed/{name}.key": pairs[name][0] for name in self.names}}
        return learner, {name: self._worker_key_files(name, pairs[name][1]) for name in self.names}

    def _worker_key_files(self, name: str, secret: str) -> dict[str, str]:
        return {f"{name}.key_secret": secret, "learner.key": self._learner_public}

    def _allow(self, names: list[str]) -> dict[str, dict[str, str]]:
        """Key pairs for workers that did not exist when the learner started, their public keys written into its
        allowed-keys folder (`LearnerRank.allow`; it re-reads that within ``transport.keys_reload_s``, and a worker
        refused until then dials again within its connect timeout): each worker's files."""
        if self.cfg.transport.allow_plaintext:
            return {name: {} for name in names}
        pairs = _keypairs(names)
        self.ray.get([self.ranks[0].allow.remote(name, pairs[name][0]) for name in names], timeout=30)
        return {name: self._worker_key_files(name, pairs[name][1]) for name in names}

    def _place_learner(self) -> None:
        from ray.util.placement_group import placement_group

        cluster, ranks = self.cfg.cluster, self.cfg.runtime.learner_ranks
        self.placement = placement_group([_demand(cluster.learner) or {"CPU": 0.001}] * ranks,
                                         strategy=cluster.ray.placement, name=f"{self.run_dir.name}-learner")
        try:
            self.ray.get(self.placement.ready(), timeout=cluster.ray.start_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise HeteroRLError(f"the Ray cluster did not free room for the learner's {ranks} rank(s) "
                                f"({cluster.ray.placement}, each {_shown(_demand(cluster.learner))}) within "
                                f"{cluster.ray.start_timeout_s:g} s (cluster.ray.start_timeout_s): other jobs hold "
                                "those resources") from None

    def _start_learner(self, spec: dict) -> str:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from heterorl.deploy.ray_actors import LearnerRank

        cfg, ranks = self.cfg, self.cfg.runtime.learner_ranks
        actor = self.ray.remote(LearnerRank)
        for rank in range(ranks):
            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
            name = "learner" if rank == 0 else f"learner-rank{rank}"
            self.ranks.append(actor.options(**_options(cfg.cluster.learner), max_restarts=0,
                                            scheduling_strategy=strategy)
                              .remote(name, spec if rank == 0 else {**spec, "keys": {}}, rank, ranks))
        store = self.ray.get(self.ranks[0].host_store.remote()) if ranks > 1 else None
        statuses = self.ray.get([rank.status.remote() for rank in self.ranks])
        self.files.shared = all(status["shared"] for status in statuses)
        for name, status in zip(["learner"] + [f"learner-rank{r}" for r in range(1, ranks)], statuses):
            self._event("placed", name, status)
        host = statuses[0]["ip"]
        port = parse_host_port(self.cfg.runtime.address, "runtime.address", "tcp://127.0.0.1:5555")[1]
        one_node = sum(node.get("Alive", False) for node in self.ray.nodes()) == 1
        argv = ["learner", "--config", str(self.run_dir / "train_config.yaml"), "--bind", f"tcp://{host}:{port}",
                *(["--resume"] if self.resume else []),
                # as `heterorl train`: one rank on the one machine of the run splits its cores with its workers
                *(["--share-machine"] if one_node and ranks == 1 else [])]
        self.ray.get([rank.start.remote(argv, store) for rank in self.ranks])
        self._event("started", "learner", self.ray.get(self.ranks[0].status.remote()))
        try:
            return self.ray.get(self.ranks[0].endpoint.remote(cfg.cluster.ray.start_timeout_s))
        except self.ray.exceptions.RayTaskError as exc:
            raise HeteroRLError(str(exc.cause)) from None

    def _start_workers(self, spec: dict, worker_keys: dict, endpoint: str) -> None:
        """The fixed fleet, scheduled SPREAD; elastic, ``workers_per_node`` on each node that can hold them."""
        self._worker_spec, self._endpoint = spec, endpoint
        if self.per_node:
            self._scale(mid_run=False)
        for name in self.names:
            self._start_worker(name, worker_keys[name], "SPREAD")

    def _start_worker(self, name: str, keys: dict[str, str], strategy) -> None:
        """One `RolloutWorker` actor. Its index (engine, throttle, prefix: ``runtime.engines[i % len]`` ...) is the
        count of workers started before it in this run."""
        from heterorl.deploy.ray_actors import RolloutWorker

        cfg, index = self.cfg, len(self.workers)
        engine = worker_engine(cfg, index)
        python = cfg.runtime.vllm_python if engine == "vllm" else None
        prefix = [worker_command_word(word, index, name) for word in cfg.runtime.worker_prefix]
        argv = worker_argv(cfg, index, self._endpoint, engine)
        argv[argv.index("--worker-id") + 1] = name  # (an elastic worker is named by its node, not by its index)
        options = {**_options(cfg.cluster.worker), "max_restarts": cfg.cluster.ray.max_restarts}
        self.workers[name] = self.ray.remote(RolloutWorker).options(**options, scheduling_strategy=strategy).remote(
            name, {**self._worker_spec, "keys": keys}, argv,
            None if python is None else str(Path(python).expanduser().absolute()), prefix)

    # -- elastic: a fleet that follows the cluster's nodes -------------------------------------------------------
    def _scale(self, mid_run: bool = True) -> None:
        """The workers of each node no longer alive removed; ``workers_per_node`` started on each alive node that
        can hold a worker and has none yet (a node that comes back has a new node id)."""
        nodes = self.ray.nodes()
        alive = {node["NodeID"] for node in nodes if node.get("Alive")}
        for node_id in [node_id for node_id in self.on_node if node_id not in alive]:
            self._remove_node(node_id)
        for node_id, node in fitting_nodes(nodes, self.cfg).items():
            if node_id not in self.on_node:
                self._add_node(node_id, node, mid_run)

    def _add_node(self, node_id: str, node: dict, mid_run: bool) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        names = [f"worker-{node_id[:8]}-{k}" for k in range(self.per_node)]
        try:
            keys = self._allow(names)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return  # the learner is gone or busy: `_learner_exit` tells which; else tried again at the next look
        for name in names:  # on that node only: Ray must not restart one elsewhere, where its node's workers run
            self._start_worker(name, keys[name], NodeAffinitySchedulingStrategy(node_id, soft=False))
        self.on_node[node_id] = names
        self._event("node_added", node_id, node_id=node_id, ip=node.get("NodeManagerAddress"), workers=names)
        if mid_run:
            self.nodes_added.append(node_id)
            self._say(f"heterorl train: Ray node {node_id[:12]} ({node.get('NodeManagerAddress')}) joined the "
                      f"cluster: started {', '.join(names)}")

    def _remove_node(self, node_id: str) -> None:
        """A node gone: its workers removed from the fleet and their actors killed (not left to Ray, which may
        keep an actor bound to a dead node restarting)."""
        names = self.on_node.pop(node_id)
        for name in names:
            with contextlib.suppress(Exception):
                self.ray.kill(self.workers[name], no_restart=True)
            if name not in self.given_up:
                self.removed.append(name)
        self._event("node_removed", node_id, node_id=node_id, workers=names)
        self._say(f"heterorl train: Ray node {node_id[:12]} is gone: {', '.join(names)} removed; the run goes on "
                  f"with {len(self._live())} worker(s)")

    def _node_lost(self, name: str) -> bool:
        """Whether elastic worker ``name``'s node is no longer alive (its workers are then removed, not given
        up, at the next `_scale`)."""
        node_id = next((node_id for node_id, names in self.on_node.items() if name in names), None)
        return node_id is not None and not any(node["NodeID"] == node_id and node.get("Alive")
                                               for node in self.ray.nodes())

    def _live(self) -> dict[str, object]:
        """The workers neither given up nor removed."""
        return {name: actor for name, actor in self.workers.items()
                if name not in self.given_up and name not in self.removed}

    # -- following -----------------------------------------------------------------------------------------------
    def _event(self, event: str, name: str, status: dict | None = None, **more) -> None:
        record = {"t": time.time(), "event": event, "name": name, **more}
        if status is not None:
            record.update({k: status[k] for k in ("node_id", "ip", "hostname", "pid")})
        self.events.parent.mkdir(parents=True, exist_ok=True)
        with self.events.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _check_workers(self) -> None:
        """Note the workers Ray restarted and those it gave up (all given up: HeteroRLError)."""
        ray = self.ray
        refs = {name: actor.status.remote() for name, actor in self._live().items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5)
        ready = set(ready)
        for name, ref in refs.items():
            if ref not in ready:
                continue  # restarting, or waiting for room on a node
            try:
                status = ray.get(ref)
            except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnschedulableError) as exc:
                # (unschedulable: an elastic worker's actor, bound to its node, restarted by Ray once the node died)
                if self.per_node and self._node_lost(name):
                    continue  # removed with its node by `_scale`
                self.given_up[name] = str(exc).splitlines()[0]
                self._event("given_up", name, reason=self.given_up[name])
                self._say(f"heterorl train: {name}'s actor died and Ray will not restart it (cluster.ray."
                          f"max_restarts={self.cfg.cluster.ray.max_restarts}): given up; the run goes on with "
                          f"{len(self._live())} worker(s). {self.given_up[name]}")
                continue
            except ray.exceptions.RayActorError:
                continue
            if self.seen.get(name) != status["started_at"]:
                if status["restarted"]:
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._say(f"heterorl train: Ray restarted {name} on {status['hostname']} ({status['ip']})")
                self.seen[name] = status["started_at"]
                self._event("restarted" if status["restarted"] else "placed", name, status)
        if not self.per_node and len(self.given_up) == len(self.workers):  # (elastic: nodes may come)
            raise HeteroRLError("every rollout worker's actor died and was given up; the last: "
                                f"{list(self.given_up.values())[-1]}")

    def _learner_exit(self) -> int | None:
        try:
            return self.ray.get(self.ranks[0].status.remote(), timeout=30)["exit"]
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as exc:
            raise HeteroRLError(f"the learner's actor is gone (its node lost, or Ray stopped): "
                                f"{str(exc).splitlines()[0].rstrip('.')}; "
                                f"continue the run with `heterorl train --launcher ray --resume {self.run_dir}` "
                                "(its checkpoints are on that node unless the run dir is shared)") from None

    def _follow(self) -> None:
        metrics = self.run_dir / METRICS
        seen = metrics.stat().st_size if self.files.shared and metrics.exists() else 0  # (else gathered afresh)
        gathered_at, scaled_at = 0.0, time.monotonic()
        while True:
            self.files.gather(self.ranks[0], METRICS)
            seen = launch.follow_metrics(self.run_dir / METRICS, seen, self.progress)
            if time.monotonic() - gathered_at > GATHER_S:
                self._gather_logs()
                gathered_at = time.monotonic()
            status = self._learner_exit()
            if status is not None:
                self._gather_logs()
                if status != 0:
                    tail = "\n".join((self.run_dir / "logs" / "learner.log").read_text(errors="replace")
                                     .splitlines()[-30:])
                    raise HeteroRLError(f"the learner failed (exit {status}); log {self.run_dir}/logs/learner.log "
                                        f"(on its node):\n{tail}")
                return
            if self.per_node and time.monotonic() - scaled_at > SCALE_S:
                self._scale()
                scaled_at = time.monotonic()
            self._check_workers()
            time.sleep(POLL_S)

    def _gather_logs(self) -> None:
        for name, actor in [("learner", self.ranks[0]), *self.workers.items()]:
            self.files.gather(actor, f"logs/{name}.log")

    # -- the whole run -------------------------------------------------------------------------------------------
    def run(self) -> int:
        cfg, ray = self.cfg, self.ray
        check_resources(ray.nodes(), cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_text = to_yaml(cfg)
        (self.run_dir / "train_config.yaml").write_text(config_text)
        marker = f".ray-driver-{os.getpid()}-{time.time_ns()}"
        (self.run_dir / marker).touch()
        learner_keys, worker_keys = self._keys()
        started = time.monotonic()
        reason, start_s = "the run was interrupted", None
        try:
            self._place_learner()
            endpoint = self._start_learner(self._spec(learner_keys, marker, {"train_config.yaml": config_text}))
            self._start_workers(self._spec({}, marker), worker_keys, endpoint)
            start_s = round(time.monotonic() - started, 2)
            self._follow()
            reason = "the run is over"
            self._wait_for_workers(30.0)
            return 0
        except HeteroRLError as exc:
            reason = str(exc).splitlines()[0]
            raise
        finally:
            self._stop_all(reason)
            (self.run_dir / marker).unlink(missing_ok=True)
            launch.record_restarts(self.run_dir, self.restarts, launcher={
                "name": "ray", "nodes": sum(n.get("Alive", False) for n in ray.nodes()), "start_s": start_s,
                "given_up": self.given_up, "shared_run_dir": self.files.shared, "nodes_added": self.nodes_added,
                "workers_removed": self.removed})

    def _wait_for_workers(self, timeout_s: float) -> None:
        """They leave on the learner's bye; wait for them a while."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            refs = [actor.status.remote() for actor in self._live().values()]
            try:
                if all(status["exit"] is not None for status in self.ray.get(refs, timeout=10)):
                    return
            except Exception:
                return
            time.sleep(POLL_S)

    def _stop_all(self, reason: str) -> None:
        """Stop every process with ``reason`` (the learner checkpoints on its SIGTERM), then kill every actor and
        remove the placement group: nothing of the run is left on the cluster."""
        ray = self.ray
        stopping = [actor.stop.remote(reason) for actor in self.workers.values()]
        stopping += [rank.stop.remote(reason, 60.0) for rank in self.ranks]
        with contextlib.suppress(Exception):
            ray.wait(stopping, num_returns=len(stopping), timeout=75)
        with contextlib.suppress(Exception):
            self._gather_logs()
            for relative in ("summary.json", "success.png") if self.ranks else ():  # written as the learner stops
                self.files.gather(self.ranks[0], relative, whole=True)
        for actor in [*self.workers.values(), *self.ranks]:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)


def _options(resources) -> dict:
    """A process's `ray.remote` options from its `ProcessResources`."""
    options = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
               "resources": dict(resources.resources)}
    if resources.memory_gib:
        options["memory"] = int(resources.memory_gib * 2**30)
    return options


@contextlib.contextmanager
def ray_session(ray, address: str | None, cfg: Config):
    """Connected to the cluster at ``address`` for the block, or to a local Ray started for it (logical CPUs
    enough for the run's requests: one machine is shared, as `heterorl train` shares it) and shut down after."""
    started_here = address is None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a run never reports to the network
    if not started_here:
        _probe(address)
    try:
        if started_here:
            wanted = (cfg.cluster.learner.num_cpus * cfg.runtime.learner_ranks
                      + cfg.cluster.worker.num_cpus * (cfg.cluster.ray.workers_per_node or cfg.runtime.workers))
            # "local": a Ray of its own, even where a cluster started by `ray start` runs on this machine (without
            # it, ray.init joins that one, and refuses the num_cpus given for a new one)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(wanted + 0.999)),
                     include_dashboard=False, log_to_driver=False, namespace="heterorl")
        else:
            ray.init(address=address, log_to_driver=False, namespace="heterorl")
    except ConnectionError as exc:
        raise HeteroRLError(f"no Ray cluster at {address}: {str(exc).rstrip('.')}. Start one (`ray start --head`) "
                            "and pass its address, or leave --address out to start a local one") from None
    try:
        yield
    finally:
        ray.shutdown()


def _probe(address: str) -> None:
    """HeteroRLError at once when nothing listens at a HOST:PORT address (Ray itself retries for minutes)."""
    if address == "auto" or ":" not in address:
        return
    host, port = parse_host_port(address, "--address", "HEAD:6379 (the head's GCS port), ray://HEAD:10001 or auto")
    try:
        socket.create_connection((host.strip("[]"), port), timeout=5).close()
    except OSError as exc:
        raise HeteroRLError(f"no Ray cluster at {address}: {exc.strerror or exc}. Start one (`ray start --head`) "
                            "and pass its address, or leave --address out to start a local one") from None


def train_on_ray(cfg: Config, *, address: str | None = None, resume: bool = False, progress=None) -> int:
    """`heterorl train --launcher ray`: the run on the Ray cluster at ``address`` (else ``cluster.ray.address``,
    else a local Ray). Same config, same processes as `heterorl.runtime.launch.train`."""
    if cfg.runtime.execution == "simulated":
        raise HeteroRLError("runtime.execution=simulated runs in this process: drop --launcher ray")
    ray = _import_ray()
    _refuse_one_machine_settings(cfg)
    cfg.logging.run_dir = str(Path(cfg.logging.run_dir).absolute())  # the same path on every node
    run_dir = Path(cfg.logging.run_dir)
    if not resume:  # a run to resume may be on the learner's node alone: the learner looks for its checkpoint
        launch.check_run_dir(run_dir, resume)
    else:
        step = launch.checkpoint_step(run_dir)
        if step is not None:
            keep_metrics_until(run_dir / METRICS, step)
    with ray_session(ray, address or cfg.cluster.ray.address or os.environ.get("RAY_ADDRESS"), cfg):
        return RayRun(ray, cfg, resume=resume, progress=progress).run()
