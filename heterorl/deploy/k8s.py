"""`heterorl deploy k8s`: one run as Kubernetes objects (docs/DEPLOY.md, "Kubernetes").

A ConfigMap holds the run config; the learner is a Job of one pod (a new pod only once the old one has ended:
its volume is ReadWriteOnce; complete when the run is) behind a Service with the control port and the weights
port (port + 1), its run dir on a PersistentVolumeClaim so that a pod started again resumes from the last
checkpoint; the rollout workers are a
Deployment or a Job (cluster.k8s.workers_as) per class of workers (`worker_classes`: an engine and a throttle),
each pod a worker whose id is its pod's name. The CurveZMQ keys are Secrets made from files (`secret_commands`),
never written into the manifests. Pure: `render_k8s` returns the manifests as dicts."""

from __future__ import annotations

import copy
import math
import re
import shlex

import yaml

from heterorl.config import Config
from heterorl.deploy.processes import (
    check_deployable,
    learner_command,
    number,
    run_config_text,
    shell_command,
    shell_word,
    whole_gpus,
    worker_arguments,
    worker_classes,
)
from heterorl.errors import ConfigError
from heterorl.runtime.checkpoints import CHECKPOINTS, LEARNER_STATE

MANIFESTS = "manifests.yaml"
CONFIG_DIR, KEYS_DIR, RUN_DIR = "/etc/heterorl/config", "/etc/heterorl/keys", "/var/lib/heterorl/run"
RUN_CONFIG = "run.yaml"
# a learner whose run finished wrote this into its summary.json (`serve_learner`: it was not stopped)
FINISHED = '"stopped_by": null'
LEARNER_RESTARTS = 6  # the learner Job's backoffLimit: its pod's failures before the Job fails
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def render_k8s(cfg: Config) -> list[dict]:
    """The run's manifests: ConfigMap, PersistentVolumeClaim, Service, the learner's Job, then one worker
    Deployment or Job per class of workers."""
    check_deployable(cfg, "k8s")
    if (cfg.runtime.learner_ranks > 1 and cfg.runtime.learner_sharding == "fsdp"
            and cfg.runtime.weights_fanout == "reshard"):
        raise ConfigError("config key `runtime.weights_fanout` = 'reshard': a resharding learner's ranks > 0 bind "
                          "free ports, which the learner's Service cannot name; set runtime.weights_fanout=gather")
    shell_word("cluster.keys", cfg.cluster.keys)
    k8s = cfg.cluster.k8s
    return [
        _object("v1", "ConfigMap", f"{k8s.name}-config", cfg, "learner", data={RUN_CONFIG: _run_config(cfg)}),
        _object("v1", "PersistentVolumeClaim", f"{k8s.name}-run", cfg, "learner", spec={
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": _gib(k8s.run_dir_gib)}},
            **({"storageClassName": k8s.storage_class} if k8s.storage_class else {})}),
        _object("v1", "Service", f"{k8s.name}-learner", cfg, "learner", spec={
            "selector": _labels(cfg, "learner"),
            "ports": [{"name": "control", "port": cfg.cluster.port, "targetPort": "control"},
                      {"name": "weights", "port": cfg.cluster.port + 1, "targetPort": "weights"}]}),
        _learner(cfg),
        *_workers(cfg),
    ]


def manifests_text(cfg: Config, manifests: list[dict]) -> str:
    """The manifests as one YAML file, a comment on top."""
    k8s = cfg.cluster.k8s
    header = (f"# Rendered by `heterorl deploy k8s`, for namespace {k8s.namespace}: the learner (Job and "
              f"Service\n# {k8s.name}-learner, its run dir on the PersistentVolumeClaim {k8s.name}-run) and "
              f"{cfg.runtime.workers} rollout worker(s) ({k8s.workers_as}).\n"
              f"# The CurveZMQ keys come from the Secrets {k8s.name}-learner-keys and {k8s.name}-worker-keys, made "
              "from key files\n# before this is applied (`heterorl deploy k8s` prints the commands; docs/DEPLOY.md, "
              "\"Kubernetes\").\n")
    return header + "".join("---\n" + yaml.dump(m, Dumper=_Dumper, sort_keys=False, width=120) for m in manifests)


def key_commands(cfg: Config) -> list[str]:
    """The commands that make the run's key files in cluster.keys: the learner's pair and one worker pair that
    every worker pod holds."""
    keys = cfg.cluster.keys
    return [f"heterorl keys --name learner --out {keys}", f"heterorl keys --name worker --out {keys}"]


