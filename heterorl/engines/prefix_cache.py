"""The torch engine's store of keys and values by token prefix: a multi-turn episode's next turn prefills only
what its context gained since the last turn (`TorchEngine.generate(..., reuse_prefixes=True)`).

An entry is the KV cache of one context, over its token positions 0..n-1, keyed by those n token ids: the keys
and values at position j depend only on tokens 0..j (causal attention) and on the weights, so they serve any
later context that starts with the same n tokens, under the same weights. Entries are evicted least recently
used once the stored bytes exceed the budget. Only a `DynamicCache` of full-attention layers is
stored (`cache_layers`): a sliding-window or other cache is never reused, and its contexts are prefilled whole.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PrefixStore:
    """Entries ``{token ids: KV}``, each KV a tensor (layers, 2 (keys, values), kv_heads, n, head_dim), at most
    ``budget_bytes`` in all, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0  # bytes stored
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # entries per key length: a lookup probes each length once
        self._longest_first: list[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self._entries

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._longest_first = []
        self.nbytes = 0

    def longest_prefix(self, prompt: tuple[int, ...]) -> torch.Tensor | None:
        """The KV of the longest stored key that is a strict prefix of ``prompt`` (so at least one token is left
        to prefill), or None."""
        for n in self._longest_first:
            if n < len(prompt):
                kv = self._entries.get(prompt[:n])
                if kv is not None:
                    self._entries.move_to_end(prompt[:n])
                    return kv
        return None

    def put(self, key: tuple[int, ...], kv: torch.Tensor) -> None:
        """Store ``kv`` (its positions: ``len(key)``) under ``key``, evicting the least recently used entries
        to stay within the budget; an entry larger than the whole budget is not stored."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if kv.nbytes > self.budget_bytes:
            return
        while self.nbytes + kv.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = kv
        self.nbytes += kv.nbytes
        self._lengths[len(key)] += 1
        if self._lengths[len(key)] == 1:
            self._longest_first = sorted(self._lengths, reverse=True)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
            self._longest_first = sorted(self._lengths, reverse=True)


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer (keys, values), each (batch, kv_heads, positions, head_dim), of a cache whose entries can be
    stored and rebuilt: a `DynamicCache` of full-attention `DynamicLayer`s. None for any other cache (sliding
    window, linear attention, static): its contexts are not reused."""
    if type(cache) is not DynamicCache:
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or getattr(layer, "keys", None) is None for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def row_entries(layers: list[tuple[torch.Tensor, torch.Tensor]], columns: list[torch.Tensor | None],
                rows_at_once: int = 64) -> list[torch.Tensor | None]:
    """Row i's keys and values at cache columns ``columns[i]`` (None: not wanted), each a store entry of its own
    (a copy: the batch's cache is not kept alive by it), copied ``rows_at_once`` rows at a time (the memory this
    takes beyond the entries)."""
    entries = []
    for start in range(0, len(columns), rows_at_once):
        chunk = columns[start : start + rows_at_once]
        if all(c is None for c in chunk):
            entries += chunk
            continue
        rows = torch.stack([t[start : start + rows_at_once] for kv in layers for t in kv], 1)  # (rows, 2L, ...)
        entries += [None if c is None else rows[i].index_select(2, c).unflatten(0, (len(layers), 2))
                    for i, c in enumerate(chunk)]
    return entries


def left_padded_cache(entries: list[torch.Tensor | None], width: int) -> DynamicCache:
    """One batched cache of ``width`` positions, row i holding ``entries[i]`` right-aligned (zeros before it,
    to be masked out; None: all zeros). At least one entry is given."""
    like = next(entry for entry in entries if entry is not None)
    layers, _, heads, _, head_dim = like.shape
    kv = torch.zeros((layers, 2, len(entries), heads, width, head_dim), dtype=like.dtype, device=like.device)
    for i, entry in enumerate(entries):
        if entry is not None:
            kv[:, :, i, :, width - entry.shape[3]:] = entry
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(kv[layer, 0], kv[layer, 1], layer)
    return cache
