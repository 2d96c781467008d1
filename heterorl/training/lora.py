"""Low-rank adapters (LoRA) on a policy, with peft: attach one, name the base it belongs to, and move it.

The learner trains the adapter (`attach`); its versions travel as the adapter's tensors alone
(`adapter_state`, a few MB), named as in the base model (``model.layers.0.self_attn.q_proj.lora_A.weight``)
and stamped with `base_hash`, the digest of the base weights they were trained on. A worker holds the same base
and either merges each version into its weights (`Merger`: W = W0 + (alpha / rank) · B A, the same arithmetic
as the learner's merged export, `merged_state`) or keeps the adapter beside them (`attach` on the engine's
model, `load_adapter`).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from heterorl.config import LoraConfig
from heterorl.errors import HeteroRLError
from heterorl.policies.storage import storage_key

LORA_A, LORA_B = "lora_A", "lora_B"


class LoraError(HeteroRLError):
    """An adapter that does not fit: a rank or target module the model cannot take, an adapter of another
    base, a saved state whose adapter config differs from the session's."""


def _peft():
    try:
        import peft
    except ImportError:  # pragma: no cover - peft is in install_requires
        raise LoraError("LoRA needs peft: pip install peft") from None
    return peft


def linear_names(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """{module name: layer} of ``model``'s linear layers that an adapter may target (the output head excluded:
    tied to the embedding in small models)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")}


def check_fits(model: torch.nn.Module, spec: LoraConfig) -> list[str]:
    """The names of the linear layers ``spec`` adapts in ``model``; `LoraError` naming the mismatch when a
    target module matches none or the rank exceeds a target's smaller dimension."""
    if spec.rank <= 0:
        raise LoraError(f"LoRA rank {spec.rank!r}: give a rank >= 1")
    linears = linear_names(model)
    kinds = sorted({name.rsplit(".", 1)[-1] for name in linears})
    targets = []
    for wanted in sorted(set(spec.target_modules)):
        matched = [name for name in linears if name.rsplit(".", 1)[-1] == wanted]
        if not matched:
            raise LoraError(f"LoRA target module {wanted!r} is not a linear layer of this "
                            f"{type(model).__name__}; its linear layers are {kinds}")
        targets += matched
    for name in targets:
        layer = linears[name]
        smallest = min(layer.in_features, layer.out_features)
        if spec.rank > smallest:
            raise LoraError(f"LoRA rank {spec.rank} exceeds {name}'s smaller dimension ({layer.out_features} x "
                            f"{layer.in_features}): a rank above {smallest} adds parameters and no capacity; "
                            f"give a rank <= {smallest}")
    return sorted(targets)


def base_hash(model: torch.nn.Module) -> str:
    """A digest of ``model``'s weights (names, dtypes, shapes, bytes; tied tensors once): the identity of the
    base an adapter was trained on. Two processes that loaded the same folder agree on it."""
    import xxhash

    digest, seen = xxhash.xxh3_128(), set()
    for name, tensor in sorted(model.state_dict().items()):
        key = storage_key(tensor)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel() and key not in seen:
            seen.add(key)
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype == torch.bfloat16
                          else flat.numpy().tobytes())
    return digest.hexdigest()


def attach(model: torch.nn.Module, spec: LoraConfig) -> torch.nn.Module:
    """``model`` with a fresh adapter (peft's ``PeftModel``; ``B`` = 0, so it computes what the base does): the
    base frozen, only the adapter trainable. `LoraError` when ``spec`` does not fit the model (`check_fits`)."""
    check_fits(model, spec)
    peft = _peft()
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                             target_modules=sorted(set(spec.target_modules)), bias="none")
    return peft.get_peft_model(model, config)


def inject(model: torch.nn.Module, spec: LoraConfig) -> torch.nn.Module:
    """``model`` itself (same class, same forward) with adapter layers placed beside its target modules, frozen and
    computing what the base does until `load_adapter` fills them: a sampler that keeps adapters unmerged."""
    check_fits(model, spec)
    peft = _peft()
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                             target_modules=sorted(set(spec.target_modules)), bias="none")
    model = peft.inject_adapter_in_model(config, model)
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _base_name(peft_name: str) -> str:
    """A PEFT parameter name as the base model names it: ``base_model.model.`` and the adapter name go,
    ``base_layer`` folds into its module."""
    name = peft_name.removeprefix("base_model.model.")
    return re.sub(r"\.(lora_[AB])\.default\.", r".\1.", name).replace(".base_layer.", ".")


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{base-model module name: peft LoRA layer} of a model `attach` made."""
    from peft.tuners.lora import LoraLayer

    return {_base_name(name): module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, copied to the CPU: ``MODULE.lora_A.weight`` (rank x in) and ``MODULE.lora_B.weight``
    (out x rank) for each adapted module, by its base-model name."""
    state = {}
    for name, layer in _lora_layers(model).items():
        state[f"{name}.{LORA_A}.weight"] = layer.lora_A["default"].weight.detach().to("cpu", copy=True)
        state[f"{name}.{LORA_B}.weight"] = layer.lora_B["default"].weight.detach().to("cpu", copy=True)
    return state