def secret_commands(cfg: Config) -> list[str]:
    """The commands that make the two Secrets from the key files: the learner's (its secret key and the workers'
    public key) and the workers' (their pair's secret key and the learner's public key)."""
    k8s, keys = cfg.cluster.k8s, cfg.cluster.keys
    return [f"kubectl create secret generic {k8s.name}-{who}-keys --namespace {k8s.namespace} "
            f"--from-file={keys}/{secret} --from-file={keys}/{public}"
            for who, secret, public in (("learner", "learner.key_secret", "worker.key"),
                                        ("worker", "worker.key_secret", "learner.key"))]


def _run_config(cfg: Config) -> str:
    """The run config the learner reads: its run dir on its volume, and transport.max_ids_per_key raised to cover
    the worker pods, which share one key and come back under new ids."""
    deployed = copy.deepcopy(cfg)
    deployed.logging.run_dir = RUN_DIR
    deployed.transport.max_ids_per_key = max(cfg.transport.max_ids_per_key, 2 * cfg.runtime.workers)
    note = (f"# logging.run_dir: the learner's volume (PersistentVolumeClaim {cfg.cluster.k8s.name}-run).\n"
            "# transport.max_ids_per_key: at least 2 x runtime.workers. Every worker pod holds the one worker key,\n"
            "# and its id is its pod's name: a pod replaced comes back under a new id while the old one may stay in\n"
            "# the learner's registry for up to transport.worker_expiry_s, and the key must hold both.\n")
    return run_config_text(deployed, "k8s", note)


def _labels(cfg: Config, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "heterorl", "app.kubernetes.io/instance": cfg.cluster.k8s.name,
            "app.kubernetes.io/component": component}


def _object(api: str, kind: str, name: str, cfg: Config, component: str, **body) -> dict:
    return {"apiVersion": api, "kind": kind,
            "metadata": {"name": name, "namespace": cfg.cluster.k8s.namespace, "labels": _labels(cfg, component)},
            **body}


def _gib(gib: float) -> str:
    return f"{int(gib)}Gi" if float(gib).is_integer() else f"{math.ceil(gib * 1024)}Mi"


def _resources(resources, processes: int, key: str) -> dict:
    """Requests and limits alike (the pod's QoS class is Guaranteed) for ``processes`` of ``resources``."""
    amounts = {}
    cpus = resources.num_cpus * processes
    if cpus:
        amounts["cpu"] = str(round(cpus)) if math.isclose(cpus, round(cpus)) else f"{math.ceil(cpus * 1000)}m"
    if resources.memory_gib is not None:
        amounts["memory"] = _gib(resources.memory_gib * processes)
    gpus = whole_gpus(f"{key}.num_gpus", resources.num_gpus, "Kubernetes") * processes
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": amounts, "limits": dict(amounts)} if amounts else {}


def _node_selector(resources, key: str) -> dict:
    """cluster.*.resources' names as node labels whose value is "true" (their amounts mean nothing here)."""
    for name in resources.resources:
        if not _LABEL_KEY.fullmatch(name):
            raise ConfigError(f"config key `{key}.resources.{name}`: Kubernetes takes it as a node label "
                              "(nodeSelector), whose key is [PREFIX/]NAME: letters, digits, '-', '_', '.'")
    return {"nodeSelector": {name: "true" for name in resources.resources}} if resources.resources else {}


def _keys_volume(secret: str, items: list[tuple[str, str]]) -> dict:
    return {"name": "keys", "secret": {"secretName": secret, "defaultMode": 0o400,
                                       "items": [{"key": key, "path": path} for key, path in items]}}


def _container(cfg: Config, name: str, image: str, command: list[str], resources: dict, **more) -> dict:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "WANDB_SILENT", "value": "true"}]
    return {"name": name, "image": image, "imagePullPolicy": cfg.cluster.k8s.image_pull_policy, "command": command,
            "env": env + more.pop("env", []), **({"resources": resources} if resources else {}), **more}


def _learner_script(cfg: Config) -> str:
    """The learner pod's shell: a finished run stays finished (the Job completes); a run with a checkpoint
    resumes; else it starts."""
    command = [shlex.quote(word) for word in learner_command(cfg, f"{CONFIG_DIR}/{RUN_CONFIG}", KEYS_DIR)]
    return (f'if grep -qs \'{FINISHED}\' {RUN_DIR}/summary.json; then\n'
            f'  echo "heterorl: the run in {RUN_DIR} has finished; copy it off the volume (docs/DEPLOY.md)"\n'
            "  exit 0\n"
            "fi\n"
            "resume=\n"
            f"if [ -f {RUN_DIR}/{CHECKPOINTS}/{LEARNER_STATE} ]; then resume=--resume; fi\n"
            f"{shell_command(['exec', *command, '$resume'])}\n")


