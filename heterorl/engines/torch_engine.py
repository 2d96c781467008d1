"""Batched generation with a KV cache on any Hugging Face causal LM (CPU or GPU).

Prompts are left-padded into one batch and prefilled once each; the KV cache
is repeated ``num_samples`` times per prompt, and the batch decodes one token
per step through it. Rows that have stopped keep decoding padding until every
row stops, so the batch shape stays fixed; their extra tokens are discarded.

With ``reuse_prefixes`` each context's keys and values are kept after its generation (heterorl.engines.
prefix_cache), and a later prompt that extends a kept context prefills only its new tokens: a multi-turn
episode's next turn costs the environment's answer, not its whole context.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Sequence

import torch

from heterorl.engines.base import (
    GREEDY_BELOW,
    GenerationWatch,
    SampleOutput,
    SamplingEngine,
    SamplingParams,
    WeightUpdates,
    check_weights,
    stop_reason,
    validate_prompts,
    validate_request,
)
from heterorl.engines.logprobs import pad_right, selected_logprobs, token_logprobs
from heterorl.engines.prefix_cache import PrefixStore, cache_layers, left_padded_cache, row_entries
from heterorl.errors import SamplingError


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[..., 0] = False  # (a top_p below float32's resolution, 1e-300 say, compares as 0 and kept none)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class TorchEngine(SamplingEngine):
    """Sampling engine over a Hugging Face ``*ForCausalLM`` module.

    ``max_batch_sequences`` bounds how many sequences decode together (memory); the samples of one prompt
    always decode together. In-flight updates (``generate(..., updates=)``): newer weights are loaded between
    two decode steps and the KV cache is recomputed with them over prompt + tokens so far (one prefill), so
    every later token's log-prob is exactly that of the version stamped on it.

    Prefix reuse (``generate(..., reuse_prefixes=True)``): each row's context is kept with its KV cache in
    ``prefixes`` (at most ``prefix_cache_bytes``, 1 GiB by default; least recently used evicted), and a later
    prompt that extends a kept context prefills only the rest. New weights empty the store: `load_state_dict`
    (in-flight updates too), and a weight changed in place (an optimizer's step on a model it shares) is seen by
    the tensors' version counters before the next reusing call (`_weights_signature`).
    """

    supports_inflight_updates = True
    supports_watch = True
    supports_prefix_reuse = True

    def __init__(self, model, tokenizer, *, device: str | torch.device = "cpu", max_batch_sequences: int = 1024,
                 prefix_cache_bytes: int = 2**30):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # transformers ≥ 5.2x renamed the KV-cache argument from `past_key_values` to `cache`
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.adapter_loader = None  # loads an unmerged LoRA version into adapter layers placed on the model
        self.prefixes = PrefixStore(prefix_cache_bytes)
        self._prefixes_weights: tuple | None = None  # `_weights_signature` of the weights that computed them

    def _cache_of(self, out):
        return out.cache if self._cache_kwarg == "cache" else out.past_key_values

    def load_state_dict(self, state_dict) -> None:
        """Replace the model's weights; a state whose names or shapes do not fit is refused before any is loaded.
        A LoRA version kept unmerged (a state dict with an ``adapter`` attribute, heterorl.transport.client's
        ``AdapterWeights``) goes to ``adapter_loader``, which whoever placed the adapter layers sets. Either
        empties the prefix store: the old weights' keys and values must not serve the new ones."""
        self.prefixes.clear()
        if getattr(state_dict, "adapter", None):
            if self.adapter_loader is None:
                raise SamplingError("this engine got a LoRA adapter but holds no adapter layers: merge adapters "
                                    "into the weights first (lora.apply=merged)")
            self.adapter_loader(state_dict)
            return
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.model.load_state_dict(check_weights(state_dict, expected, f"this engine's {type(self.model).__name__}"))

    @torch.inference_mode()
    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        sequences = validate_prompts(sequences, self.vocab_size)
        input_ids, attention_mask = pad_right(sequences, self.pad_token_id, self.device)
        logprobs = token_logprobs(self.model, input_ids, attention_mask).cpu()
        return [logprobs[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, num_samples: int = 1,
        updates: WeightUpdates | None = None, watch: GenerationWatch | None = None, reuse_prefixes: bool = False,
    ) -> list[list[SampleOutput]]:
        """``updates``: newer weights taken between decode steps; ``watch``: each step's tokens reported, and a
        cancel honoured between steps (`GenerationWatch`); ``reuse_prefixes``: each prompt's longest kept
        context taken from the store (only the rest prefilled), and every row's context kept after."""
        prompts = validate_request(prompts, params, num_samples, self.vocab_size, self.max_positions)
        if reuse_prefixes and self._prefixes_weights != self._weights_signature():
            self.prefixes.clear()  # weights changed in place since the store was filled
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        per_batch = max(1, self.max_batch_sequences // num_samples)
        outputs: list[SampleOutput] = []
        for start in range(0, len(prompts), per_batch):
            outputs.extend(self._generate_batch(prompts[start : start + per_batch], num_samples, params, generator,
                                                updates, watch, start * num_samples, reuse_prefixes))
        return [outputs[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], num_samples: int, params: SamplingParams,
                        generator, updates: WeightUpdates | None = None, watch: GenerationWatch | None = None,
                        first_row: int = 0, reuse_prefixes: bool = False) -> list[SampleOutput]:
        """Rows ``num_samples`` per prompt, prompt-major (``first_row``: the first one's number for ``watch``).
        Each prompt is prefilled once (with ``reuse_prefixes``, only past its longest kept context) and its KV
        cache repeated for its samples (when the model's cache can be repeated), else prefilled once per row."""
        batch = len(prompts) * num_samples
        cache = next_logits = None
        reused = self._prefill_reusing(prompts) if reuse_prefixes else None
        if reused is not None:
            input_ids, attention_mask, position_ids, cache, next_logits = reused
        else:
            input_ids, attention_mask, position_ids = self._left_padded(prompts)
            if num_samples > 1:  # prefill each prompt once, then repeat its cache for its samples
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=True)
                if hasattr(self._cache_of(out), "batch_repeat_interleave"):
                    cache, next_logits = self._cache_of(out), out.logits[:, -1]
        if num_samples > 1:
            if cache is not None:
                next_logits = next_logits.repeat_interleave(num_samples, 0)
                cache.batch_repeat_interleave(num_samples)
            input_ids, position_ids = (t.repeat_interleave(num_samples, 0) for t in (input_ids, position_ids))
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(num_samples, 0)

        stop_set = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
        stop_ids = torch.tensor(sorted(stop_set), dtype=torch.long, device=self.device)
        tokens = torch.zeros((batch, params.max_tokens), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((batch, params.max_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.full((batch,), params.max_tokens, dtype=torch.long, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        versions = None if updates is None else torch.zeros((batch, params.max_tokens), dtype=torch.long)

        if cache is None:  # one sample per prompt, or a cache that cannot be repeated: prefill every row
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True)
            cache, next_logits = self._cache_of(out), out.logits[:, -1]
        next_position = position_ids[:, -1:] + 1
        for step in range(params.max_tokens):
            if watch is not None:
                watch.check()
            token, token_logprob = self._sample(next_logits, params, generator)
            token = torch.where(done, torch.full_like(token, self.pad_token_id), token)
            tokens[:, step], logprobs[:, step] = token, token_logprob
            if watch is not None:
                live = (~done).nonzero().squeeze(-1).tolist()
                watch.tokens([first_row + r for r in live], token[live].tolist(), token_logprob[live].tolist())
            if versions is not None:
                versions[:, step] = updates.version
            stopped_now = ~done & torch.isin(token, stop_ids)
            lengths = torch.where(stopped_now, torch.full_like(lengths, step + 1), lengths)
            done |= stopped_now
            if bool(done.all()) or step == params.max_tokens - 1:
                break
            if attention_mask is not None:
                ones = torch.ones((batch, 1), dtype=torch.long, device=self.device)
                attention_mask = torch.cat([attention_mask, ones], 1)
            newer = updates.poll() if updates is not None else None
            if newer is not None:  # newer weights: load them, and rebuild the cache with them
                self.load_state_dict(newer[1])
                out = self._prefill(torch.cat([input_ids, tokens[:, : step + 1]], 1), attention_mask)
            else:
                out = self.model(
                    input_ids=token[:, None],
                    attention_mask=attention_mask,
                    position_ids=next_position,
                    use_cache=True,
                    **{self._cache_kwarg: cache},
                )
            cache, next_logits = self._cache_of(out), out.logits[:, -1]
            next_position = next_position + 1

        tokens, logprobs, lengths = tokens.cpu(), logprobs.cpu(), lengths.cpu()
        if reuse_prefixes:
            self._keep_prefixes(prompts, num_samples, tokens, lengths, attention_mask, cache)
        results = []
        for i in range(batch):
            n = int(lengths[i])
            row_tokens = tokens[i, :n].tolist()
            cut = n == params.max_tokens and (not row_tokens or row_tokens[-1] not in stop_set)
            reason = stop_reason(row_tokens, params, self.eos_token_id, cut=cut)
            results.append(SampleOutput(tokens=row_tokens, logprobs=logprobs[i, :n].tolist(), stop_reason=reason,
                                        versions=None if versions is None else versions[i, :n].tolist()))
        return results

    def _left_padded(self, prompts: list[list[int]]):
        """(input ids, attention mask, position ids) of ``prompts`` padded on the left, so that every prompt ends
        at the same column; the mask None when no prompt is padded (attention then takes its plain causal
        path)."""
        prompt_len = max(len(r) for r in prompts)
        input_ids = torch.full((len(prompts), prompt_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), prompt_len), dtype=torch.long)
        for i, row in enumerate(prompts):
            input_ids[i, prompt_len - len(row) :] = torch.tensor(row)
            attention_mask[i, prompt_len - len(row) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return input_ids, None if all(len(r) == prompt_len for r in prompts) else attention_mask, position_ids

    def _prefill_reusing(self, prompts: list[list[int]]):
        """(input ids, attention mask, position ids, cache, next-token logits) of ``prompts``, each one's longest
        kept context (h_i tokens, 0 when none) taken from the store and only the rest (s_i tokens) prefilled;
        None when no prompt extends a kept context. Row i's columns: [pad H - h_i][kept h_i][pad S - s_i]
        [rest s_i], H and S the largest h_i and s_i; the pads masked out, and the positions counting the row's
        tokens only (0..h_i-1 as when the kept keys were computed, then h_i, h_i + 1, ...)."""
        kept = [self.prefixes.longest_prefix(tuple(p)) for p in prompts]
        if all(kv is None for kv in kept):
            return None
        hits = [0 if kv is None else kv.shape[3] for kv in kept]
        width, rest = max(hits), max(len(p) - h for p, h in zip(prompts, hits))
        pad = self.pad_token_id
        rows = [[pad] * (width - h) + p[:h] + [pad] * (rest - len(p) + h) + p[h:] for p, h in zip(prompts, hits)]
        masks = [[0] * (width - h) + [1] * h + [0] * (rest - len(p) + h) + [1] * (len(p) - h)
                 for p, h in zip(prompts, hits)]
        input_ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        attention_mask = torch.tensor(masks, dtype=torch.long, device=self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids[:, width:], attention_mask=attention_mask,
                         position_ids=position_ids[:, width:], use_cache=True,
                         **{self._cache_kwarg: left_padded_cache(kept, width)})
        return input_ids, attention_mask, position_ids, self._cache_of(out), out.logits[:, -1]

    def _keep_prefixes(self, prompts: list[list[int]], num_samples: int, tokens: torch.Tensor,
                       lengths: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> None:
        """Each row's context with its KV cache, in the store: its prompt and its tokens but the last (whose KV
        was never computed), at the cache columns that hold them; never the padding before or within a row,
        nor what a row that stopped early decoded after. A cache the store cannot rebuild is not kept."""
        layers = cache_layers(cache)
        if layers is None:
            return
        self._prefixes_weights = self._weights_signature()
        keys = [tuple(prompts[row // num_samples]) + tuple(tokens[row, : int(n) - 1].tolist())
                for row, n in enumerate(lengths)]
        batch, _, width, _ = layers[0][0].shape
        mask = torch.ones((batch, width), dtype=torch.long, device=self.device) \
            if attention_mask is None else attention_mask
        key_lengths = torch.tensor([len(k) for k in keys], device=self.device)
        stored = (mask == 1) & (mask.cumsum(-1) <= key_lengths[:, None])  # each row's first len(key) real columns
        columns = stored.nonzero()[:, 1].split(stored.sum(-1).tolist())
        new = {key: row for row, key in enumerate(keys) if key not in self.prefixes}  # one row per new key
        wanted = set(new.values())
        entries = row_entries(layers, [c if row in wanted else None for row, c in enumerate(columns)])
        for key, row in new.items():
            self.prefixes.put(key, entries[row])

    def _weights_signature(self) -> tuple:
        """Changes when a weight is replaced (its storage) or written in place by an op that bumps its version
        counter: a load's copy, an optimizer's step (for-loop or foreach, torch's defaults; a fused step bumps
        none, so a model shared with a fused optimizer must not sample with ``reuse_prefixes``)."""
        return tuple((t.data_ptr(), t._version) for t in itertools.chain(self.model.parameters(),
                                                                          self.model.buffers()))

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """A forward over whole (left-padded) rows that returns their KV cache; ``attention_mask`` None: no
        padding."""
        if attention_mask is None:
            position_ids = torch.arange(input_ids.shape[1], device=self.device).expand(input_ids.shape[0], -1)
        else:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return it with its log-prob under the sampling distribution."""
        logits = logits.float()
        if params.temperature < GREEDY_BELOW:  # (logits / 1e-300 are infinite, and their softmax NaN)
            token = logits.argmax(-1)
            return token, selected_logprobs(logits, token)
        logits = _filter_logits(logits / params.temperature, params.top_k, params.top_p)
        logp = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
