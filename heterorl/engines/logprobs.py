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


# -- log-probs of chosen positions only, never the full [B, S, V] logits ----------------------------------------
# A causal LM's logits are B x S x V floats (SmolLM2's 49,152-token vocabulary: 14.5 GB for one minibatch of 64
# sequences of ~95 tokens, with their float32 copy). Training needs log p of one token at each completion
# position only. So the model runs with its output projection bypassed (it returns its last hidden states), and
# `chunked_target_logprobs` projects only the positions asked for, a chunk of them at a time, keeping per
# position its log-sum-exp alone; its backward recomputes each chunk's logits. Peak: one chunk's logits.
PLAIN_HEADS = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox", "phi3", "olmo2")  # logits = lm_head(h)
CHUNK_LOGIT_BYTES = 64 * 2**20  # float32 logits of one chunk of positions, at most


def plain_head(model) -> torch.nn.Linear | None:
    """``model``'s output projection when its logits are that projection of its last hidden states and nothing
    more (no soft-capping or scaling after it: `PLAIN_HEADS`), so that it can be bypassed; else None."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(config, "model_type", None) not in PLAIN_HEADS or not isinstance(head, torch.nn.Linear):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    if hasattr(head.weight, "full_tensor"):  # (sharded: a DTensor, gathered only inside the module's own forward)
        return None
    return head


class _Bypassed:
    """While entered, ``head``'s forward returns its input: the model's "logits" are its last hidden states."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.head = head

    def __enter__(self) -> None:
        self.head.forward = lambda hidden: hidden  # (an instance attribute: the class's forward is untouched)

    def __exit__(self, *exc) -> None:
        del self.head.forward


def hidden_states(model, head: torch.nn.Linear, forward_model=None, **inputs) -> torch.Tensor:
    """``(forward_model or model)(**inputs)``'s last hidden states, (B, S, H), its output projection ``head``
    bypassed (`plain_head`). A data-parallel wrapper as ``forward_model`` still syncs ``head``'s gradient: the
    gradient reaches it through `chunked_target_logprobs`."""
    with _Bypassed(head):
        return (forward_model or model)(**inputs, use_cache=False).logits


class _TargetLogprobs(torch.autograd.Function):
    """log softmax(h W^T + b)[target] / temperature, per row of h, a chunk of rows at a time (see above). The
    matrix products run in the forward's compute dtype (autocast's, else the weight's; the weight cast once, not
    per chunk), the log-sum-exp and the gradients' accumulation in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, rows: int):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], rows):
            logits = _chunk_logits(hidden[start:start + rows].to(dtype), w, b, temperature)
            lse[start:start + rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[start:start + rows, None]).squeeze(1)
            out[start:start + rows] = picked - lse[start:start + rows]
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse)
        ctx.has_bias, ctx.temperature, ctx.rows, ctx.dtype = bias is not None, temperature, rows, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype = ctx.dtype
        w, b = weight.to(dtype), bias.to(dtype) if ctx.has_bias else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.rows):
            h = hidden[start:start + ctx.rows].to(dtype)
            logits = _chunk_logits(h, w, b, ctx.temperature)
            g = grad_out[start:start + ctx.rows].float().unsqueeze(1)
            # d(logit[target] - lse) / d logits = onehot(target) - softmax, then / temperature for h W^T
            dlogits = torch.exp(logits - lse[start:start + ctx.rows, None]).mul_(-g)
            dlogits.scatter_add_(1, targets[start:start + ctx.rows, None], g)
            dlogits.div_(ctx.temperature)
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
            dlogits = dlogits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + ctx.rows] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                if dtype == torch.float32:
                    grad_weight.addmm_(dlogits.t(), h)
                else:
                    grad_weight += dlogits.t() @ h
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None, None, None)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias, temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


def chunked_target_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(head(hidden) / temperature)[targets]`` for hidden states ``hidden`` (..., H) and token ids
    ``targets`` (...), in float32, with gradients for ``hidden`` and ``head``: the logits are made a chunk of
    positions at a time (`CHUNK_LOGIT_BYTES`), in the head's dtype, accumulated in float32, and never kept."""
    shape = targets.shape
    flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = max(1, CHUNK_LOGIT_BYTES // (4 * head.weight.shape[0]))
    return _TargetLogprobs.apply(flat, head.weight, head.bias, wanted, float(temperature), rows).reshape(shape)


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


def completion_logprobs(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], pad_id: int,
                        temperature: float = 1.0, forward_model=None, device="cpu") -> torch.Tensor:
    """``out[i, j] = log p(completion token j of sequence i | the tokens before it)``, shape (B, longest
    completion), garbage past each completion's end: one right-padded row per sequence. With a plain output
    projection (`plain_head`) only the completion positions are projected, a chunk at a time; else the model's
    full logits. ``forward_model`` (default ``model``) is what is called, e.g. its DDP wrapper."""
    input_ids, attention_mask = pad_right(sequences, pad_id, device)
    width = max(len(s) - n for s, n in zip(sequences, prompt_lens))
    # completion token j of sequence i sits at column prompt_len + j, predicted from column prompt_len + j - 1
    cols = torch.stack([torch.arange(width) + n - 1 for n in prompt_lens]).clamp(max=input_ids.shape[1] - 2)
    cols = cols.to(input_ids.device)
    head = plain_head(model)
    if head is None:
        return token_logprobs(forward_model or model, input_ids, attention_mask, temperature).gather(1, cols)
    hidden = hidden_states(model, head, forward_model, input_ids=input_ids, attention_mask=attention_mask)
    lengths = torch.tensor([len(s) - n for s, n in zip(sequences, prompt_lens)], device=hidden.device)
    rows = torch.arange(len(sequences), device=hidden.device)
    return completion_positions_logprobs(hidden, rows, cols, input_ids.gather(1, cols + 1), lengths, head,
                                         temperature)


def completion_positions_logprobs(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                                  targets: torch.Tensor, lengths: torch.Tensor, head: torch.nn.Linear,
                                  temperature: float = 1.0) -> torch.Tensor:
    """``out[i, t] = log p(targets[i, t])`` from the hidden state at ``hidden[rows[i], cols[i, t]]`` for
    ``t < lengths[i]``, zero past it, shape (B, width): only those positions are projected
    (`chunked_target_logprobs`), none past a completion's end."""
    width = cols.shape[1]
    i, t = (torch.arange(width, device=cols.device)[None] < lengths[:, None]).nonzero(as_tuple=True)
    picked = chunked_target_logprobs(hidden[rows[i], cols[i, t]], head, targets[i, t], temperature)
    return torch.zeros((len(rows), width), dtype=picked.dtype, device=picked.device).index_put((i, t), picked)
