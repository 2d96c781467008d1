"""A heterorl run deployed on a `NetLab`: `heterorl learner` on the learner's host bound to its address with
CurveZMQ, `heterorl rollout` workers on the worker hosts connecting with their keys, as docs/RUNTIME.md
("Across machines") says; what their logs say, with times (the drills and ``heterorl bench wan`` read them)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from heterorl.netlab.lab import LEARNER_ADDRESS, NetLab

CLI = [sys.executable, "-m", "heterorl.cli"]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class LabFleet:
    """The learner and workers of one run on ``lab``; ``folder`` holds the keys, the logs and the run dir."""

    def __init__(self, lab: NetLab, folder: Path, config: Path, *, curve: bool = True, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        self.lab, self.folder, self.config, self.curve = lab, Path(folder), Path(config), curve
        self.env, self.cwd = env, cwd
        self.keys = self.folder / "keys"
        self.learner: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}
        self.address = ""
        if curve:
            self._make_keys()

    def _make_keys(self) -> None:
        """``heterorl keys`` for the learner and every worker; the workers' public keys in ``keys/allowed``."""
        allowed = self.keys / "allowed"
        allowed.mkdir(parents=True, exist_ok=True)
        for name in ["learner", *(f"w{k}" for k in range(1, self.lab.workers + 1))]:
            if not (self.keys / f"{name}.key").is_file():
                subprocess.run([*CLI, "keys", "--name", name, "--out", str(self.keys)], check=True, env=self.env,
                               cwd=self.cwd, capture_output=True)
            if name != "learner":
                (allowed / f"{name}.key").write_bytes((self.keys / f"{name}.key").read_bytes())

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def run_dir(self) -> Path:
        import yaml

        return Path(yaml.safe_load(self.config.read_text())["logging"]["run_dir"])

    def start_learner(self, *extra: str, timeout_s: float = 180) -> str:
        """Start the learner (``extra``: more arguments, e.g. ``--resume``); its control endpoint once it listens."""
        keys = (["--curve-secret", str(self.keys / "learner.key_secret"), "--allow-keys", str(self.keys / "allowed")]
                if self.curve else ["--allow-plaintext"])
        endpoints = self.run_dir() / "endpoints.json"
        before = endpoints.stat().st_mtime_ns if endpoints.is_file() else None
        self.learner = self.lab.run("learner", [*CLI, "learner", "--config", str(self.config), "--bind",
                                                f"tcp://{LEARNER_ADDRESS}:0", *keys, *extra],
                                    log=self.log("learner"), env=self.env, cwd=self.cwd)
        self.address = await_learner_address(self.run_dir(), self.learner, self.log("learner"), timeout_s, before)
        return self.address

    def start_worker(self, k: int, *extra: str) -> subprocess.Popen:
        keys = (["--curve-secret", str(self.keys / f"w{k}.key_secret"), "--server-key",
                 str(self.keys / "learner.key")] if self.curve else ["--allow-plaintext"])
        self.workers[k] = self.lab.run(f"worker-{k}", [*CLI, "rollout", "--connect", self.address, "--worker-id",
                                                       f"w{k}", *keys, *extra],
                                       log=self.log(f"w{k}"), env=self.env, cwd=self.cwd)
        return self.workers[k]

    def tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.log(name), lines)

    def learner_step(self) -> int:
        """The learner's last logged step (-1: none yet)."""
        path = self.run_dir() / "metrics.jsonl"
        if not path.is_file():
            return -1
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        try:
            return int(json.loads(lines[-1])["step"]) if lines else -1
        except (ValueError, KeyError):
            return -1

    def times(self, name: str, pattern: str) -> list[float]:
        """Wall-clock times (seconds since the epoch) of the lines of ``name``'s log that contain ``pattern``."""
        return log_times(self.log(name), pattern)

    def first_after(self, name: str, pattern: str, after: float) -> float | None:
        """Seconds from ``after`` (wall clock) to the first line of ``name``'s log with ``pattern`` since."""
        later = [t - after for t in self.times(name, pattern) if t >= after - 0.001]
        return min(later) if later else None


def log_times(path: Path, pattern: str) -> list[float]:
    """Wall-clock times (seconds since the epoch) of the lines of the heterorl log at ``path`` (each stamped by its
    logging format) that contain ``pattern``; none when there is no log."""
    found = []
    if not path.is_file():
        return found
    for line in path.read_text(errors="replace").splitlines():
        stamp = _STAMP.match(line)
        if stamp and pattern in line:
            found.append(datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return found


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the log at ``path`` (none when there is no log)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def await_learner_address(run_dir: Path, learner, log: Path, timeout_s: float = 180,
                          before: int | None = None) -> str:
    """The control address of the ``learner`` process (its log at ``log``) once it listens: what it writes into
    ``RUN_DIR/endpoints.json`` (a file newer than ``before``, its mtime in ns when a resumed learner starts over an
    old one). RuntimeError with its log's tail when it exits first or does not listen within ``timeout_s``."""
    endpoints, deadline = run_dir / "endpoints.json", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if endpoints.is_file() and endpoints.stat().st_mtime_ns != before:
            try:
                return json.loads(endpoints.read_text())["control"]
            except (ValueError, KeyError):
                pass
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited ({learner.poll()}) before listening:\n{log_tail(log)}")
        time.sleep(0.1)
    raise RuntimeError(f"the learner did not listen within {timeout_s:.0f} s:\n{log_tail(log)}")
