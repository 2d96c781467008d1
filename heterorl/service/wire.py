"""What the training-session service and its client send each other: the session primitives' arguments and
results as plain values (JSON or msgpack), a state dict as safetensors bytes, and errors by name.

Everything here is symmetric: the server decodes what the client encodes and the other way round, so a remote
call takes and returns the same Python objects as a local one (`heterorl.training.session`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import torch

import gepo
from heterorl import errors
from heterorl.engines.base import SampleOutput, SamplingParams
from heterorl.policies.storage import storage_key
from heterorl.runs import json_text
from heterorl.training.session import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

MSGPACK = "application/msgpack"
JSON = "application/json"


def datum_to_wire(d: Datum) -> dict:
    # the fields as they are (`dataclasses.asdict` deep-copies every list: 17x slower on a batch of 64)
    return {f.name: value for f in dataclasses.fields(d) if (value := getattr(d, f.name)) is not None}


def datum_from_wire(raw: dict) -> Datum:
    return Datum(**raw)


def params_to_wire(p: SamplingParams | None) -> dict | None:
    return None if p is None else {**dataclasses.asdict(p), "stop_token_ids": list(p.stop_token_ids)}


def params_from_wire(raw: dict | None) -> SamplingParams | None:
    return None if raw is None else SamplingParams(**raw)


def adam_from_wire(raw: dict | None) -> AdamParams | None:
    return None if raw is None else AdamParams(**raw)


def sample_to_wire(s: SampleOutput) -> dict:
    return {"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason, "text": s.text,
            "versions": None if s.versions is None else list(s.versions)}


def sample_from_wire(raw: dict) -> SampleOutput:
    return SampleOutput(tokens=raw["tokens"], logprobs=raw["logprobs"], stop_reason=raw["stop_reason"],
                        text=raw.get("text", ""), versions=raw.get("versions"))


def samples_to_wire(result) -> Any:
    """A `SamplingClient.sample` result: the samples of one prompt, or of each of several."""
    if result and isinstance(result[0], list):
        return [[sample_to_wire(s) for s in group] for group in result]
    return [sample_to_wire(s) for s in result]


def samples_from_wire(raw) -> Any:
    if raw and isinstance(raw[0], list):
        return [[sample_from_wire(s) for s in group] for group in raw]
    return [sample_from_wire(s) for s in raw]


def result_to_wire(value) -> Any:
    """A primitive's result as plain values (``kind`` tells the client what to rebuild)."""
    if isinstance(value, ForwardBackwardOutput):
        return {"kind": "forward_backward", "loss": value.loss, "metrics": value.metrics, "logprobs": value.logprobs}
    if isinstance(value, OptimStepOutput):
        return {"kind": "optim_step", **dataclasses.asdict(value)}
    return {"kind": "value", "value": value}


def result_from_wire(raw: dict) -> Any:
    kind = raw.get("kind")
    if kind == "forward_backward":
        return ForwardBackwardOutput(loss=raw["loss"], metrics=raw["metrics"], logprobs=raw["logprobs"])
    if kind == "optim_step":
        return OptimStepOutput(grad_norm=raw["grad_norm"], step=raw["step"], skipped=raw.get("skipped", False))
    return raw.get("value")


# -- errors: the local exception classes, by name -----------------------------------------------------------

_ERRORS: dict[str, type[Exception]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, Exception)}
_ERRORS["LossInputError"] = gepo.LossInputError


def error_to_wire(exc: BaseException) -> dict:
    name = type(exc).__name__
    return {"type": name if name in _ERRORS else "HeteroRLError", "message": str(exc) or name,
            "server_type": name}


def error_from_wire(raw: dict) -> Exception:
    """The exception a local call would have raised (its class by name; HeteroRLError for one the client does not
    know), with the server's message."""
    cls = _ERRORS.get(raw.get("type", ""), errors.HeteroRLError)
    return cls(raw.get("message", "the service failed without a message"))


# -- bodies --------------------------------------------------------------------------------------------------

def pack(value: Any, content_type: str) -> bytes:
    """``value`` as msgpack, or as standard JSON (a float that is not finite, e.g. the gradient norm of a skipped
    step, is null: JSON has no Infinity)."""
    if content_type == MSGPACK:
        return msgpack.packb(value, use_bin_type=True)
    return json_text(value).encode()


def unpack(body: bytes, content_type: str | None, max_elements: int = 1 << 20) -> Any:
    """A body as plain values: msgpack (no array or map of more than ``max_elements`` entries, checked as each is
    met, before its entries are made) or JSON. A nest too deep for the decoder is a ValueError."""
    try:
        if content_type and content_type.split(";")[0].strip() == MSGPACK:
            return msgpack.unpackb(body, raw=False, strict_map_key=False, max_array_len=max_elements,
                                   max_map_len=max_elements)
        return json.loads(body) if body else None
    except RecursionError:
        raise ValueError("nested too deeply") from None


# -- state dicts ------------------------------------------------------------------------------------------------

def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A state dict as safetensors bytes; tied tensors are saved once and named in the metadata."""
    from safetensors.torch import save

    seen, unique, aliases = {}, {}, {}
    for name, tensor in state.items():
        key = storage_key(tensor) or name
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = tensor.contiguous()
    return save(unique, metadata={f"alias:{k}": v for k, v in aliases.items()})


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """The state dict `state_to_bytes` wrote, tied tensors one tensor under each name again."""
    from safetensors.torch import load

    state = load(data)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])  # safetensors: u64 size, then JSON
    for key, source in (header.get("__metadata__") or {}).items():
        if key.startswith("alias:"):
            state[key[len("alias:"):]] = state[source]
    return state
