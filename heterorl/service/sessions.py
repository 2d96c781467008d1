"""The training-session service without its HTTP layer: sessions (a policy, its optimizer, its samplers), calls
run as futures in submission order, results kept for retrieval by id, and retried requests run once.

`heterorl.service.server` puts it behind HTTP; `heterorl.service.client` is its client.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from heterorl.errors import HeteroRLError
from heterorl.service import wire
from heterorl.training.session import SamplingClient, TrainingClient

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
TRAINING_METHODS = ("forward", "forward_backward", "optim_step", "save_weights_for_sampler",
                    "save_weights_and_get_sampling_client", "save_state", "load_state")
SAMPLER_METHODS = ("sample", "compute_logprobs")


class NotFound(HeteroRLError):
    """A session, sampler, future or weights version the service does not hold (HTTP 404)."""


class BadRequest(HeteroRLError):
    """A call the service cannot run as asked: an unknown method, a bad argument (HTTP 400)."""


@dataclass
class Call:
    """One submitted call: its future, and once it finished, its result or error in wire form."""

    future: Future
    owner: str  # the session it belongs to
    created: float
    done_at: float | None = None
    result: Any = None
    error: dict | None = None


@dataclass
class Session:
    session_id: str
    base_model: str
    training: TrainingClient
    samplers: OrderedDict = field(default_factory=OrderedDict)  # version → SamplingClient, oldest first
    weights: OrderedDict = field(default_factory=OrderedDict)  # version → state dict exported for download


def _lora_spec(lora: dict | None):
    """The `LoraConfig` of a session request's ``lora`` (None: full fine-tuning); `BadRequest` naming a bad field."""
    from heterorl.config import ConfigError, LoraConfig

    if lora is None:
        return None
    known = {"rank", "alpha", "dropout", "target_modules"}
    if not isinstance(lora, dict) or set(lora) - known:
        raise BadRequest(f"lora: give a map of {sorted(known)}, got {lora!r}")
    if not isinstance(lora.get("target_modules", []), list):
        raise BadRequest(f"lora.target_modules: give a list of layer names, got {lora['target_modules']!r}")
    spec = LoraConfig(**lora)
    try:
        spec.validate("lora")
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    if not spec.enabled:
        raise BadRequest(f"lora.rank {spec.rank}: give a rank >= 1 for a LoRA session")
    return spec


