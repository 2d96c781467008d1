"""Tinker's checkpoints as `heterorl serve` keeps them (`CheckpointStore`): heterorl training states under
``STATE_DIR/tinker/MODEL/{weights,sampler_weights}/NAME``, named ``tinker://MODEL/weights/NAME``, with each model's
description beside them (``run.json``: base model, LoRA config, user metadata), so that a checkpoint, and the
run listings the SDK's ``RestClient`` reads, outlive the service."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

from heterorl.files import write_atomically
from heterorl.service.calls import BadRequest, NotFound

MODEL_ID = re.compile(r"(t-[0-9a-f]{12}):train:([0-9]{1,9})")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
PATH = re.compile(r"tinker://(t-[0-9a-f]{12}:train:[0-9]{1,9})/(weights|sampler_weights)/"
                  r"([A-Za-z0-9][A-Za-z0-9._-]{0,99})")


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


class CheckpointStore:
    """The checkpoints under ``root`` (see the module). Names are file names, never paths: a ``tinker://`` path
    that does not match `PATH` names nothing, and links are not followed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write_run(self, model_id: str, meta: dict) -> None:
        folder = self.root / model_id
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / "run.json", lambda f: f.write(json.dumps(meta).encode()))

    def path(self, model_id: str, kind: str, name: str) -> Path:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(f"checkpoint name {str(name)[:100]!r}: letters, digits, '.', '_', '-' (no folders)")
        return self.root / model_id / kind / name

    def checkpoint(self, tinker_path: str) -> tuple[str, str, str, Path]:
        """(model id, kind, name, file) of a ``tinker://MODEL/KIND/NAME`` this service wrote."""
        found = PATH.fullmatch(tinker_path) if isinstance(tinker_path, str) else None
        if found is None:
            raise BadRequest(f"{str(tinker_path)[:200]!r} is not a checkpoint path of this service "
                             "(tinker://SESSION:train:N/weights/NAME or .../sampler_weights/NAME)")
        model_id, kind, name = found.groups()
        path = self.root / model_id / kind / name
        if path.is_symlink() or not path.is_file():
            raise NotFound(f"no checkpoint {tinker_path} here")
        return model_id, kind, name, path

    def run_meta(self, model_id: str) -> dict:
        path = self.root / model_id / "run.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise NotFound(f"no training run {model_id} here") from None

    def checkpoints(self, model_id: str) -> list[dict]:
        out = []
        for kind, label in (("weights", "training"), ("sampler_weights", "sampler")):
            folder = self.root / model_id / kind
            for path in sorted(folder.iterdir()) if folder.is_dir() else []:
                if path.is_file() and not path.is_symlink() and NAME.fullmatch(path.name):
                    stat = path.stat()
                    out.append({"checkpoint_id": f"{kind}/{path.name}", "checkpoint_type": label,
                                "time": datetime.fromtimestamp(stat.st_mtime, UTC).isoformat(),
                                "tinker_path": f"tinker://{model_id}/{kind}/{path.name}", "size_bytes": stat.st_size,
                                "public": False})
        return sorted(out, key=lambda c: c["time"])

    def training_run(self, model_id: str) -> dict:
        if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
            raise NotFound(f"no training run {str(model_id)[:100]!r} here")
        meta = self.run_meta(model_id)
        checkpoints = self.checkpoints(model_id)
        training = [c for c in checkpoints if c["checkpoint_type"] == "training"]
        sampler = [c for c in checkpoints if c["checkpoint_type"] == "sampler"]
        run = {"training_run_id": model_id, "base_model": meta["base_model"], "model_owner": "heterorl",
               "is_lora": meta["is_lora"], "corrupted": False, "lora_rank": meta.get("lora_rank"),
               "last_request_time": meta.get("created", now_iso()), "user_metadata": {
                   str(k): str(v) for k, v in (meta.get("user_metadata") or {}).items()}}
        if training:
            run["last_checkpoint"] = training[-1]
        if sampler:
            run["last_sampler_checkpoint"] = sampler[-1]
        return run

    def training_runs(self) -> list[str]:
        folders = sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime) if self.root.is_dir() else []
        return [p.name for p in folders if MODEL_ID.fullmatch(p.name) and (p / "run.json").is_file()]

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        _, _, _, path = self.checkpoint(f"tinker://{model_id}/{kind}/{name}")
        path.unlink()

