"""What the service's sessions and sampling clients hold in memory, and which samplers go first when the service
must hold less (its memory budget, `heterorl serve --memory-budget-mb`).

A session holds its model; for each trainable parameter a gradient and AdamW's two moments (counted from the
start: they exist after its first step); and the exported weights it keeps for download. A sampler holds its
engine's model, a frozen copy. Bytes are those of unique storages: tied weights count once. A forward or
forward_backward call counts what it will allocate while it waits and runs (`training_call_bytes`, an estimate
made before it runs; a session's calls run one at a time, so a session counts its largest); what a sampling call
allocates (a KV cache) is not counted: leave room for it between the budget and the machine.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from heterorl.errors import HeteroRLError

MB = 2**20
EVICTED_KEPT = 10_000  # evicted sampler ids remembered, to answer why they are gone


class OverMemoryBudget(HeteroRLError):
    """A session, sampler or exported weights the service cannot keep within its memory budget (HTTP 507)."""


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors``, each counted once (tied weights, views of one tensor)."""
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers."""
    return tensors_bytes(itertools.chain(module.parameters(), module.buffers()))


def session_bytes(training, weights: Iterable[dict]) -> int:
    """A `TrainingClient`'s model, plus 3 x its trainable bytes (gradient, AdamW's exp_avg and exp_avg_sq), plus
    the exported state dicts ``weights`` it keeps."""
    trainable = tensors_bytes(training.trainable_parameters())
    exported = tensors_bytes(tensor for state in weights for tensor in state.values())
    return module_bytes(training.model) + 3 * trainable + exported


def training_call_bytes(model: torch.nn.Module, lengths: list[int], backward: bool) -> int:
    """What a forward (``backward`` False) or forward_backward call on ``model`` allocates while it runs, estimated
    before it runs from its datums' token counts ``lengths`` (they are padded to the longest): per token and layer,
    the activations autograd keeps, 2 x (34 h + 5 a s) bytes — Korthikanti et al. (2022)'s figure, doubled for
    float32, with h the hidden size, a the attention heads, s the padded length — and per token the logits with
    their log-softmax and its gradient, 3 x 4 x the vocabulary's size. A forward holds one layer's at a time.
    Measured on the shipped tiny model (h 128, 4 layers, 4 heads): 35 KB a token for 1,024 datums of 60 tokens,
    where this says 44 KB. 0 for a model whose config does not say its sizes."""
    config = getattr(model, "config", None)
    sizes = [getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "vocab_size")]
    if not lengths or not all(isinstance(n, int) and n > 0 for n in sizes):
        return 0
    hidden, layers, heads, vocab = sizes
    longest = max(lengths)
    tokens = longest * len(lengths)
    per_layer = 2 * (34 * hidden + 5 * heads * longest)
    return tokens * ((layers if backward else 1) * per_layer + 12 * vocab)


def sampler_bytes(sampler) -> int:
    """The bytes of a sampling client's engine's model (0 for an engine that holds none in this process)."""
    model = getattr(getattr(sampler, "engine", None), "model", None)
    return module_bytes(model) if isinstance(model, torch.nn.Module) else 0


@dataclass(frozen=True)
class Evictable:
    """A sampler the service may close to make room: its key, its bytes, and when it was last used (a tick)."""

    key: Any
    nbytes: int
    used: int


def least_recently_used(candidates: Iterable[Evictable], need_bytes: int) -> list | None:
    """The keys to evict, least recently used first, that free at least ``need_bytes`` (none when it is <= 0);
    None when all the candidates together free less."""
    chosen, freed = [], 0
    for candidate in sorted(candidates, key=lambda c: c.used):
        if freed >= need_bytes:
            break
        chosen.append(candidate.key)
        freed += candidate.nbytes
    return chosen if freed >= need_bytes else None


class Budget:
    """A service's memory budget (``budget_bytes``; None: no bound) over its sessions ({session id: a
    `sessions.Session`}; a sampler is keyed (session id, version)). Before the service keeps a new session, sampler
    or exported weights, `make_room` names the samplers to evict for it, least recently used first (`use`), never
    a session's newest nor one with a call waiting or running; what still does not fit is refused
    (`OverMemoryBudget`). Requests naming an evicted sampler answer 404 saying why (`gone`). Not thread-safe: the
    service calls it holding its lock."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._ticks = itertools.count()
        self._used: dict[tuple[str, int], int] = {}  # sampler → tick of its last use
        self._gone: OrderedDict[str, str] = OrderedDict()  # evicted model id → why it answers 404
        self._calls: dict[str, list[int]] = {}  # session id → bytes of its training calls waiting or running

    def calls_bytes(self) -> int:
        """What the training calls waiting or running will allocate: each session's largest (they run one at a
        time)."""
        return sum(max(needs) for needs in self._calls.values() if needs)

    def call_extra(self, session_id: str, nbytes: int) -> int:
        """The bytes a training call of ``nbytes`` adds to what session ``session_id``'s calls count."""
        held = max(self._calls.get(session_id) or [0])
        return max(0, nbytes - held)

    def add_call(self, session_id: str, nbytes: int) -> None:
        """A training call of ``nbytes`` (`training_call_bytes`) of session ``session_id`` was started."""
        self._calls.setdefault(session_id, []).append(nbytes)

    def end_call(self, session_id: str, nbytes: int) -> None:
        """A training call `add_call` counted has finished (or failed, or was cancelled)."""
        needs = self._calls.get(session_id, [])
        if nbytes in needs:
            needs.remove(nbytes)
        if not needs:
            self._calls.pop(session_id, None)

    def use(self, key: tuple[str, int]) -> None:
        """A sampler was made or named by a request: it is the last to be evicted."""
        self._used[key] = next(self._ticks)

    def gone(self, model_id: str) -> str | None:
        """Why ``model_id`` answers 404, when the service evicted it (the last `EVICTED_KEPT` are remembered)."""
        return self._gone.get(model_id)

    def forget(self, key: tuple[str, int], why: str | None = None) -> None:
        """A sampler is out of service: requests naming it answer 404 saying ``why`` (what it "was ...", None:
        evicted for the budget)."""
        model_id = f"heterorl:{key[0]}/{key[1]}"
        why = why or (f"was evicted to keep this service within its memory budget (--memory-budget-mb "
                      f"{(self.budget_bytes or 0) / MB:,.1f}), being the least recently used")
        self._used.pop(key, None)
        self._gone[model_id] = (f"the sampling client {model_id!r} {why}: make a new one with "
                                "save_weights_and_get_sampling_client")
        while len(self._gone) > EVICTED_KEPT:
            self._gone.popitem(last=False)

    def holdings(self, sessions: Mapping[str, Any]) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
        """({session id: bytes}, {sampler: bytes})."""
        held = {sid: session_bytes(s.training, s.weights.values()) for sid, s in sessions.items()}
        samplers = {(sid, version): sampler_bytes(sampler) for sid, s in sessions.items()
                    for version, sampler in s.samplers.items()}
        for key in self._used.keys() - samplers.keys():  # (a closed session's)
            del self._used[key]
        return held, samplers

    def report(self, sessions: Mapping[str, Any]) -> dict:
        """{budget_bytes, used_bytes, sessions: {session id: bytes}, samplers: {model id: bytes}}."""
        held, samplers = self.holdings(sessions)
        return {"budget_bytes": self.budget_bytes,
                "used_bytes": sum(held.values()) + sum(samplers.values()) + self.calls_bytes(),
                "calls_bytes": self.calls_bytes(),
                "sessions": held, "samplers": {f"heterorl:{sid}/{v}": n for (sid, v), n in samplers.items()}}

    def make_room(self, what: str, need_bytes: int | None, sessions: Mapping[str, Any], busy: set,
                  newcomer: Any = None) -> list[tuple[str, int]]:
        """The samplers to evict, least recently used first, for ``need_bytes`` more to fit. Each session's newest
        stays (``newcomer``'s, which is about to get a newer one, may go), and so does any in ``busy`` (a call
        waiting or running). `OverMemoryBudget` naming ``what`` when they cannot free enough; ``need_bytes`` None
        (a session not loaded yet): only when what would stay after evicting them all fills the budget, else []."""
        if self.budget_bytes is None:
            return []
        held, samplers = self.holdings(sessions)
        newest = {(sid, next(reversed(s.samplers))) for sid, s in sessions.items() if s.samplers and s is not newcomer}
        candidates = [Evictable(key, nbytes, self._used.get(key, -1)) for key, nbytes in samplers.items()
                      if key not in busy and key not in newest]
        over = sum(held.values()) + sum(samplers.values()) + self.calls_bytes() + (need_bytes or 0) - self.budget_bytes
        chosen = least_recently_used(candidates, over if need_bytes is not None else over + 1)
        if chosen is None:
            raise over_budget(what, need_bytes, self.budget_bytes, sum(held.values()), sum(samplers.values()),
                              self.calls_bytes())
        return [] if need_bytes is None else chosen


