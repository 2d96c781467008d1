"""Text ↔ token ids with a check that nothing is silently dropped."""

from __future__ import annotations

from heterorl.errors import SamplingError


def encode_text(tokenizer, text: str, what: str = "text") -> list[int]:
    """Token ids of ``text`` (no special tokens added); raise if the tokenizer cannot represent it."""
    if not text:
        raise SamplingError(f"{what} is empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids)
    if not ids or decoded.strip() != text.strip():
        raise SamplingError(
            f"the tokenizer cannot represent {what} {text[:40]!r} (round trip gives {decoded[:40]!r}); "
            "is this policy's tokenizer built for another task's alphabet?"
        )
    return ids
