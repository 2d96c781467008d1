"""The checkpoints of the synchronous loops (`heterorl sft`, `heterorl rl`): every ``runtime.checkpoint_every``
steps, at the last step, and when a signal stops the loop after its step in progress, the `TrainingClient`'s
state (weights, optimizer, version, step, torch and Python RNG) goes to ``checkpoints/loop-STEP.pt``, then
``checkpoints/loop_state.json``, which names it, as the commit (both written atomically: a killed run leaves the
old checkpoint or the new one). The state holds what the loop needs to go on as if it had never stopped: its
step, the problem stream's RNG and its record (evaluations, counts). ``--resume RUN_DIR`` continues from it.

The learner of `heterorl train` has checkpoints of its own (`runtime/checkpoints.py`): they hold what a fleet
needs besides (the trajectories trained, the versions published)."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically
from heterorl.training.session import TrainingClient

FOLDER = "checkpoints"  # under the run dir, as the learner's
LOOP_STATE = "loop_state.json"


@dataclass
class LoopState:
    """A sync loop's checkpoint, besides its weights file."""

    command: str  # "sft" or "rl": a checkpoint resumes only the command that wrote it
    step: int  # the last step done
    weights: str  # the weights file in the checkpoints folder
    rng: list = field(default_factory=list)  # the problem stream's `random.Random.getstate()`, as JSON lists
    record: dict = field(default_factory=dict)  # the loop's own: its evaluations, counts and elapsed time

    def problem_rng(self) -> random.Random:
        rng = random.Random()
        version, internal, gauss = self.rng
        rng.setstate((version, tuple(internal), gauss))
        return rng


class LoopCheckpoints:
    """Writes a loop's checkpoints into ``RUN_DIR/checkpoints``; ``resume``: the checkpoint there to go on from
    (`read_loop_state` read and checked it)."""

    def __init__(self, run_dir: str | Path, command: str, every: int, *, resume: LoopState | None = None) -> None:
        self.folder, self.command, self.every, self.resumed_from = Path(run_dir) / FOLDER, command, every, resume
        self.saved_step: int | None = None  # the step of the latest checkpoint written or read

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, training: TrainingClient, step: int, rng: random.Random, record: dict) -> None:
        """Checkpoint the loop after ``step``: the weights file, then the state naming it, then the older
        weights files go."""
        self.folder.mkdir(parents=True, exist_ok=True)
        weights = f"loop-{step:06d}.pt"
        training.save_state(self.folder / weights).result()
        version, internal, gauss = rng.getstate()
        state = LoopState(self.command, step, weights, [version, list(internal), gauss], record)
        write_atomically(self.folder / LOOP_STATE, json.dumps(asdict(state)).encode())
        for path in self.folder.glob("loop-*.pt"):
            if path.name != weights:
                path.unlink(missing_ok=True)
        self.saved_step = step

    def resume(self, training: TrainingClient) -> LoopState | None:
        """With ``resume``: that checkpoint, its training state loaded into ``training``; None without."""
        state = self.resumed_from
        if state is None:
            return None
        training.load_state(self.folder / state.weights).result()
        self.saved_step = state.step
        return state


def read_loop_state(folder: Path, command: str) -> LoopState:
    """The loop state in ``folder``, checked: written by ``command``, its weights file there; HeteroRLError naming
    what is wrong."""
    path = folder / LOOP_STATE
    if not path.is_file():
        learner = (folder / "learner_state.json").is_file()
        raise HeteroRLError(f"nothing to resume in {folder.parent}: no {FOLDER}/{LOOP_STATE}"
                            + ("; it holds a `heterorl train` run: resume it with `heterorl train --resume "
                               f"{folder.parent}`" if learner else "; was the run started with this run dir?"))
    try:
        raw = json.loads(path.read_bytes())
        state = LoopState(**raw)
        if not isinstance(state.step, int) or len(state.rng) != 3:
            raise TypeError("step must be an integer and rng a Random state")
    except (ValueError, TypeError) as exc:
        raise HeteroRLError(f"{path} is not a loop checkpoint ({exc}); start the run again in another "
                            "logging.run_dir") from None
    if state.command != command:
        raise HeteroRLError(f"{path} was written by `heterorl {state.command}`: resume it with `heterorl "
                            f"{state.command} --resume {folder.parent}`")
    if not (folder / state.weights).is_file():
        raise HeteroRLError(f"{path} names {state.weights}, which is not in {folder}: the checkpoint is incomplete")
    return state


class StopRequest:
    """Why a loop is to stop after its step in progress ("" while it is not): the name of the signal that asked
    (the command line sets it from its signal handler, `request`)."""

    def __init__(self) -> None:
        self.by = ""

    def request(self, why: str) -> None:
        self.by = self.by or why


def elapsed_clock(record: dict) -> Callable[[], float]:
    """Seconds since the run began, across its resumes (``record["elapsed_s"]``: the time before this leg)."""
    start = time.time() - float(record.get("elapsed_s", 0.0))
    return lambda: time.time() - start
