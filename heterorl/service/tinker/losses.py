"""Tinker's losses with their documented semantics, over heterorl's training clients.

A Tinker datum is token-level: ``model_input`` (N tokens) and per-position ``loss_fn_inputs`` — ``target_tokens``
(the next token at each position), ``weights``, the sampler's ``logprobs``, ``advantages``. It becomes a heterorl
`Datum` whose prompt is the first token and whose completion is every target (``tokens = model_input +
[target_tokens[-1]]``, so the training client scores all N positions), and the loss is a callable that
`TrainingClient.forward_backward` runs on those N log-probs with the per-position inputs beside them.

With lp the learner's log-prob of each target, q the sampler's, A the advantage and r = exp(lp - q), every loss
is a sum over datums and positions (no mean):

    cross_entropy         -(lp * weights).sum()                                 (weights may be any real numbers)
    importance_sampling   -(r * A).sum()
    ppo                   -min(r * A, clip(r, low, high) * A).sum()             low 0.8, high 1.2
    cispo                 -(sg(clip(r, low, high)) * A * lp).sum()              low 0.0, high 4.0
    dro                   -(lp * A - beta / 2 * (lp - q) ** 2).sum()            beta 0.05
    gspo                  s = exp(mean over sequence_ratio_mask of sg(lp) - q); r_t = s * exp(lp - sg(lp));
                          -min(r_t * A, clip(r_t, low, high) * A).sum()        low 1 - 3e-4, high 1 + 4e-4

(``low``/``high``: ``clip_low_threshold``/``clip_high_threshold`` in ``loss_fn_config``, bounds on the ratio
itself.) Any other name heterorl registers (docs/LOSSES.md: grpo, gepo, ...) runs as heterorl defines it, on
the positions whose advantage is not 0, with one advantage per datum (``advantage: "given"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import gepo
from heterorl.errors import HeteroRLError
from heterorl.service.tinker.protobuf import Datum as TinkerDatum
from heterorl.training.session import Datum

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
NOT_SUPPORTED = {
    "stable_reinforce": "its formula is not published, and heterorl does not guess it: pass "
                        "loss_fn=importance_sampling (or ppo, cispo, dro, gspo)",
    "custom": "server-side custom losses are not supported: use forward_backward_custom, which needs nothing "
              "from the server",
}
DEFAULTS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
            "dro": {"beta": 0.05}, "cross_entropy": {}, "importance_sampling": {}}
INPUTS = {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}
NEEDS = {"cross_entropy": ("target_tokens",), "gspo": ("target_tokens", "logprobs", "advantages")}


class TinkerLossError(HeteroRLError):
    """A forward_backward request heterorl cannot run as asked: an unknown loss, inputs that do not fit it."""


@dataclass
class TokenInputs:
    """The per-position inputs of a batch, (B, T) and zero past each datum's N, beside the loss's name and
    config: what a Tinker loss reads besides the learner's log-probs."""

    loss: str
    config: dict
    weights: torch.Tensor | None
    sampler_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    ratio_mask: torch.Tensor | None


def tinker_loss(batch: gepo.LossBatch, inputs: TokenInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """One of `TINKER_LOSSES` on ``batch.logprobs`` (B, T), as the module says."""
    lp, valid = batch.logprobs, batch.keep
    zero = torch.zeros_like(lp)

    def on(x: torch.Tensor | None) -> torch.Tensor:
        return zero if x is None else torch.where(valid, x.to(lp.device, lp.dtype), zero)

    lp_valid = torch.where(valid, lp, zero)  # (past a datum's end the log-probs are padding)
    if inputs.loss == "cross_entropy":
        weights = on(inputs.weights) if inputs.weights is not None else valid.to(lp.dtype)
        loss = -(lp_valid * weights).sum()
        return loss, {"loss:sum": float(loss.detach())}
    q, advantages = on(inputs.sampler_logprobs), on(inputs.advantages)
    log_ratio = lp_valid - q
    ratio = torch.where(valid, torch.exp(log_ratio), zero)
    low, high = inputs.config.get("clip_low_threshold"), inputs.config.get("clip_high_threshold")
    if inputs.loss == "importance_sampling":
        terms = ratio * advantages
    elif inputs.loss == "ppo":
        terms = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    elif inputs.loss == "cispo":
        terms = ratio.clamp(low, high).detach() * advantages * lp_valid
    elif inputs.loss == "dro":
        terms = lp_valid * advantages - 0.5 * inputs.config["beta"] * log_ratio ** 2
    else:  # gspo
        mask = on(inputs.ratio_mask) if inputs.ratio_mask is not None else (advantages != 0).to(lp.dtype)
        count = mask.sum(-1).clamp(min=1)
        log_s = ((lp_valid.detach() - q) * mask).sum(-1) / count
        token_ratio = torch.exp(log_s)[:, None] * torch.exp(lp_valid - lp_valid.detach())
        terms = torch.minimum(token_ratio * advantages, token_ratio.clamp(low, high) * advantages) * (mask > 0)
    loss = -torch.where(valid, terms, zero).sum()
    return loss, {"loss:sum": float(loss.detach())}


def _vector(datum: TinkerDatum, key: str, n: int, index: int) -> np.ndarray | None:
    value = datum.inputs.get(key)
    if value is None:
        return None
    if value.shape != (n,):
        raise TinkerLossError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; heterorl "
                              f"takes one value per position of the model input ([{n}]; 2-D targets, as for "
                              "distillation against several tokens, are not supported)")
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        raise TinkerLossError(f"datum {index}: loss_fn_inputs[{key!r}] holds NaN or infinite values")
    return value


