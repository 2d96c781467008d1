"""Teacher-forced per-token log-probs of a causal LM, the one place they are computed."""

from __future__ import annotations

from typing import Sequence

import torch


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int, device="cpu"):
    """Right-pad token lists into ``(input_ids, attention_mask)`` of shape (B, T_max)."""
    max_len = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), max_len), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
    return input_ids.to(device), attention_mask.to(device)


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target], in float32, without materialising the full log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])``, shape (B, T-1), under the model's
    distribution at ``temperature`` (logits divided by it, as a sampler at that temperature draws).

    Positions past a row's length hold garbage; mask them with ``attention_mask[:, 1:]``.
    Gradients flow when called with grad enabled. ``temperature`` must be > 0 (callers check it).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    return selected_logprobs(logits, input_ids[:, 1:])
