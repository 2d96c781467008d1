"""The ``cluster`` section of a run's config: what each process asks a cluster engine for, and each engine's own
settings (docs/DEPLOY.md). Held as ``Config.cluster``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Optional

from heterorl.config.checks import fail

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass
class ProcessResources:
    """What one process asks its engine for: a learner rank (``cluster.learner``) or a rollout worker
    (``cluster.worker``)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_gib: Optional[float] = None  # None: not declared (Ray: no memory reservation; k8s: no request)
    # Ray custom resources the process needs, e.g. {rollout_node: 1} to run only on nodes started with
    # `ray start --resources='{"rollout_node": 4}'`; the Kubernetes renderer makes them a nodeSelector's labels
    resources: Dict[str, float] = field(default_factory=dict)

    def validate(self, key: str) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            fail(f"{key}.num_cpus/num_gpus", (self.num_cpus, self.num_gpus), "must be >= 0")
        if self.memory_gib is not None and not self.memory_gib > 0:
            fail(f"{key}.memory_gib", self.memory_gib, "must be > 0 (or null: not declared)")
        for name, amount in self.resources.items():
            if not isinstance(amount, (int, float)) or amount <= 0:
                fail(f"{key}.resources.{name}", amount, "must be a number > 0 (how much of that resource)")


@dataclass
class RayConfig:
    """`heterorl train --launcher ray`."""

    address: Optional[str] = None  # a running cluster ("auto", HOST:6379, ray://HOST:10001); None: a local Ray
    placement: str = "STRICT_PACK"  # the placement group strategy of the learner's ranks (one bundle per rank)
    max_restarts: int = 3  # Ray restarts a rollout worker's actor this many times (-1: without limit)
    start_timeout_s: float = 120.0  # the learner's placement and its first listening line, each within this
    # None: runtime.workers workers, scheduled SPREAD. N: elastic, N workers on every alive node that can hold
    # cluster.worker (nodes added to the cluster mid-run included; a node lost takes its workers with it), and
    # runtime.workers is only how many the learner waits for at its start
    workers_per_node: Optional[int] = None

    def validate(self, key: str) -> None:
        if self.placement not in PLACEMENT_STRATEGIES:
            fail(f"{key}.placement", self.placement, f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")
        if self.max_restarts < -1:
            fail(f"{key}.max_restarts", self.max_restarts, "must be >= -1 (-1: without limit, 0: never)")
        if not self.start_timeout_s > 0:
            fail(f"{key}.start_timeout_s", self.start_timeout_s, "must be > 0")
        if self.workers_per_node is not None and self.workers_per_node < 1:
            fail(f"{key}.workers_per_node", self.workers_per_node,
                 "must be >= 1 (workers on each node), or null for a fixed fleet of runtime.workers")


@dataclass
class SlurmConfig:
    """`heterorl deploy slurm`: the sbatch script's header and environment."""

    partition: Optional[str] = None  # None: the cluster's default partition
    account: Optional[str] = None
    time: str = "04:00:00"  # the job's wall-clock limit (sbatch --time)
    venv: str = ".venv"  # a virtual environment with heterorl, at the same path on every node (activated first)

    def validate(self, key: str) -> None:
        if not re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", self.time):
            fail(f"{key}.time", self.time, 'give an sbatch time: "MINUTES", "HH:MM:SS" or "DAYS-HH:MM:SS"')


@dataclass
class K8sConfig:
    """`heterorl deploy k8s`: the manifests' names and image."""

    name: str = "heterorl"  # the prefix of every object's name (a DNS label)
    namespace: str = "default"
    image: str = "heterorl:0.1.0"  # an image with heterorl installed (docs/DEPLOY.md says how to build one)
    image_pull_policy: str = "IfNotPresent"
    workers_as: str = "Deployment"  # Deployment (kept at runtime.workers replicas) or Job (runtime.workers pods)
    # the image of vLLM workers (runtime.engines), which need vLLM beside heterorl; None: `image`
    vllm_image: Optional[str] = None
    run_dir_gib: float = 10.0  # the learner's run dir: a PersistentVolumeClaim of this size (checkpoints, logs)
    storage_class: Optional[str] = None  # that claim's storageClassName; None: the cluster's default class

    def validate(self, key: str) -> None:
        if not self.run_dir_gib > 0:
            fail(f"{key}.run_dir_gib", self.run_dir_gib, "must be > 0 (GiB of the learner's run-dir volume)")
        for field_name in ("name", "namespace"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or len(value) > 40 or not _DNS_LABEL.fullmatch(value):
                fail(f"{key}.{field_name}", value, "must be a DNS label of at most 40 characters: lower-case "
                      "letters, digits and '-', starting and ending with a letter or digit")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            fail(f"{key}.image_pull_policy", self.image_pull_policy, "must be one of Always, IfNotPresent, Never")
        if self.workers_as not in ("Deployment", "Job"):
            fail(f"{key}.workers_as", self.workers_as, "must be Deployment or Job")


@dataclass
class ClusterConfig:
    """How a run is placed on a cluster engine (docs/DEPLOY.md). On one machine (`heterorl train`) it is unused."""

    learner: ProcessResources = field(default_factory=ProcessResources)  # per learner rank
    worker: ProcessResources = field(default_factory=ProcessResources)  # per rollout worker
    port: int = 5555  # the learner's control port where an engine needs a fixed one (Slurm, k8s); weights: port + 1
    keys: str = "keys"  # CurveZMQ keys: Slurm reads them from this shared path; k8s makes Secrets of them
    ray: RayConfig = field(default_factory=RayConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)

    def validate(self, key: str = "cluster") -> None:
        self.learner.validate(f"{key}.learner")
        self.worker.validate(f"{key}.worker")
        if not 1 <= self.port <= 65534:
            fail(f"{key}.port", self.port, "must be in 1..65534 (the weights channel takes port + 1)")
        self.ray.validate(f"{key}.ray")
        self.slurm.validate(f"{key}.slurm")
        self.k8s.validate(f"{key}.k8s")
