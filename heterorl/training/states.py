"""A training client's state (`TrainingStates`): its weights (with LoRA, the adapter's, its config and the base's
digest), optimizer, policy version, step and RNG — built from its model, written atomically to a file (a sharded
client's: a folder written by every rank, DCP), read back safely (`read_training_state`) and loaded into it.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from heterorl.config import LoraConfig
from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically

_STATE_FIELDS = ("model", "optimizer", "version", "step", "rng")  # (LoRA states add "lora" and "base_hash")


class TrainingStates:
    """The states of one client's ``model`` (see the module): ``lora`` and ``base_hash`` its adapter's config and
    its frozen base's digest (None without LoRA), ``sharded`` whether it is sharded over several ranks (FSDP2).
    The optimizer, version and step are the client's, passed in and handed back."""

    def __init__(self, model: torch.nn.Module, lora: LoraConfig | None, base_hash: str | None,
                 device: torch.device, sharded: bool) -> None:
        self.model, self.lora, self.base_hash, self.device, self.sharded = model, lora, base_hash, device, sharded

    def state_dict(self, optimizer: torch.optim.Optimizer | None, version: int, step: int) -> dict:
        """Weights (with LoRA: the adapter's, its config and the base's digest), optimizer, version, step, RNG."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "version": version,
            "step": step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        if self.lora is not None:
            from heterorl.training.lora import adapter_state

            state.update(model=adapter_state(self.model), lora=self.lora.to_dict(), base_hash=self.base_hash)
        return state

    def save(self, path, optimizer: torch.optim.Optimizer | None, version: int, step: int) -> Path:
        """Write the state to ``path`` atomically (sharded: a collective, every rank calls it)."""
        if self.sharded:
            from heterorl.training.sharding import save_sharded

            return save_sharded(path, self.model, optimizer, version, step)
        state = self.state_dict(optimizer, version, step)
        return write_atomically(path, lambda f: torch.save(state, f))

    def load(self, state, optimizer: torch.optim.Optimizer | None,
             trainable: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer | None, int, int]:
        """Load ``state`` (a path `save` wrote, or what `read_training_state` read) into the model and the RNG;
        (the optimizer from then on, the version, the step). A state without an optimizer keeps ``optimizer``;
        one with an optimizer makes an AdamW over ``trainable`` and loads it."""
        if not isinstance(state, dict):
            state = read_training_state(state, self.device)
        if self.sharded or "sharded" in state:
            return self._load_sharded(state)
        from heterorl.training.lora import check_lora_state, load_adapter

        check_lora_state(state, self.lora, self.base_hash)
        try:
            if self.lora is not None:
                load_adapter(self.model, state["model"])
            else:
                self.model.load_state_dict(state["model"])
            if state["optimizer"] is not None:
                optimizer = torch.optim.AdamW(trainable)
                optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise HeteroRLError(f"the training state does not fit this model ({_first_sentence(exc)}); was it "
                                "saved from another policy?") from None
        torch.set_rng_state(state["rng"]["torch"].cpu())
        version, internal, gauss = state["rng"]["python"]
        random.setstate((version, tuple(internal), gauss))
        return optimizer, int(state["version"]), int(state["step"])

    def _load_sharded(self, state: dict) -> tuple[torch.optim.Optimizer | None, int, int]:
        from heterorl.training.sharding import load_sharded

        if not self.sharded or "sharded" not in state:
            saved = "sharded (a folder, by several ranks)" if "sharded" in state else "whole (one file)"
            raise HeteroRLError(f"this training state is {saved}, but the client is "
                                f"{'sharded' if self.sharded else 'not sharded'}: resume with the learner's "
                                "sharding as it was (runtime.learner_sharding)")
        optimizer, meta = load_sharded(state["sharded"], self.model, lambda: torch.optim.AdamW(
            self.model.parameters()))
        return optimizer, int(meta["version"]), int(meta["step"])


def _first_sentence(exc: BaseException) -> str:
    text = str(exc).strip().split(". ")[0].splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def read_training_state(path, map_location: str | torch.device = "cpu") -> dict:
    """The training state `TrainingClient.save_state` wrote to ``path``, read with ``torch.load(weights_only=True)``:
    tensors, numbers, strings and containers only (the model, the optimizer, the version, the step, torch's RNG
    state and python's as a tuple of ints), so nothing in the file can run code. HeteroRLError naming the file
    and what is wrong: missing, truncated or garbage, or a field absent."""
    path = Path(path)
    if path.is_dir():  # a sharded learner's state (`heterorl.training.sharding`): read when loaded
        from heterorl.training.sharding import read_sharded_meta

        return {"sharded": str(path), **read_sharded_meta(path)}
    if not path.is_file():
        raise HeteroRLError(f"no training state at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # damaged bytes fail wherever the parser is (UnpicklingError, EOFError, IndexError, ...);
        # with weights_only nothing in the file runs, so every failure means one thing: not a readable state
        raise HeteroRLError(f"{path} cannot be read as a training state: it is truncated, not a checkpoint, or "
                            f"holds more than tensors, numbers and strings ({_first_sentence(exc)})") from None
    missing = [name for name in _STATE_FIELDS if not isinstance(state, dict) or name not in state]
    if missing:
        raise HeteroRLError(f"{path} is not a training state: it lacks {', '.join(missing)}")
    return state
