"""Load a policy (causal LM + tokenizer) from a local Hugging Face folder, and check the two fit.

Nothing is downloaded: the folder must hold ``config.json``, the weights and the tokenizer files,
as written by ``model.save_pretrained(folder)`` and ``tokenizer.save_pretrained(folder)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from heterorl.errors import PolicyLoadError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
_SAVE_HINT = "write it with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)"
# what a model's id on a hub looks like (ORG/NAME, no other slash): named where a folder was looked for
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def validate_hf_folder(path: str | Path) -> Path:
    """Return ``path`` as a Path if it looks like a complete Hugging Face model folder.

    Raises PolicyLoadError naming the path and what is missing: the path itself, a folder,
    ``config.json``, weights (``*.safetensors`` or ``pytorch_model*.bin``) or tokenizer files.
    """
    folder = Path(path).expanduser()
    if not folder.exists() and HUB_ID.fullmatch(str(path)):
        raise PolicyLoadError(
            f"policy {str(path)!r} looks like a model id on a hub, and there is no such folder here; heterorl "
            f"downloads nothing: fetch the model once on a machine with access (huggingface-cli download {path} "
            f"--local-dir DIR, or from_pretrained then save_pretrained), then pass that folder (rl.base=DIR, "
            f"policy.model=DIR); or name a policy that ships with heterorl (smollm2, or an SFT base such as "
            f"add3-sft-base: heterorl/policies/__init__.py lists them)"
        )
    if not folder.exists():
        raise PolicyLoadError(
            f"policy folder {folder} does not exist: pass the path of a local Hugging Face model folder "
            f"({_SAVE_HINT})"
        )
    if not folder.is_dir():
        raise PolicyLoadError(
            f"policy path {folder} is a file, not a folder: pass the folder that holds config.json, "
            "the weights and the tokenizer files"
        )
    if not (folder / "config.json").is_file():
        raise PolicyLoadError(f"policy folder {folder} has no config.json: {_SAVE_HINT}")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise PolicyLoadError(
            f"policy folder {folder} has no weights (*.safetensors or pytorch_model*.bin): {_SAVE_HINT}"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise PolicyLoadError(
            f"policy folder {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
            f"save the model's tokenizer there with tokenizer.save_pretrained({str(folder)!r})"
        )
    return folder


def load_hf_folder(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, object]:
    """Load ``(model, tokenizer)`` from a local folder, the model in eval mode on ``device``.

    The tokenizer is loaded as the class the folder declares (`_load_tokenizer`; never swapped for the model
    type's), must fit the model (no more tokens than embedding rows) and have an eos token;
    a missing pad token is set to the eos token, and the model's generation config gets the
    tokenizer's eos/pad ids where it has none. Every failure is a PolicyLoadError naming the folder.
    """
    folder = validate_hf_folder(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise PolicyLoadError(f"could not load the model in {folder}: {exc}") from exc
    tokenizer = load_hf_tokenizer(folder, model.get_input_embeddings().num_embeddings)
    generation = model.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id

    try:
        model.to(device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise PolicyLoadError(f"could not move the model from {folder} to device {device!r}: {exc}") from exc
    model.eval()
    return model, tokenizer


def declared_vocab_size(folder: Path) -> int:
    """The embedding rows (``vocab_size``) a model folder's config.json declares."""
    try:
        return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PolicyLoadError(f"policy folder {folder}: config.json names no vocab_size ({exc})") from exc


def load_hf_tokenizer(path: str | Path, rows: int | None = None):
    """The tokenizer of a local folder, checked as `load_hf_folder` checks it, without loading the model (an engine
    that loads the weights itself, such as vLLM, needs only this): ``rows``, the model's embedding rows, are read
    from its config.json unless given."""
    folder = validate_hf_folder(path)
    rows = declared_vocab_size(folder) if rows is None else rows
    tokenizer = _load_tokenizer(folder)
    _check_tokenizer_class(folder, tokenizer)
    if len(tokenizer) > rows:
        extra = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 8))))
        raise PolicyLoadError(
            f"policy folder {folder}: tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{rows} rows (ids {rows}.. are {extra}{' ...' if len(tokenizer) > rows + 8 else ''}): the tokenizer "
            "does not belong to this model; save the model's own tokenizer there"
        )
    if tokenizer.eos_token_id is None:
        raise PolicyLoadError(
            f"policy folder {folder}: the tokenizer has no eos token, so generation could not stop; "
            "set eos_token in its tokenizer_config.json"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _declared_tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _load_tokenizer(folder: Path):
    """The tokenizer as its files say: a generic one (a ``tokenizer.json`` from the ``tokenizers`` library, declared
    ``TokenizersBackend`` or ``PreTrainedTokenizerFast``) is loaded as that, keeping its own special tokens and
    post-processor, where ``AutoTokenizer`` would swap in the model type's class (a ``Qwen2Tokenizer`` for a
    ``qwen2`` config, which adds tokens of its own); any other through ``AutoTokenizer``."""
    try:
        if _declared_tokenizer_class(folder) in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise PolicyLoadError(f"could not load the tokenizer in {folder}: {exc}") from exc


def _check_tokenizer_class(folder: Path, tokenizer: object) -> None:
    """Refuse a tokenizer that AutoTokenizer silently swapped for the model type's own class.

    transformers 5 loads e.g. ``Qwen2Tokenizer`` for any ``qwen2`` folder even when
    tokenizer_config.json declares a generic ``TokenizersBackend``; the swapped class re-tokenizes
    text differently from what was saved (and from what another engine loading the folder expects).
    """
    declared = _declared_tokenizer_class(folder)
    loaded = type(tokenizer).__name__
    if declared in _GENERIC_TOKENIZERS and loaded not in _GENERIC_TOKENIZERS:
        raise PolicyLoadError(
            f"policy folder {folder}: tokenizer_config.json declares {declared} but transformers loads it "
            f"as {loaded} for this model type, which tokenizes differently; save a {loaded} built from "
            "your vocabulary instead"
        )
