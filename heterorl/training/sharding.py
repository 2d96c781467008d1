"""A fully sharded learner (FSDP2, `torch.distributed.fsdp.fully_shard`): each rank holds 1/world of every
parameter, its gradient and its optimizer state, along dim 0. `TrainingClient(..., shard=True)` uses these.

- **Sharding.** Every block of the model's layer lists (the children of each `nn.ModuleList`: a transformer's
  decoder layers) is its own FSDP unit, then the root (embeddings, final norm, head; a tied head stays one
  parameter). Forward and backward all-gather a unit's parameters for its use and reduce-scatter (average) its
  gradients, so ranks that train on their share of a batch end with the same update as DDP.
- **Whole weights on rank 0** (`gather_full_state`): a collective, every rank calls it; rank 0 gets every
  tensor whole on the CPU, tied names sharing one tensor; the other ranks get ``{}``. `skeleton` keeps the
  model's structure with its parameters on the meta device (buffers kept), so rank 0 can build a whole,
  unsharded copy (`build_from`) for evaluation and sampling without holding a second model from the start.
- **Sharded checkpoints** (`save_sharded` / `load_sharded`): `torch.distributed.checkpoint` (DCP) writes each
  rank's shards of the model and optimizer into one folder, with each rank's RNG (``rng-RANK.pt``) and the
  version and step (``training.json``, written last by rank 0: a folder without it is not a state). The folder
  is written under a temporary name and renamed when every rank has written, so a killed learner leaves the old
  state or the new one. DCP reshards on load: a state saved by N ranks loads into M.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from heterorl.errors import HeteroRLError

META = "training.json"  # a sharded state's version, step and world, written last


def fully_shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group (CPU: gloo; GPU: NCCL)."""
    from torch.distributed.fsdp import fully_shard

    blocks = [block for module in model.modules() if isinstance(module, torch.nn.ModuleList) for block in module]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{name: the first name of the same parameter} for every parameter reachable under two names (a tied
    embedding and head)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory), buffers copied: the shape of a
    whole model to fill with `build_from`. Tied parameters stay tied."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def build_from(shape: torch.nn.Module, state: dict[str, torch.Tensor], device="cpu") -> torch.nn.Module:
    """A whole model: a copy of ``shape`` (a `skeleton`) holding ``state``'s tensors, in eval mode, no grads."""
    model = copy.deepcopy(shape)
    model.load_state_dict(state, strict=True, assign=True)
    for alias, name in tied_names(shape).items():  # assign made two parameters of one tensor: make them one
        owner, _, attr = alias.rpartition(".")
        target = model.get_parameter(name)
        setattr(model.get_submodule(owner) if owner else model, attr, target)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device).eval()


def gather_full_state(model: torch.nn.Module, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded ``model``, whole, on rank 0's CPU (tied names: one tensor); ``{}`` on the
    other ranks. A collective: every rank must call it, in the same order as the other collectives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    for alias, name in aliases.items():
        if alias in state and name in state:
            state[alias] = state[name]
    return state


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng-{rank}.pt"


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer, version: int, step: int) -> Path:
    """Write the sharded training state into the folder ``path`` (a collective; see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = path.with_name(f".{path.name}.tmp")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    dcp.save({"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})},
             checkpoint_id=str(staging))
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, _rng_file(staging, rank))
    dist.barrier()
    if rank == 0:
        meta = {"version": version, "step": step, "world": world, "optimizer": optimizer is not None}
        (staging / META).write_text(json.dumps(meta))
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def read_sharded_meta(path: str | Path) -> dict:
    """A sharded state's ``training.json`` (version, step, world, optimizer), checked; HeteroRLError naming the
    folder and what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_bytes())
    except FileNotFoundError:
        raise HeteroRLError(f"{path} is not a sharded training state: it has no {META} (a learner killed while "
                            "writing it leaves the folder without one)") from None
    except ValueError as exc:
        raise HeteroRLError(f"{path / META} is not valid JSON ({exc})") from None
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), int) for k in ("version", "step", "world"))):
        raise HeteroRLError(f"{path / META} lacks an integer version, step or world")
    return meta


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer_factory) -> tuple[object, dict]:
    """Load the sharded state at ``path`` into the sharded ``model`` (a collective); returns (the optimizer,
    made by ``optimizer_factory()`` when the state holds one, else None; the meta). DCP reshards when the state
    was saved by another number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = read_sharded_meta(path)
    optimizer = optimizer_factory() if meta.get("optimizer") else None
    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    state = {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # a missing or damaged shard, or another model's keys
        raise HeteroRLError(f"cannot load the sharded training state {path} ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); was it saved from this "
                            "policy?") from None
    set_state_dict(model, [optimizer] if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    rng = _rng_file(path, dist.get_rank())
    if rng.is_file():  # (a rank the saving learner did not have starts from its seed's RNG)
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["torch"])
        version, internal, gauss = saved["python"]
        random.setstate((version, tuple(internal), gauss))
    return optimizer, meta


__all__ = ["build_from", "fully_shard_model", "gather_full_state", "load_sharded", "read_sharded_meta",
           "save_sharded", "skeleton", "tied_names"]
