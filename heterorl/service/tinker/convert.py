"""What Tinker's JSON bodies become in heterorl, and what heterorl's results become for Tinker: a LoRA config,
Adam's parameters, a prompt, sampling parameters and stop strings, a sample cut at its stop."""

from __future__ import annotations

import math

from heterorl.engines.base import STOP_LENGTH, SamplingParams
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.service.bounds import MAX_PROMPT_TOKENS, check_stops, excerpt
from heterorl.service.calls import BadRequest
from heterorl.service.openai_generation import finish
from heterorl.service.tinker import protobuf
from heterorl.training.session import AdamParams

DEFAULT_MAX_TOKENS = 64  # a sample request without max_tokens
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def lora_spec(config: dict | None) -> dict | None:
    """heterorl's LoRA request from Tinker's ``lora_config`` ({rank, train_attn, train_mlp, train_unembed,
    seed}): the attention and/or MLP projections; the unembedding is never adapted (heterorl leaves the output
    head out: it is tied to the embedding in small models)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest(f"lora_config: give a map, got {config!r}")
    rank = config.get("rank", 32)
    targets = [*(ATTN if config.get("train_attn", True) else ()), *(MLP if config.get("train_mlp", True) else ())]
    if not targets:
        raise BadRequest("lora_config: train_attn and train_mlp are both false; heterorl adapts the attention "
                         "and/or MLP projections (never the unembedding alone)")
    if type(rank) is not int or rank < 1:
        raise BadRequest(f"lora_config.rank {rank!r}: give an integer >= 1")
    return {"rank": rank, "alpha": float(2 * rank), "target_modules": targets}


def adam_params(adam: dict) -> AdamParams:
    if not isinstance(adam, dict):
        raise BadRequest("give adam_params (heterorl steps with AdamW only)")
    try:
        clip = adam.get("grad_clip_norm", 0.0)
        params = AdamParams(learning_rate=float(adam.get("learning_rate", 1e-4)), beta1=float(adam.get("beta1", 0.9)),
                            beta2=float(adam.get("beta2", 0.95)), eps=float(adam.get("eps", 1e-12)),
                            weight_decay=float(adam.get("weight_decay", 0.0)),
                            grad_clip_norm=float(clip) if clip else None)
    except ConfigError as exc:  # (a value AdamW cannot take, named)
        raise BadRequest(f"adam_params: {exc}") from None
    except (TypeError, ValueError):
        raise BadRequest(f"adam_params must hold numbers, got {excerpt(adam)}") from None
    return params


def prompt_tokens(prompt) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (text chunks only)."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise BadRequest("prompt must be a ModelInput with at least one chunk")
    tokens = []
    for chunk in chunks:
        kind = chunk.get("type") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise BadRequest(f"a prompt chunk of type {kind!r}: heterorl samples from text tokens only "
                             "(encoded_text chunks)")
        values = chunk.get("tokens")
        if not isinstance(values, list) or len(tokens) + len(values) > MAX_PROMPT_TOKENS:
            raise BadRequest(f"an encoded_text chunk's tokens must be a list of token ids, at most "
                             f"{MAX_PROMPT_TOKENS:,} in a prompt")
        if not all(type(t) is int and t >= 0 for t in values):
            raise BadRequest("an encoded_text chunk's tokens must be a list of token ids")
        tokens += values
    if not tokens:
        raise BadRequest("the prompt has no tokens")
    return tokens


def sampling_params(params: dict) -> tuple[SamplingParams, list[str]]:
    """heterorl's `SamplingParams` and the stop strings of Tinker's ``sampling_params``: top_k -1 is off, ``stop``
    None stops at the end of sequence only, [] at nothing (not even it), strings or token ids besides it."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a map")
    stop = params.get("stop")
    stops: list[str] = []
    stop_ids: list[int] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    elif isinstance(stop, list) and all(type(s) is int for s in stop):
        stop_ids = list(stop)
    elif stop is not None:
        raise BadRequest(f"sampling_params.stop must be a string, a list of strings or of token ids, got "
                         f"{stop!r}")
    check_stops("sampling_params.stop", stops, stop_ids)
    top_k = params.get("top_k", -1)
    max_tokens = params.get("max_tokens")
    try:
        made = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                              temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
                              top_k=0 if top_k == -1 else top_k, stop_token_ids=tuple(stop_ids),
                              seed=params.get("seed"), ignore_eos=stop == [])
    except (HeteroRLError, TypeError) as exc:
        raise BadRequest(f"sampling_params: {exc}") from None
    return made, stops


def prompt_logprobs(scored, last_n) -> list[float]:
    """Tinker's prompt log-probs: NaN for the first token (nothing predicts it), then each token's; with
    ``last_n``, NaN for all but the last n."""
    values = [math.nan, *[float(x) for x in scored]]
    if type(last_n) is int and 0 <= last_n < len(values):
        values[:len(values) - last_n] = [math.nan] * (len(values) - last_n)
    return values


def cut(tokenizer, prompt: list[int], samples, stops: list[str]) -> list[protobuf.Sequence]:
    """Each sample as Tinker answers it: through the token that completed the first stop string (or the stop
    token, or the end of sequence), with its log-probs; stopped unless max_tokens ended it."""
    out = []
    for sample in samples:
        if stops:
            choice = finish(tokenizer, prompt, sample, stops, token_ids=False)
            n = len(choice.tokens)
            out.append(protobuf.Sequence(sample.tokens[:n], sample.logprobs[:n], choice.finish_reason == "stop"))
        else:
            out.append(protobuf.Sequence(sample.tokens, sample.logprobs, sample.stop_reason != STOP_LENGTH))
    return out