def _learner(cfg: Config) -> dict:
    k8s, port, ranks = cfg.cluster.k8s, cfg.cluster.port, cfg.runtime.learner_ranks
    labels = _labels(cfg, "learner")
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
              {"name": "run", "mountPath": RUN_DIR}]
    volumes = [{"name": "config", "configMap": {"name": f"{k8s.name}-config"}},
               _keys_volume(f"{k8s.name}-learner-keys", [("learner.key_secret", "learner.key_secret"),
                                                         ("worker.key", "allowed/worker.key")]),
               {"name": "run", "persistentVolumeClaim": {"claimName": f"{k8s.name}-run"}}]
    if ranks > 1:  # the ranks' collectives share memory through /dev/shm, 64 MiB in a container by default
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    container = _container(cfg, "learner", k8s.image, ["/bin/sh", "-c", _learner_script(cfg)],
                           _resources(cfg.cluster.learner, ranks, "cluster.learner"),
                           ports=[{"name": "control", "containerPort": port},
                                  {"name": "weights", "containerPort": port + 1}],
                           volumeMounts=mounts)
    pod = {"terminationGracePeriodSeconds": 120,  # SIGTERM: the learner checkpoints after its step in progress
           **_node_selector(cfg.cluster.learner, "cluster.learner"), "containers": [container], "volumes": volumes}
    # a Job: done when the run is (no pod left sleeping); a failed learner is started again in place (OnFailure)
    # or on another node, up to LEARNER_RESTARTS times, each resuming from the volume's last checkpoint
    return _object("batch/v1", "Job", f"{k8s.name}-learner", cfg, "learner", spec={
        "completions": 1, "parallelism": 1, "backoffLimit": LEARNER_RESTARTS,
        "podReplacementPolicy": "Failed",  # a new pod only once the old one has ended (the volume is ReadWriteOnce)
        "template": {"metadata": {"labels": labels}, "spec": {**pod, "restartPolicy": "OnFailure"}}})


def _workers(cfg: Config) -> list[dict]:
    k8s, classes = cfg.cluster.k8s, worker_classes(cfg)
    objects, seen = [], []
    for worker_class in classes:
        # heterorl-worker; with several classes heterorl-worker-torch, -vllm, then -torch-2 for a second torch class
        seen.append(worker_class.engine)
        repeat = seen.count(worker_class.engine)
        suffix = "" if len(classes) == 1 else f"-{worker_class.engine}" + (f"-{repeat}" if repeat > 1 else "")
        name = f"{k8s.name}-worker{suffix}"
        labels = {**_labels(cfg, "worker"), "heterorl/workers": name}
        image = k8s.vllm_image if worker_class.engine == "vllm" and k8s.vllm_image else k8s.image
        command = ["heterorl", *worker_arguments(
            f"tcp://{k8s.name}-learner.{k8s.namespace}.svc:{cfg.cluster.port}", "$(POD_NAME)", worker_class.engine,
            number(worker_class.throttle), f"{KEYS_DIR}/worker.key_secret", f"{KEYS_DIR}/learner.key")]
        container = _container(cfg, "worker", image, command, _resources(cfg.cluster.worker, 1, "cluster.worker"),
                               env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                               volumeMounts=[{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}])
        pod = {"restartPolicy": "Always" if k8s.workers_as == "Deployment" else "OnFailure",
               **_node_selector(cfg.cluster.worker, "cluster.worker"), "containers": [container],
               "volumes": [_keys_volume(f"{k8s.name}-worker-keys", [("worker.key_secret", "worker.key_secret"),
                                                                    ("learner.key", "learner.key")])]}
        template = {"metadata": {"labels": labels}, "spec": pod}
        if k8s.workers_as == "Deployment":
            spec = {"replicas": worker_class.count, "selector": {"matchLabels": labels}, "template": template}
        else:  # a worker that fails is started again, runtime.worker_restarts times per worker in all
            spec = {"parallelism": worker_class.count, "completions": worker_class.count,
                    "backoffLimit": worker_class.count * cfg.runtime.worker_restarts, "template": template}
        objects.append(_object("apps/v1" if k8s.workers_as == "Deployment" else "batch/v1", k8s.workers_as, name,
                               cfg, "worker", spec=spec))
    return objects


class _Dumper(yaml.SafeDumper):
    """Writes a string of several lines (the run config, the learner's shell) as a literal block, and a mapping
    used twice (a selector's labels, a pod's) twice rather than as an anchor and an alias."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))