class Service:
    """Sessions and their calls. ``state_dir``: where ``save_state`` writes (one folder per session; names only,
    never paths). Finished results are kept ``result_ttl_s`` seconds; each session keeps its newest
    ``max_samplers`` sampling clients (older ones are closed and their model ids answer 404)."""

    def __init__(self, state_dir: str | Path, *, result_ttl_s: float = 600.0, max_sessions: int = 8,
                 max_samplers: int = 8, device: str = "cpu",
                 loader: Callable[[str], tuple] | None = None, models: dict[str, str] | None = None) -> None:
        """``models``: local Hugging Face folders sessions may start from by name ({name: path};
        `list_base_models` names them with the built-in policies)."""
        self.state_dir = Path(state_dir)
        self.models = dict(models or {})
        self.result_ttl_s, self.max_sessions, self.max_samplers = result_ttl_s, max_sessions, max_samplers
        self.device = device
        self._loader = loader
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._calls: dict[str, Call] = {}
        self._requests: OrderedDict[str, str] = OrderedDict()  # request id → call id

    # -- sessions -------------------------------------------------------------------------------------------
    def list_base_models(self) -> list[dict]:
        """The policies sessions can start from by name: [{name, description}] (`policies.base_models`)."""
        from heterorl.policies import base_models

        return [{"name": name, "description": what} for name, what in base_models(self.models).items()]

    def create_session(self, base_model: str, seed: int | None = None, share_prompts: bool = True,
                       lora: dict | None = None) -> dict:
        """Load ``base_model`` (a name `list_base_models` gives, or a Hugging Face folder on this machine) with a
        fresh optimizer; its description. ``lora`` ({rank, alpha, dropout, target_modules}): train a low-rank
        adapter on it (a mismatch with the model is a `BadRequest` naming it)."""
        spec = _lora_spec(lora)
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise BadRequest(f"this service holds its maximum of {self.max_sessions} sessions: close one "
                                 "(DELETE /api/v1/sessions/ID) or start it with a larger --max-sessions")
        model, tokenizer = self._load(base_model)
        try:
            training = TrainingClient(model, tokenizer, device=self.device, seed=seed, share_prompts=share_prompts,
                                      lora=spec)
        except HeteroRLError as exc:  # (a LoRA config that does not fit the model)
            raise BadRequest(str(exc)) from None
        session = Session(f"s-{uuid.uuid4().hex[:12]}", base_model, training)
        with self._lock:
            self._sessions[session.session_id] = session
        return self.describe(session.session_id)

    def _load(self, base_model: str) -> tuple:
        if self._loader is not None:
            return self._loader(base_model)
        from heterorl.policies import load_policy

        try:
            return load_policy(self.models.get(base_model, base_model), device=self.device)
        except (OSError, ValueError, HeteroRLError) as exc:
            raise BadRequest(f"base_model {base_model!r} cannot be loaded here: {exc}; the base models here: "
                             f"{', '.join(m['name'] for m in self.list_base_models())}") from None

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def describe(self, session_id: str) -> dict:
        session = self.session(session_id)
        model = session.training.model
        training = session.training
        return {"session_id": session_id, "base_model": session.base_model, "version": training.version,
                "step": training.step, "vocab_size": model.get_input_embeddings().num_embeddings,
                "parameters": sum(p.numel() for p in model.parameters()),
                "trainable_parameters": sum(p.numel() for p in training.trainable_parameters()),
                "lora": training.lora.to_dict() if training.lora is not None else None,
                "adapter": training.adapter_meta,
                "samplers": [f"heterorl:{session_id}/{v}" for v in session.samplers]}

    def session(self, session_id: str) -> Session:
        with self._lock:
            found = self._sessions.get(session_id)
        if found is None:
            raise NotFound(f"no session {session_id!r} here (create one with POST /api/v1/sessions)")
        return found

    def close_session(self, session_id: str) -> None:
        session = self.session(session_id)
        with self._lock:
            self._sessions.pop(session_id, None)
        for sampler in session.samplers.values():
            sampler.close()
        session.training.close()

    def close(self) -> None:
        for session_id in list(self._sessions):
            self.close_session(session_id)

    # -- calls ------------------------------------------------------------------------------------------------
    def call(self, session_id: str, method: str, args: dict, request_id: str | None = None) -> str:
        """Submit ``method`` of the session's training client; the call's id. A ``request_id`` seen before
        returns the first call's id: a retried request is not run twice."""
        session = self.session(session_id)
        if method not in TRAINING_METHODS:
            raise BadRequest(f"unknown training method {method!r}; one of {', '.join(TRAINING_METHODS)}")
        return self._submit(session_id, request_id, lambda: self._start(session, method, args or {}))

    def sampler_call(self, model_id: str, method: str, args: dict, request_id: str | None = None) -> str:
        """Submit ``method`` of the sampling client ``model_id`` ("heterorl:SESSION/VERSION" or "latest")."""
        session_id, sampler = self.sampler(model_id)
        if method not in SAMPLER_METHODS:
            raise BadRequest(f"unknown sampling method {method!r}; one of {', '.join(SAMPLER_METHODS)}")
        return self._submit(session_id, request_id, lambda: _start_sampling(sampler, method, args or {}))

    def _submit(self, owner: str, request_id: str | None, start: Callable[[], Future]) -> str:
        self._expire()
        with self._lock:
            if request_id is not None and request_id in self._requests:
                return self._requests[request_id]
        try:
            future = start()
        except (TypeError, KeyError) as exc:  # arguments the method does not take, or lacks
            raise BadRequest(f"bad arguments: {type(exc).__name__}: {exc}") from None
        call_id = f"f-{uuid.uuid4().hex}"
        call = Call(future, owner, time.monotonic())
        with self._lock:
            self._calls[call_id] = call
            if request_id is not None:
                self._requests[request_id] = call_id
        future.add_done_callback(lambda f: self._finish(call, f))
        return call_id

    def _start(self, session: Session, method: str, args: dict) -> Future:
        training = session.training
        if method in ("forward", "forward_backward"):
            datums = [wire.datum_from_wire(d) for d in args.pop("datums")]
            return getattr(training, method)(datums, **args)
        if method == "optim_step":
            return training.optim_step(wire.adam_from_wire(args.get("params")))
        if method == "save_weights_for_sampler":
            return _then(training.save_weights_for_sampler(**args), lambda got: self._keep_weights(session, *got))
        if method == "save_weights_and_get_sampling_client":
            return _then(training.snapshot(), lambda sampler: self._keep_sampler(session, sampler))
        name = args.get("name", "")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(f"{method} takes a file name (letters, digits, '.', '_', '-'; no folders), got {name!r}: "
                             "states live in the service's state folder, one per session")
        path = self.state_dir / session.session_id / name
        if method == "save_state":
            path.parent.mkdir(parents=True, exist_ok=True)
            return _then(training.save_state(path), lambda _: name)
        if not path.is_file():
            raise NotFound(f"session {session.session_id} saved no state named {name!r}")
        return training.load_state(path)

    def _keep_weights(self, session: Session, version: int, state: dict) -> int:  # (whole or adapter)
        with self._lock:
            session.weights[version] = state
            while len(session.weights) > 2:
                session.weights.popitem(last=False)
        return version

    def _keep_sampler(self, session: Session, sampler: SamplingClient) -> dict:
        with self._lock:
            session.samplers[sampler.version] = sampler
            evicted = [session.samplers.popitem(last=False)[1] for _ in
                       range(max(0, len(session.samplers) - self.max_samplers))]
        for old in evicted:
            old.close()
        return {"version": sampler.version, "model": f"heterorl:{session.session_id}/{sampler.version}"}

    def _finish(self, call: Call, future: Future) -> None:
        try:
            exc = future.exception()
            if exc is not None:
                call.error = wire.error_to_wire(exc)
            else:
                value = future.result()
                call.result = (wire.samples_to_wire(value) if isinstance(value, list) and value
                               and _is_samples(value) else wire.result_to_wire(value))
        except Exception as exc:  # a result that cannot be sent is an error the client hears of, never a hang
            call.error = wire.error_to_wire(exc)
        call.done_at = time.monotonic()

    def get_call(self, call_id: str) -> Call:
        with self._lock:
            call = self._calls.get(call_id)
        if call is None:
            raise NotFound(f"no call {call_id!r}: unknown, or its result expired ({self.result_ttl_s:g} s after "
                           "it finished)")
        return call

    async def poll(self, call_id: str, wait_s: float = 0.0) -> dict:
        """The call's state: ``pending``, or ``done`` with its ``result`` or ``error``; waits up to ``wait_s``
        for it to finish (long-poll) without holding a thread."""
        import asyncio

        call = self.get_call(call_id)
        if call.done_at is None and wait_s > 0:
            # `_finish` was the future's first done callback: once this wakes, the result is in wire form
            done = asyncio.wrap_future(call.future)
            try:
                await asyncio.wait_for(asyncio.shield(done), wait_s)
            except (TimeoutError, Exception):  # (a call's own error is in call.error)
                pass
        if call.done_at is None:
            return {"status": "pending"}
        return {"status": "done", "result": call.result} if call.error is None else {"status": "done",
                                                                                      "error": call.error}

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.result_ttl_s
        with self._lock:
            old = [cid for cid, c in self._calls.items() if c.done_at is not None and c.done_at < cutoff]
            for cid in old:
                del self._calls[cid]
            if old:
                gone = set(old)
                for rid in [r for r, cid in self._requests.items() if cid in gone]:
                    del self._requests[rid]

    # -- samplers and weights -----------------------------------------------------------------------------
    def sampler(self, model_id: str) -> tuple[str, SamplingClient]:
        """(session id, sampling client) of "heterorl:SESSION/VERSION", "heterorl:SESSION/latest" or "latest"."""
        served = self.samplers()
        if model_id not in served:
            raise NotFound(f"no sampling client {model_id!r}; serving: {', '.join(sorted(served)) or 'none yet'} "
                           "(save_weights_and_get_sampling_client makes one)")
        return served[model_id]

    def samplers(self) -> dict[str, tuple[str, SamplingClient]]:
        """Every model id served → (session id, sampling client)."""
        served, newest = {}, None
        with self._lock:
            for session_id, session in self._sessions.items():
                for version, sampler in session.samplers.items():
                    served[f"heterorl:{session_id}/{version}"] = (session_id, sampler)
                if session.samplers:
                    latest = next(reversed(session.samplers.values()))
                    served[f"heterorl:{session_id}/latest"] = (session_id, latest)
                    newest = (session_id, latest)
        if newest is not None:
            served["latest"] = newest
        return served

    def weights(self, session_id: str, version: int) -> bytes:
        session = self.session(session_id)
        with self._lock:
            state = session.weights.get(version)
        if state is None:
            raise NotFound(f"session {session_id} holds no exported weights of version {version} (the two newest "
                           "save_weights_for_sampler results are kept)")
        return wire.state_to_bytes(state)


def tokenizer_zip(tokenizer) -> bytes:
    """A tokenizer's files (``save_pretrained``) in a zip, for a remote client to load."""
    import io
    import tempfile
    import zipfile

    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="heterorl-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(folder).iterdir()):
                archive.write(path, path.name)
    return buffer.getvalue()


def _is_samples(value: list) -> bool:
    from heterorl.engines.base import SampleOutput

    first = value[0][0] if isinstance(value[0], list) and value[0] else value[0]
    return isinstance(first, SampleOutput)


def _start_sampling(sampler: SamplingClient, method: str, args: dict) -> Future:
    if method == "sample":
        return sampler.sample(args["prompt_tokens"], int(args.get("num_samples", 1)),
                              wire.params_from_wire(args.get("sampling_params")))
    return sampler.compute_logprobs(args["tokens"])


def _then(future: Future, fn: Callable) -> Future:
    """A future of ``fn(result)`` (or of the same error)."""
    out: Future = Future()

    def chain(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as exc:  # handed to whoever waits on ``out``
            out.set_exception(exc)
    future.add_done_callback(chain)
    return out
