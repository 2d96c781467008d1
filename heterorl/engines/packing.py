"""Padding-free rows for the learner's forward: several sequences to a row, never a row per sequence padded to
the longest.

A minibatch's sequences differ in length (completions end where they end), and a group's completions repeat one
prompt. Two layouts remove the waste, both giving the log-probs and gradients of one row per sequence:

- **shared prompts** (attention that takes a custom 4D mask, `SHARED_PROMPT_ATTENTION`): a group's prompt once,
  then each completion, each completion seeing the prompt and itself only (a tree mask); several groups to a
  row, each its own block.
- **position-id packing** (`POSITION_PACKED` models, any attention): whole sequences one after another, their
  position ids restarting at 0 and no mask given; the model then attends within each sequence only (Hugging Face
  models turn restarting position ids into a block-diagonal causal mask for ``sdpa``/``eager``, and into
  ``flash_attention_2``'s variable-length kernel, which needs no mask at all: there every sequence goes in one
  row, `VARLEN_ATTENTION`).

`plan` picks the layout for a minibatch and a model (or none: one right-padded row per sequence,
`heterorl.engines.logprobs.completion_logprobs`); `packed_completion_logprobs` runs it. Units (a group behind
its prompt, or one sequence) are placed in rows first-fit by decreasing length, rows as long as the longest unit
(a longer row would cost more in attention than it saves), one row for variable-length attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from heterorl.engines import logprobs

SHARED_PROMPT_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # packed by position ids alone, in one row
# model types whose masks come from restarting position ids (transformers' `create_causal_mask`), tested on Llama
POSITION_PACKED = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox", "phi3", "olmo2")
PACK_MAX_ROW = 2048  # a shared-prompt row longer than this costs more in attention than the shared prompt saves
PACK_MIN_SAVING = 0.25  # share prompts only when that removes at least this share of the tokens
PADDING_MIN_SAVING = 0.10  # pack by position ids only when that removes at least this share of the padded cells
PACK_MAX_MASK = 2**28  # rows x row length^2 entries of a mask (256 MiB as bool): beyond, one row per sequence


def prompt_groups(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences that share one prompt (exact tokens), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, (seq, n) in enumerate(zip(sequences, prompt_lens)):
        groups.setdefault(tuple(seq[:n]), []).append(i)
    return list(groups.values())


@dataclass(frozen=True)
class Layout:
    """Where each sequence goes: ``rows`` of units, a unit being the indices of sequences behind one copy of
    their prompt (one index: a sequence alone), each row ``width`` tokens; ``shared_prompts``: the rows need the
    tree mask (else position ids alone separate the units)."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]
    width: int
    shared_prompts: bool

    @property
    def cells(self) -> int:
        return len(self.rows) * self.width


def _unit_length(sequences, prompt_lens, unit) -> int:
    """Tokens of a unit: its prompt once, then every member's completion."""
    return prompt_lens[unit[0]] + sum(len(sequences[i]) - prompt_lens[i] for i in unit)


