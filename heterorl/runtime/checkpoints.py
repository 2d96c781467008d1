"""A learner's checkpoints: what they hold (`LearnerState`, beside the `TrainingClient`'s weights file), how they
are written (`commit_checkpoint`: the weights file first, then ``learner_state.json`` naming it, as the commit)
and read back and checked (`read_checkpoint`), and the record of the newest version published
(`record_published`), so that a learner resumed from an older checkpoint publishes above it
(docs/RELIABILITY.md, "Crash and resume")."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically
from heterorl.runtime.accounting import RunTally

CHECKPOINTS = "checkpoints"  # the folder under the run dir
LEARNER_STATE = "learner_state.json"  # the latest checkpoint: the learner's state, naming its weights file
PREVIOUS_STATE = "learner_state.prev.json"  # the checkpoint before it, kept with its weights file until the next
PUBLISHED = "published.json"  # the newest version published (and when), rewritten before each publish
CHECKPOINT = "checkpoint.pt"  # the weights file of a learner state that names none (run dirs of older versions)


@dataclass
class LearnerState:
    """What a resume needs besides the TrainingClient state."""

    step: int = 0
    trained_ids: list[str] = field(default_factory=list)  # `Trajectory.key` of each trajectory trained
    history: list[dict] = field(default_factory=list)
    publish_wall_s: dict[str, float] = field(default_factory=dict)  # version → time.time() it was published
    tally: RunTally = field(default_factory=RunTally)  # what the run trained, how stale (`accounting.RunTally`)
    steps_without_update: int = 0
    version: int = -1  # the policy version of the checkpoint's weights (-1: not recorded, older run dirs)
    engines: dict[str, dict] = field(default_factory=dict)  # engine name → `EngineTally` fields
    weights: str = CHECKPOINT  # the checkpoint's weights file in checkpoints/: model, optimizer, version, RNG


@dataclass
class Checkpoint:
    """A checkpoint read back and checked (`read_checkpoint`): what `Learner.resume` continues from."""

    state: LearnerState
    training_state: dict  # its weights file, as `read_training_state` returns it
    newest_published: int  # the newest version any learner of the run published: at least the checkpoint's
    published_wall_s: dict[str, float]  # version → time.time() it was published, for those after the checkpoint


def _read_learner_state(path: Path) -> LearnerState:
    if not path.is_file():
        raise HeteroRLError(f"{path} does not exist")
    try:
        raw = json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise HeteroRLError(f"{path} is not a learner state: not valid JSON ({exc})") from None
    names = {f.name for f in fields(LearnerState)}
    tally_names = {f.name for f in fields(RunTally)}
    if isinstance(raw, dict) and "tally" not in raw:  # written before the tally had its own key: the same fields
        raw["tally"] = {name: raw.pop(name) for name in tally_names & set(raw)}
    if (not isinstance(raw, dict) or not set(raw) <= names or not isinstance(raw.get("step"), int)
            or not isinstance(raw.get("trained_ids"), list) or not isinstance(raw.get("weights", ""), str)
            or not isinstance(raw["tally"], dict) or not set(raw["tally"]) <= tally_names):
        raise HeteroRLError(f"{path} is not a learner state: expected a JSON object with an integer step, a list "
                            f"of trained_ids, a tally with no other keys than {', '.join(sorted(tally_names))} and "
                            f"no other keys than {', '.join(sorted(names))}")
    return LearnerState(**{**raw, "tally": RunTally(**raw["tally"])})


def _read_pair(folder: Path, name: str, map_location) -> tuple[LearnerState, dict]:
    """The learner state ``name`` and the weights file it names, checked to belong together."""
    state = _read_learner_state(folder / name)
    weights = folder / Path(state.weights).name
    from heterorl.training.session import read_training_state  # (torch: only to resume)

    training_state = read_training_state(weights, map_location)
    if state.version >= 0 and training_state["version"] != state.version:
        raise HeteroRLError(f"{weights} holds policy version {training_state['version']}, but {name} was written "
                            f"with version {state.version}: they are not one checkpoint")
    return state, training_state


def _read_published(folder: Path) -> tuple[int, dict[str, float]]:
    """(newest version published, {version: wall time} of those since the last checkpoint); (-1, {}) if none."""
    path = folder / PUBLISHED
    if not path.is_file():
        return -1, {}
    try:
        raw = json.loads(path.read_bytes())
        return int(raw["version"]), {str(int(v)): float(t) for v, t in raw["publish_wall_s"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeteroRLError(f"{path} is not a record of the newest version published ({exc!r}); stop every worker "
                            "(one holding a newer version would ignore the learner's), delete the file and resume "
                            "again: the versions then go on from the checkpoint's") from None


def read_checkpoint(run_dir: str | Path, map_location="cpu") -> Checkpoint:
    """The latest checkpoint of ``run_dir``, every file read and checked (the weights with
    ``torch.load(weights_only=True)``); HeteroRLError naming the file and what is wrong, and which checkpoint
    to resume from instead (the previous one, when it is good) and how."""
    folder = Path(run_dir) / CHECKPOINTS
    if not (folder / LEARNER_STATE).is_file() and not (folder / PREVIOUS_STATE).is_file():
        raise HeteroRLError(f"no checkpoint to resume in {folder}; was the run started with this run dir?")
    try:
        state, training_state = _read_pair(folder, LEARNER_STATE, map_location)
    except HeteroRLError as exc:
        raise HeteroRLError(f"cannot resume from the latest checkpoint: {exc}. {_fallback(folder, map_location)}"
                            ) from None
    newest, wall_s = _read_published(folder)
    return Checkpoint(state, training_state, max(newest, int(training_state["version"])), wall_s)


def _fallback(folder: Path, map_location) -> str:
    """What to resume from when the latest checkpoint is bad: the previous one if it is good, and how."""
    try:
        state, _ = _read_pair(folder, PREVIOUS_STATE, map_location)
    except HeteroRLError as exc:
        return f"No good checkpoint remains ({exc}): start the run again in another logging.run_dir."
    return (f"The previous checkpoint (step {state.step}: {folder / PREVIOUS_STATE} and {state.weights}) is good; "
            f"to resume from it, run `cp {folder / PREVIOUS_STATE} {folder / LEARNER_STATE}` and resume again "
            f"(the steps after {state.step} are trained again)")


def commit_checkpoint(folder: Path, state: LearnerState) -> None:
    """After the weights file ``state.weights`` is written in ``folder``: write ``learner_state.json``, which names
    it, as the commit (atomically, so a killed learner leaves the old checkpoint or the new one). The checkpoint it
    replaces stays, as ``learner_state.prev.json`` and its weights file; older weights files and temporary files
    go."""
    keep, latest = {state.weights}, folder / LEARNER_STATE
    if latest.is_file():
        data = latest.read_bytes()
        write_atomically(folder / PREVIOUS_STATE, data)
        try:
            keep.add(json.loads(data).get("weights", CHECKPOINT))
        except (ValueError, AttributeError):
            pass  # not a learner state (the resume that read it would have refused it): nothing to keep
    write_atomically(latest, json.dumps(asdict(state)).encode())
    for path in folder.iterdir():  # weights no checkpoint names, and what a killed learner left half-written
        if path.name.startswith(".") or (path.suffix in (".pt", ".dcp") and path.name not in keep):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def record_published(folder: Path, version: int, since_checkpoint: dict[str, float]) -> None:
    """Write down ``version`` as the newest published, with the wall times of the versions published since the
    last checkpoint, before any worker can see it (a small file, written atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"version": version, "publish_wall_s": since_checkpoint}
    write_atomically(folder / PUBLISHED, json.dumps(record).encode())
