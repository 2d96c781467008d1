"""A forward_backward in micro-batches of at most ``tokens_per_microbatch`` tokens (`optim.tokens_per_microbatch`),
so that the learner's memory is set by a number the user chooses, not by the minibatch.

The loss is a function of the whole minibatch (group baselines, normalisations over all tokens), but it reaches
the model only through the completion log-probs: ∇θ L = Σ_t (∂L/∂log p_t) ∇θ log p_t. So:

1. the log-probs of every micro-batch are taken without gradients;
2. the loss is computed once, on all of them (a leaf tensor), and its backward gives each log-prob's
   coefficient ∂L/∂log p_t (one pass through the loss, not the model);
3. each micro-batch is run again with gradients and backpropagated with its coefficients as the output's
   gradient, accumulating into the parameters' gradients.

The gradient is the one pass's (Σ over micro-batches of the same terms), at the cost of one more forward without
gradients. Each micro-batch's second forward replays the random state of its first, so dropout draws the same
masks. Under data parallelism every micro-batch but the last backpropagates without the all-reduce
(``no_sync``)."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from heterorl.engines.packing import prompt_groups


def split(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``sequences`` in micro-batches of at most ``budget`` tokens each, in order: a group of sequences
    sharing a prompt stays together when it fits (its prompt is then run once), else it is split; a sequence
    longer than the budget is a micro-batch of its own. One micro-batch of all when ``budget`` is 0."""
    if budget <= 0:
        return [list(range(len(sequences)))]
    units: list[list[int]] = []
    for group in prompt_groups(sequences, prompt_lens):
        if sum(len(sequences[i]) for i in group) <= budget:
            units.append(group)
        else:
            units.extend([i] for i in group)
    batches: list[list[int]] = []
    tokens = 0
    for unit in units:
        size = sum(len(sequences[i]) for i in unit)
        if batches and tokens + size <= budget:
            batches[-1].extend(unit)
            tokens += size
        else:
            batches.append(list(unit))
            tokens = size
    return [sorted(batch) for batch in batches]


def _rng_state() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def backward(batches: list[list[int]], completion_lens: Sequence[int],
             logprobs_of: Callable[[list[int], bool], torch.Tensor],
             loss_of: Callable[[torch.Tensor], tuple[torch.Tensor, dict]], no_sync=None
             ) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The loss, its metrics and the log-probs (B, longest completion) of a minibatch whose log-probs
    ``logprobs_of(indices, with_grad)`` gives per micro-batch (``batches``, `split`), with the gradient of the
    loss ``loss_of(logprobs)`` accumulated in the model's parameters (see the module). ``loss_of`` may raise
    before anything is backpropagated (a loss that is not finite). ``no_sync``: the data-parallel wrapper's
    context that skips the all-reduce (None: none)."""
    states, parts = [], []
    for indices in batches:
        states.append(_rng_state())
        with torch.no_grad():
            parts.append(logprobs_of(indices, False))
    width = max(part.shape[1] for part in parts)
    logprobs = torch.zeros((len(completion_lens), width), dtype=torch.float32, device=parts[0].device)
    for indices, part in zip(batches, parts):
        logprobs[indices, :part.shape[1]] = part.float()
    leaf = logprobs.clone().requires_grad_(True)
    loss, metrics = loss_of(leaf)
    loss.backward()
    lens = torch.tensor(list(completion_lens), device=leaf.device)
    coefficients = leaf.grad.masked_fill(torch.arange(width, device=leaf.device)[None] >= lens[:, None], 0.0)
    for k, (indices, state) in enumerate(zip(batches, states)):
        _set_rng_state(state)
        last = k == len(batches) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            part = logprobs_of(indices, True)
            part.backward(coefficients[indices, :part.shape[1]].to(part.dtype))
    return loss.detach(), metrics, logprobs
