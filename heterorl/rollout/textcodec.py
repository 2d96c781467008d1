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


def encode_prompt(tokenizer, text: str, chat_template: bool = False) -> list[int]:
    """Token ids of a prompt as the model saw prompts in training: the text's tokens with the special tokens the
    tokenizer's own rule adds (a BOS its post-processor puts in front, as ``tokenizer(text)`` does in any
    Hugging Face or TRL pipeline); an end-of-sequence token such a rule appends is left out, since generation
    continues the prompt. With ``chat_template`` (``task.chat_template``) the prompt is a user message rendered by
    the tokenizer's chat template with the assistant's turn opened, and encoded as the template wrote it. Every
    place that encodes a prompt (SFT, sampling, evaluation, hence the learner, which trains on the workers' token
    ids) calls this one function."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise SamplingError(f"task.chat_template is true but this policy's tokenizer ({type(tokenizer).__name__}) "
                                "has no chat template; set task.chat_template=false, or save a tokenizer that has one")
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return encode_text(tokenizer, rendered, "prompt (chat template applied)")
    plain = encode_text(tokenizer, text, "prompt")
    full = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    if start is None:
        raise SamplingError(
            f"the tokenizer's special-token rule changes how prompt {text[:40]!r} is tokenized ({full[:12]} vs "
            f"{plain[:12]} without it); its post-processor should only add tokens around the text"
        )
    end = start + len(plain)
    suffix = [t for t in full[end:] if t != tokenizer.eos_token_id]
    return full[:end] + suffix