def _config(loss: str, given: dict) -> dict:
    known = DEFAULTS[loss]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TinkerLossError(f"loss {loss!r} has no option(s) {unknown} in loss_fn_config; its options: "
                              f"{sorted(known) or 'none'}")
    config = {**known, **given}
    for key, value in config.items():
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            raise TinkerLossError(f"loss_fn_config[{key!r}] = {value!r}: give a finite number")
    if "clip_low_threshold" in config and config["clip_low_threshold"] > config["clip_high_threshold"]:
        raise TinkerLossError(f"loss {loss!r}: clip_low_threshold {config['clip_low_threshold']} is above "
                              f"clip_high_threshold {config['clip_high_threshold']}")
    return config


def build(data: list[TinkerDatum], loss: str, loss_config: dict) -> tuple[list[Datum], object, object]:
    """(datums, loss_fn, loss_config) for `TrainingClient.forward_backward` from a request's datums; a
    `TinkerLossError` naming the datum, input or option that does not fit."""
    if loss in NOT_SUPPORTED:
        raise TinkerLossError(f"loss_fn {loss!r}: {NOT_SUPPORTED[loss]}")
    ours = loss not in TINKER_LOSSES
    if ours and loss not in gepo.loss_names():
        raise TinkerLossError(f"unknown loss_fn {loss!r}: Tinker's {', '.join(TINKER_LOSSES)}, or one of "
                              f"heterorl's ({', '.join(n for n in gepo.loss_names() if n not in TINKER_LOSSES)})")
    if not data:
        raise TinkerLossError("forward_backward got no datums")
    datums, columns = [], {"weights": [], "logprobs": [], "advantages": [], "sequence_ratio_mask": []}
    for index, datum in enumerate(data):
        n = len(datum.tokens)
        unknown = sorted(set(datum.inputs) - INPUTS)
        if unknown:
            raise TinkerLossError(f"datum {index}: loss_fn_inputs {unknown} are not taken here (heterorl takes "
                                  f"{sorted(INPUTS)}; per-datum clip thresholds go in loss_fn_config)")
        for key in NEEDS.get(loss, ("target_tokens", "logprobs", "advantages")):
            if key not in datum.inputs:
                raise TinkerLossError(f"datum {index}: loss {loss!r} needs loss_fn_inputs[{key!r}]")
        if n == 0:
            raise TinkerLossError(f"datum {index}: its model_input is empty")
        targets = _vector(datum, "target_tokens", n, index)
        if targets.dtype.kind not in "iu":
            raise TinkerLossError(f"datum {index}: target_tokens must be integers (int64)")
        if not np.array_equal(targets[:-1], np.asarray(datum.tokens[1:])):
            raise TinkerLossError(f"datum {index}: target_tokens must be the model input shifted by one (position "
                                  "i predicts model_input[i + 1]), as Tinker's docs build them; heterorl scores "
                                  "the sequence model_input + [target_tokens[-1]]")
        for key in columns:
            columns[key].append(_vector(datum, key, n, index))
        datums.append(Datum(tokens=[*datum.tokens, int(targets[-1])], prompt_len=1))
    if ours:
        return _ours(datums, columns, loss, loss_config)

    def padded(key: str) -> torch.Tensor | None:
        values = columns[key]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise TinkerLossError(f"datum {[v is None for v in values].index(True)} has no {key} but others do: "
                                  "give it to all datums or to none")
        out = torch.zeros((len(values), max(len(v) for v in values)), dtype=torch.float32)
        for i, v in enumerate(values):
            out[i, :len(v)] = torch.from_numpy(np.asarray(v, dtype=np.float32))
        return out

    inputs = TokenInputs(loss, _config(loss, loss_config), padded("weights"), padded("logprobs"),
                         padded("advantages"), padded("sequence_ratio_mask"))
    return datums, tinker_loss, inputs


def _ours(datums: list[Datum], columns: dict, loss: str, loss_config: dict):
    """A heterorl loss on Tinker datums: the positions with a non-zero advantage are trained, the datum's
    advantage is theirs (one value per datum), the sampler's log-probs are the behaviour log-probs."""
    for i, datum in enumerate(datums):
        advantages, q = columns["advantages"][i], columns["logprobs"][i]
        trained = advantages != 0
        values = np.unique(advantages[trained])
        if len(values) > 1:
            raise TinkerLossError(f"datum {i}: heterorl's loss {loss!r} takes one advantage per sequence, and "
                                  f"this datum's non-zero advantages differ ({values[:4].tolist()}...)")
        datum.advantage = float(values[0]) if len(values) else 0.0
        datum.behaviour_logprobs = q.astype(float).tolist()
        datum.weights = trained.astype(float).tolist()
    options = dict(loss_config)
    try:
        fields = {f for f in gepo.get_loss(loss).config_cls.__dataclass_fields__}
    except KeyError as exc:
        raise TinkerLossError(str(exc)) from None
    if "advantage" in fields:
        options.setdefault("advantage", "given")
    return datums, loss, options


def metrics_for_tinker(loss: float, metrics: dict[str, float], ours: bool) -> dict[str, float]:
    """The output's metrics as the SDK merges them ("name:reduction"): a Tinker loss's own, or heterorl's
    (averaged across chunks, ``name:mean``) with the loss as ``loss:sum``."""
    if not ours:
        return metrics
    out = {f"{key.replace(':', '_')}:mean": float(value) for key, value in metrics.items()
           if isinstance(value, (int, float))}
    out["loss:sum"] = float(loss)
    return out
