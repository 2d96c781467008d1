"""Policy loaders: tiny (built from a config), a local Hugging Face folder, smollm2."""

from __future__ import annotations

from pathlib import Path

from heterorl.config import TinyModelConfig
from heterorl.policies.hf_folder import load_hf_folder, validate_hf_folder
from heterorl.policies.tiny import build_char_tokenizer, build_tiny_policy, save_policy

# policy folders inside the package (heterorl/assets/NAME)
SHIPPED = ("maze-sft-base", "maze4-sft-base", "add3-sft-base", "arith-hash-sft-base")


def shipped_policy(name: str) -> Path:
    """The folder of a policy shipped inside the package."""
    from importlib import resources

    return Path(str(resources.files("heterorl"))) / "assets" / name


def load_policy(model: str, *, alphabet: str | None = None, tiny: TinyModelConfig | None = None,
                device: str = "cpu"):
    """``(model, tokenizer)`` for ``model`` = "tiny" (fresh, needs ``alphabet``), "smollm2", a shipped policy
    (``maze-sft-base``: 5x5 mazes; ``maze4-sft-base``: 4x4; ``add3-sft-base``: 3-digit addition, digits;
    ``arith-hash-sft-base``: 3-digit addition, ``####`` answers), or a local
    Hugging Face folder."""
    if model == "tiny":
        if alphabet is None:
            raise ValueError("the tiny policy needs the task's alphabet to build its tokenizer")
        net, tokenizer = build_tiny_policy(alphabet, tiny)
        return net.to(device), tokenizer
    if model == "smollm2":
        from heterorl.policies.smollm2 import smollm2_folder

        return load_hf_folder(smollm2_folder(), device=device)
    if model in SHIPPED:
        return load_hf_folder(shipped_policy(model), device=device)
    return load_hf_folder(Path(model).expanduser(), device=device)


def policy_folder(model: str) -> Path | None:
    """The Hugging Face folder behind a ``policy.model`` / ``rl.base`` value (an engine that loads weights
    itself, such as vLLM, needs one); None for "tiny", which exists only in memory until saved."""
    if model == "tiny":
        return None
    if model == "smollm2":
        from heterorl.policies.smollm2 import smollm2_folder

        return smollm2_folder()
    if model in SHIPPED:
        return shipped_policy(model)
    return validate_hf_folder(Path(model).expanduser())


def quiet_transformers() -> None:
    """Our own progress bar is the one to watch: hide transformers' load/save bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


__all__ = [
    "SHIPPED", "TinyModelConfig", "build_char_tokenizer", "shipped_policy", "build_tiny_policy", "load_hf_folder", "load_policy",
    "quiet_transformers", "save_policy", "validate_hf_folder",
]
