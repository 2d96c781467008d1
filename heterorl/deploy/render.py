"""`heterorl deploy slurm|k8s CONFIG`: a run's cluster files written into a folder, and what to run first (the keys)
and then (the one command that launches the run). The renderers are pure (heterorl/deploy/slurm.py,
heterorl/deploy/k8s.py); this module writes their files and prints. docs/DEPLOY.md."""

from __future__ import annotations

from pathlib import Path

from heterorl.config import Config
from heterorl.deploy import k8s, slurm
from heterorl.errors import HeteroRLError

TARGETS = ("slurm", "k8s")


def default_out(target: str, config: str) -> Path:
    """runs/deploy/TARGET/NAME, NAME the config file's name without its suffix."""
    return Path("runs") / "deploy" / target / Path(config).stem


def render(target: str, cfg: Config, out: str) -> dict[str, str]:
    """{file name: text} of ``target``'s files for ``cfg``, to be written into the folder ``out``."""
    if target == "slurm":
        return slurm.render_slurm(cfg, out)
    if target == "k8s":
        return {k8s.MANIFESTS: k8s.manifests_text(cfg, k8s.render_k8s(cfg))}
    raise HeteroRLError(f"unknown deploy target {target!r}: one of {', '.join(TARGETS)}")


def write_files(out: Path, files: dict[str, str], force: bool) -> list[Path]:
    """Write ``files`` into ``out``, made if missing. Files of the same names that hold something else are
    replaced only with ``force``; every other file in ``out`` is left alone."""
    if out.exists() and not out.is_dir():
        raise HeteroRLError(f"--out {out} is a file: give a folder for the rendered files")
    differ = [name for name, text in files.items() if (out / name).is_file() and (out / name).read_text() != text]
    if differ and not force:
        raise HeteroRLError(f"{out} already holds {', '.join(differ)}, which differ from what this config renders "
                            "(edited by hand, or another run's): pass --force to replace them, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]


def instructions(target: str, cfg: Config, out: Path) -> str:
    """What to do once (make the keys) and the command that launches the run, for the files in ``out``."""
    if target == "slurm":
        first = ("First, once: the CurveZMQ keys in cluster.keys, here (every node must see this folder; skip a "
                 "command whose keys exist):", slurm.key_commands(cfg))
        launch = f"sbatch {out.as_posix()}/{slurm.SCRIPT}"
        note = ("Submit from this folder: the job's paths are relative to it. After a failure or the time limit, "
                f"`{launch} --resume` continues from the last checkpoint.")
    else:
        namespace = cfg.cluster.k8s.namespace
        make_namespace = [] if namespace == "default" else [f"kubectl create namespace {namespace}"]
        first = ("First, once: the CurveZMQ keys (skip a command whose keys exist) and the Secrets made of them:",
                 [*k8s.key_commands(cfg), *make_namespace, *k8s.secret_commands(cfg)])
        launch = f"kubectl apply -f {out.as_posix()}/{k8s.MANIFESTS}"
        note = (f"The image {cfg.cluster.k8s.image} must hold heterorl (docs/DEPLOY.md, \"Kubernetes\", says how to "
                "build one).")
    return "\n".join([first[0], *(f"  {command}" for command in first[1]), "Then launch the run:", f"  {launch}",
                      note])


def deploy_command(target: str, cfg: Config, config_name: str, out: str | None = None, force: bool = False) -> int:
    """`heterorl deploy TARGET CONFIG`: ``cfg`` is the run config loaded from ``config_name`` and its overrides;
    the files go into ``out`` (default: runs/deploy/TARGET/NAME), replacing ones that differ only with ``force``."""
    folder = Path(out) if out else default_out(target, config_name)
    written = write_files(folder, render(target, cfg, folder.as_posix()), force)
    print(f"heterorl deploy {target}: wrote {', '.join(path.as_posix() for path in written)}")
    print(instructions(target, cfg, folder))
    return 0