def layout(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], units: list[list[int]],
           shared_prompts: bool, width: int | None = None) -> Layout:
    """``units`` placed in rows of ``width`` tokens (default: the longest unit's), first-fit by decreasing
    length; a unit longer than ``width`` is a row of its own as long as it."""
    lengths = [_unit_length(sequences, prompt_lens, unit) for unit in units]
    width = max(max(lengths), width or 0)
    rows: list[list[tuple[int, ...]]] = []
    free: list[int] = []
    for k in sorted(range(len(units)), key=lambda k: (-lengths[k], k)):
        row = next((r for r, room in enumerate(free) if room >= lengths[k]), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(tuple(units[k]))
        free[row] -= lengths[k]
    return Layout(tuple(tuple(row) for row in rows), width, shared_prompts)


def plan(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
         share_prompts: bool = True) -> Layout | None:
    """The layout ``packed_completion_logprobs`` should run this minibatch with on ``model``, or None when one
    right-padded row per sequence is as good or the model cannot take either layout (see the module).

    Shared prompts when the attention takes a 4D mask, ``share_prompts``, they remove ≥ `PACK_MIN_SAVING` of
    the tokens, no row passes `PACK_MAX_ROW` and the mask fits `PACK_MAX_MASK`; else position-id packing for a
    `POSITION_PACKED` model when it removes ≥ `PADDING_MIN_SAVING` of the padded cells (and, but for
    variable-length attention, the block mask the model builds fits `PACK_MAX_MASK`)."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if share_prompts and attention in SHARED_PROMPT_ATTENTION:
        groups = prompt_groups(sequences, prompt_lens)
        if len(groups) < len(sequences):
            total = sum(len(s) for s in sequences)
            saved = sum(prompt_lens[g[0]] * (len(g) - 1) for g in groups)
            shared = layout(sequences, prompt_lens, groups, True)
            if (saved >= PACK_MIN_SAVING * total and shared.width <= PACK_MAX_ROW
                    and len(shared.rows) * shared.width ** 2 <= PACK_MAX_MASK):
                return shared
    if getattr(config, "model_type", None) not in POSITION_PACKED:
        return None
    singles = [[i] for i in range(len(sequences))]
    padded = len(sequences) * max(len(s) for s in sequences)
    if attention in VARLEN_ATTENTION:
        return layout(sequences, prompt_lens, singles, False, width=sum(len(s) for s in sequences))
    if attention not in SHARED_PROMPT_ATTENTION:
        return None
    flat = layout(sequences, prompt_lens, singles, False)
    if flat.cells > (1 - PADDING_MIN_SAVING) * padded or len(flat.rows) * flat.width ** 2 > PACK_MAX_MASK:
        return None
    return flat


def packed_completion_logprobs(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                               plan: Layout, pad_id: int, temperature: float = 1.0,
                               forward_model=None, device="cpu") -> torch.Tensor:
    """``out[i, t] = log p(completion token t of sequence i | its prompt and completion tokens before t)``,
    shape (B, longest completion), zero past each completion's end: what teacher forcing each sequence alone
    gives, computed in the rows of ``plan`` (`plan`, `layout`).

    ``model`` is the causal LM; ``forward_model`` (default ``model``) is what is called, e.g. its DDP wrapper."""
    rows, span = len(plan.rows), plan.width
    width = max(len(s) - n for s, n in zip(sequences, prompt_lens))
    input_ids = torch.full((rows, span), pad_id, dtype=torch.long)
    position_ids = torch.zeros((rows, span), dtype=torch.long)
    unit_of = torch.full((rows, span), -1, dtype=torch.long)  # which unit of its row a token is in; -1 padding
    segment = torch.full((rows, span), -1, dtype=torch.long)  # -1 the unit's prompt, k its completion k
    source = torch.zeros((len(sequences), width), dtype=torch.long)  # the column predicting each token
    target = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    row_of = torch.zeros(len(sequences), dtype=torch.long)
    for r, units in enumerate(plan.rows):
        col = 0
        for u, unit in enumerate(units):
            n_prompt = prompt_lens[unit[0]]
            input_ids[r, col:col + n_prompt] = torch.as_tensor(list(sequences[unit[0]][:n_prompt]))
            position_ids[r, col:col + n_prompt] = torch.arange(n_prompt)
            unit_of[r, col:col + n_prompt] = u
            prompt_end = col + n_prompt
            col = prompt_end
            for k, i in enumerate(unit):
                completion = torch.as_tensor(list(sequences[i][n_prompt:]))
                n = len(completion)
                input_ids[r, col:col + n] = completion
                position_ids[r, col:col + n] = torch.arange(n_prompt, n_prompt + n)
                unit_of[r, col:col + n] = u
                segment[r, col:col + n] = k
                source[i, 0] = prompt_end - 1
                source[i, 1:n] = torch.arange(col, col + n - 1)
                target[i, :n] = completion
                row_of[i] = r
                col += n
        position_ids[r, col:] = torch.arange(span - col)  # padding: a block of its own
    inputs = dict(input_ids=input_ids.to(device), position_ids=position_ids.to(device))
    if plan.shared_prompts:
        inputs["attention_mask"] = _tree_mask(model, unit_of, segment).unsqueeze(1).to(device)
    completion_lens = torch.tensor([len(s) - n for s, n in zip(sequences, prompt_lens)], device=device)
    row_of, source, target = row_of.to(device), source.to(device), target.to(device)
    head = logprobs.plain_head(model)  # (looked up on its module: a bench or a test may replace it)
    if head is not None:  # (only the completion positions are projected, a chunk at a time)
        hidden = logprobs.hidden_states(model, head, forward_model, **inputs)
        return logprobs.completion_positions_logprobs(hidden, row_of, source, target, completion_lens, head,
                                                      temperature)
    logits = (forward_model or model)(**inputs, use_cache=False).logits
    picked = logits[row_of.unsqueeze(1), source]  # (B, width, vocab)
    if temperature != 1.0:
        picked = picked.float() / temperature
    out = logprobs.selected_logprobs(picked, target)
    return out.masked_fill(torch.arange(width, device=out.device) >= completion_lens.unsqueeze(1), 0.0)


def _tree_mask(model, unit_of: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(rows, query, key): a query sees, causally, its own unit's prompt and its own completion; a padding query
    sees itself only (no all-masked row, no NaN). Bool for ``sdpa``, additive for ``eager``."""
    span = unit_of.shape[1]
    causal = torch.ones((span, span), dtype=torch.bool).tril()
    same_unit = (unit_of.unsqueeze(2) == unit_of.unsqueeze(1)) & (unit_of.unsqueeze(1) >= 0)
    same_segment = segment.unsqueeze(2) == segment.unsqueeze(1)
    key_is_prompt = segment.unsqueeze(1) == -1
    allowed = causal & same_unit & (key_is_prompt | same_segment)
    allowed |= torch.eye(span, dtype=torch.bool)
    if model.config._attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=model.dtype).masked_fill(~allowed, torch.finfo(model.dtype).min)
    return allowed