def load_adapter(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load adapter tensors (`adapter_state`'s names) into a model `attach` made; `LoraError` naming the first
    tensor that is missing, unknown or of another shape, before any is loaded."""
    layers = _lora_layers(model)
    targets = {}
    for name, layer in layers.items():
        for part in (LORA_A, LORA_B):
            targets[f"{name}.{part}.weight"] = getattr(layer, part)["default"].weight
    check_adapter(state, {name: tuple(t.shape) for name, t in targets.items()})
    with torch.no_grad():
        for name, param in targets.items():
            param.copy_(state[name])


def check_adapter(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> None:
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unknown:
        raise LoraError(f"the adapter does not fit: {len(missing)} tensors missing (e.g. {missing[:2]}), "
                        f"{len(unknown)} unknown (e.g. {unknown[:2]}); was it trained with other target modules?")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise LoraError(f"adapter tensor {name} is {tuple(state[name].shape)}, this model's is {tuple(shape)}: "
                            "was it trained with another rank?")


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The weight update of one adapted linear layer: (B A) · scaling, in float32."""
    return (b.float() @ a.float()) * scaling


def merged_state(model: torch.nn.Module, spec: LoraConfig) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapter merged into each adapted weight (copies on the CPU, in the
    base's names; tied tensors stay one): what an engine that knows nothing of adapters loads."""
    layers = _lora_layers(model)
    scaling = spec.alpha / spec.rank
    copies, state = {}, {}
    for peft_name, tensor in model.state_dict().items():
        if ".lora_" in peft_name:
            continue
        name = _base_name(peft_name)
        key = storage_key(tensor) or name
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in layers:
                layer = layers[module]
                update = delta(layer.lora_A["default"].weight.detach().cpu(),
                               layer.lora_B["default"].weight.detach().cpu(), scaling)
                copies[key] = (copies[key].float() + update).to(tensor.dtype)
        state[name] = copies[key]
    return state


def adapter_meta(spec: LoraConfig, base: str) -> dict:
    """What a version's header says of its adapter: the base's `base_hash`, rank, alpha, target modules."""
    return {"base": base, "rank": spec.rank, "alpha": float(spec.alpha), "targets": sorted(set(spec.target_modules))}


def check_base(meta: Mapping, base: str) -> None:
    """`LoraError` when an adapter (its header's ``meta``) was trained on another base than ``base``."""
    if meta.get("base") != base:
        raise LoraError(f"the learner's adapter belongs to base {str(meta.get('base'))[:12]}…, but this worker "
                        f"holds base {base[:12]}…: start the worker with the learner's base model (the same "
                        "folder or shipped policy, unmodified)")


def spec_of(meta: Mapping) -> LoraConfig:
    return LoraConfig(rank=int(meta["rank"]), alpha=float(meta["alpha"]), target_modules=list(meta["targets"]))


class Merger:
    """A worker's side of adapter versions for an engine that loads whole weights: keeps the base weights it
    loaded (float32 copies of the adapted ones), and turns each adapter into the whole state dict W0 + (alpha /
    rank) · B A, cast to ``dtype``: the same arithmetic as the learner's merged export."""

    def __init__(self, base_state: Mapping[str, torch.Tensor], base: str, dtype: torch.dtype | None = None) -> None:
        self.base = base
        self.dtype = dtype
        self._state = {name: t.detach().to("cpu", copy=True) for name, t in base_state.items()}
        self._cast: dict[str, torch.Tensor] = {}  # the tensors no adapter touches, cast once

    def merge(self, adapter: Mapping[str, torch.Tensor], meta: Mapping) -> dict[str, torch.Tensor]:
        """The whole state dict with ``adapter`` merged; `LoraError` when it does not fit this base."""
        check_base(meta, self.base)
        spec = spec_of(meta)
        modules = sorted({name.rsplit(".", 2)[0] for name in adapter if f".{LORA_A}." in name or f".{LORA_B}." in name})
        expected = {}
        for module in modules:
            weight = self._state.get(f"{module}.weight")
            if weight is None:
                raise LoraError(f"the adapter adapts {module}, which this worker's model does not have")
            expected[f"{module}.{LORA_A}.weight"] = (spec.rank, weight.shape[1])
            expected[f"{module}.{LORA_B}.weight"] = (weight.shape[0], spec.rank)
        check_adapter(adapter, expected)
        scaling = spec.alpha / spec.rank
        out = {}
        for name, tensor in self._state.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in modules:
                merged = (tensor.float() + delta(adapter[f"{module}.{LORA_A}.weight"],
                                                 adapter[f"{module}.{LORA_B}.weight"], scaling)).to(tensor.dtype)
                out[name] = self._to_dtype(merged)
            else:
                if name not in self._cast:
                    self._cast[name] = self._to_dtype(tensor)
                out[name] = self._cast[name]
        return out

    def _to_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor


def check_lora_state(state: dict, lora: LoraConfig | None, base_hash: str | None) -> None:
    """`LoraError` naming the mismatch when the training ``state`` holds an adapter and the client (its ``lora``
    config, None for a whole model, on the base of digest ``base_hash``) trains the whole model, or the reverse,
    or the saved adapter's config or base differ from the client's."""
    saved = state.get("lora")
    if (saved is None) != (lora is None):
        raise LoraError(f"this training state holds {'a LoRA adapter' if saved else 'a whole model'}, but the "
                        f"client trains {'a LoRA adapter' if lora else 'the whole model'}: load it into a client "
                        "made as the one that saved it")
    if saved is None:
        return
    mine = lora.to_dict()
    differ = [f"{key} {saved.get(key)!r} (saved) != {mine[key]!r}" for key in mine if saved.get(key) != mine[key]]
    if differ:
        raise LoraError(f"the saved adapter's config differs from this session's: {'; '.join(differ)}")
    if state.get("base_hash") != base_hash:
        raise LoraError("the saved adapter was trained on another base model than this session's (their weights' "
                        "digests differ): load it into a session on the same base")
