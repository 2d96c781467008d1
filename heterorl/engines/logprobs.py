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


# Shared prompts: the G completions of a group repeat one prompt; a training forward over each datum
# separately runs that prompt G times. Packing each group into one row, prompt once then every completion,
# with an attention mask that lets each completion see the prompt and itself only (and position ids that
# restart after the prompt), gives the same log-probs and gradients from far fewer tokens.
PACK_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask
PACK_MAX_ROW = 2048  # a packed row longer than this costs more in attention than the shared prompt saves
PACK_MIN_SAVING = 0.25  # pack only when it removes at least this share of the tokens
PACK_MAX_MASK = 2**28  # rows x row length^2 entries of the mask (256 MiB as bool): beyond, one row per datum


def prompt_groups(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences that share one prompt (exact tokens), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, (seq, n) in enumerate(zip(sequences, prompt_lens)):
        groups.setdefault(tuple(seq[:n]), []).append(i)
    return list(groups.values())


def _row_lengths(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 groups: list[list[int]]) -> list[int]:
    """Tokens in each group's packed row: its prompt once, then every member's completion."""
    return [prompt_lens[g[0]] + sum(len(sequences[i]) - prompt_lens[i] for i in g) for g in groups]


def should_pack(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                groups: list[list[int]]) -> bool:
    """Whether ``packed_completion_logprobs`` is both possible for ``model`` and worth it for this batch."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) not in PACK_ATTENTION:
        return False
    if len(groups) == len(sequences):
        return False
    total = sum(len(s) for s in sequences)
    saved = sum(prompt_lens[g[0]] * (len(g) - 1) for g in groups)
    longest = max(_row_lengths(sequences, prompt_lens, groups))
    return (saved >= PACK_MIN_SAVING * total and longest <= PACK_MAX_ROW
            and len(groups) * longest ** 2 <= PACK_MAX_MASK)


def packed_completion_logprobs(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                               groups: list[list[int]], pad_id: int, temperature: float = 1.0,
                               forward_model=None, device="cpu") -> torch.Tensor:
    """``out[i, t] = log p(completion token t of sequence i | its prompt and completion tokens before t)``,
    shape (B, longest completion), zero past each completion's end: what teacher forcing each sequence alone
    gives, computed with one row per group of ``groups`` (sequences sharing a prompt, ``prompt_groups``).

    ``model`` is the causal LM (its config names the attention implementation, which must take a custom 4D
    mask, ``PACK_ATTENTION``); ``forward_model`` (default ``model``) is what is called, e.g. its DDP wrapper.
    """
    rows, width = len(groups), max(len(s) - n for s, n in zip(sequences, prompt_lens))
    lengths = _row_lengths(sequences, prompt_lens, groups)
    span = max(lengths)
    input_ids = torch.full((rows, span), pad_id, dtype=torch.long)
    position_ids = torch.zeros((rows, span), dtype=torch.long)
    segment = torch.full((rows, span), -1, dtype=torch.long)  # -1 prompt, k completion k, -2 padding
    source = torch.zeros((len(sequences), width), dtype=torch.long)  # row-major column predicting each token
    target = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    row_of = torch.zeros(len(sequences), dtype=torch.long)
    for r, group in enumerate(groups):
        n_prompt = prompt_lens[group[0]]
        input_ids[r, :n_prompt] = torch.as_tensor(list(sequences[group[0]][:n_prompt]))
        position_ids[r, :n_prompt] = torch.arange(n_prompt)
        segment[r, lengths[r]:] = -2
        col = n_prompt
        for k, i in enumerate(group):
            completion = torch.as_tensor(list(sequences[i][n_prompt:]))
            n = len(completion)
            input_ids[r, col:col + n] = completion
            position_ids[r, col:col + n] = torch.arange(n_prompt, n_prompt + n)
            segment[r, col:col + n] = k
            source[i, 0] = n_prompt - 1
            source[i, 1:n] = torch.arange(col, col + n - 1)
            target[i, :n] = completion
            row_of[i] = r
            col += n
        position_ids[r, col:] = torch.arange(span - col) + n_prompt  # padding: any position, masked below
    causal = torch.ones((span, span), dtype=torch.bool).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)  # (R, query, key)
    sees_prompt = (segment.unsqueeze(2) >= 0) & (segment.unsqueeze(1) == -1)
    allowed = causal & (sees_prompt | (same & (segment.unsqueeze(1) != -2)))
    allowed |= torch.eye(span, dtype=torch.bool)  # a padding query sees itself: no all-masked row, no NaN
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=model.dtype).masked_fill(~allowed, torch.finfo(model.dtype).min)
    else:
        mask = allowed
    logits = (forward_model or model)(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                                      attention_mask=mask.unsqueeze(1).to(device), use_cache=False).logits
    picked = logits[row_of.to(device).unsqueeze(1), source.to(device)]  # (B, width, vocab)
    if temperature != 1.0:
        picked = picked.float() / temperature
    out = selected_logprobs(picked, target.to(device))
    completion_lens = torch.tensor([len(s) - n for s, n in zip(sequences, prompt_lens)], device=out.device)
    return out.masked_fill(torch.arange(width, device=out.device) >= completion_lens.unsqueeze(1), 0.0)