def budget_bytes(memory_budget_mb: float | str | None, device: str) -> int | None:
    """A budget in bytes: ``memory_budget_mb`` MB, "auto" for `default_budget_bytes`, None for no budget."""
    if memory_budget_mb is None:
        return None
    if memory_budget_mb == "auto":
        return default_budget_bytes(device)
    if isinstance(memory_budget_mb, str) or not memory_budget_mb > 0:
        raise HeteroRLError(f"memory budget {memory_budget_mb!r} MB (--memory-budget-mb): give a number > 0 (or "
                            "0 for no budget; the service's memory_budget_mb: 'auto' or None)")
    return int(memory_budget_mb * MB)


def default_budget_bytes(device: str) -> int:
    """Half the memory the models live in: a CUDA device's, else this machine's (or its container's)."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory // 2
    return physical_memory_bytes() // 2


def physical_memory_bytes() -> int:
    """This machine's memory (/proc/meminfo's MemTotal, else sysconf), or its cgroup's limit when lower."""
    try:
        with open("/proc/meminfo") as meminfo:
            total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            return min(total, int(limit.read().strip()))
    except (OSError, ValueError):  # (none, or "max")
        return total


def over_budget(what: str, need_bytes: int | None, budget_bytes: int, sessions_bytes: int,
                samplers_bytes: int, calls_bytes: int = 0) -> OverMemoryBudget:
    """The refusal of ``what`` (``need_bytes`` None: refused before it was loaded, the budget being used up)."""
    needs = "is refused: the budget is used up" if need_bytes is None else f"needs {need_bytes / MB:,.1f} MB"
    calls = f", training calls waiting or running {calls_bytes / MB:,.1f} MB" if calls_bytes else ""
    return OverMemoryBudget(
        f"{what} {needs}; this service's memory budget is {budget_bytes / MB:,.1f} MB (--memory-budget-mb), of "
        f"which sessions hold {sessions_bytes / MB:,.1f} MB and sampling clients {samplers_bytes / MB:,.1f} MB{calls} "
        "(GET /api/v1/memory), and the samplers it may evict (not a session's newest, none with a call waiting "
        "or running) do not free enough: close a session (DELETE /api/v1/sessions/ID) or start the service with "
        "a larger --memory-budget-mb")
