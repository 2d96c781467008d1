"""The ``tiny`` policy: a small Qwen2-style causal LM built from a config, with a
char-level tokenizer made from a task's alphabet.

The tokenizer is a byte-level BPE with *no merges* over the alphabet, built as a
``Qwen2Tokenizer``. That is deliberate: ``AutoTokenizer`` forces the Qwen2
tokenizer class on any folder whose ``config.json`` says ``qwen2``, so a custom
tokenizer class saved beside a qwen2 config would be rebuilt with Qwen2's
pre-tokenizer on load (dropping newlines and spaces, re-splitting digits). A
merge-free byte-level vocabulary is exactly char-level under that class, so the
saved folder round-trips through ``AutoTokenizer`` / ``AutoModelForCausalLM``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from heterorl.config import TinyModelConfig
from heterorl.errors import PolicyLoadError

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
_BYTE_TO_UNICODE = bytes_to_unicode()


def build_char_tokenizer(alphabet: str) -> Qwen2Tokenizer:
    """A char-level tokenizer over ``alphabet`` (ASCII), ids 0/1 = ``<pad>``/``<eos>``."""
    chars = sorted(set(alphabet))
    non_ascii = [c for c in chars if ord(c) > 127]
    if non_ascii:
        raise PolicyLoadError(
            f"the tiny tokenizer is char-level over ASCII; the alphabet holds {non_ascii[:5]!r}: "
            "use a Hugging Face policy folder for non-ASCII text"
        )
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for c in chars:
        vocab[_BYTE_TO_UNICODE[ord(c)]] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=EOS_TOKEN
    )


def build_tiny_policy(alphabet: str, config: TinyModelConfig | None = None):
    """Return ``(model, tokenizer)``: a freshly initialised tiny model for ``alphabet``."""
    config = config or TinyModelConfig()
    tokenizer = build_char_tokenizer(alphabet)
    if config.hidden_size % config.num_heads or config.num_heads % config.num_kv_heads:
        raise PolicyLoadError(
            f"tiny model: hidden_size ({config.hidden_size}) must divide by num_heads ({config.num_heads}) "
            f"and num_heads by num_kv_heads ({config.num_kv_heads})"
        )
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_positions,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(model_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Save ``model`` and ``tokenizer`` as a normal Hugging Face folder, atomically.

    Writes into a temporary sibling folder and renames it into place, so an
    interrupted save never leaves a half-written folder behind.
    """
    import os
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes 0700 and safetensors writes 0600: make the folder shareable
        for file in tmp.iterdir():
            file.chmod(0o644)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
