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

from heterorl.engines.base import SamplingParams
from heterorl.errors import HeteroRLError
from heterorl.service import wire
from heterorl.training.session import SamplingClient, TrainingClient

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SESSION_ID = re.compile(r"s-[0-9a-f]{12}")
TRAINING_METHODS = ("forward", "forward_backward", "optim_step", "save_weights_for_sampler",
                    "save_weights_and_get_sampling_client", "save_state", "load_state")
SAMPLER_METHODS = ("sample", "compute_logprobs")


class NotFound(HeteroRLError):
    """A session, sampler, future or weights version the service does not hold (HTTP 404)."""


class BadRequest(HeteroRLError):
    """A call the service cannot run as asked: an unknown method, a bad argument (HTTP 400)."""


class TooBusy(HeteroRLError):
    """More calls are waiting than the service takes, for this session or in all (HTTP 429, Retry-After)."""


MAX_REQUEST_TOKENS = 1 << 18  # prompts x samples x max_tokens of one sampling call: what it may generate
MAX_PROMPT_TOKENS = 1 << 20  # every prompt token of one sampling or log-prob call, together


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
    used: float = field(default_factory=time.monotonic)  # when a request last named it (`Service.session_ttl_s`)


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
                 loader: Callable[[str], tuple] | None = None, models: dict[str, str] | None = None,
                 max_pending_per_session: int = 64, max_pending: int = 512,
                 max_request_tokens: int = MAX_REQUEST_TOKENS, session_ttl_s: float | None = 3600.0) -> None:
        """``models``: local Hugging Face folders sessions may start from by name ({name: path};
        `list_base_models` names them with the built-in policies). Calls waiting or running: at most
        ``max_pending_per_session`` per session and ``max_pending`` in all (`TooBusy` beyond). One sampling call
        generates at most ``max_request_tokens`` (prompts x samples x max_tokens). A session no request named for
        ``session_ttl_s`` (None: never) is closed when the next request arrives, unless a call of it is still
        waiting or running."""
        self.state_dir = Path(state_dir)
        self.models = dict(models or {})
        self.result_ttl_s, self.max_sessions, self.max_samplers = result_ttl_s, max_sessions, max_samplers
        self.max_pending_per_session, self.max_pending = max_pending_per_session, max_pending
        self.max_request_tokens, self.session_ttl_s = max_request_tokens, session_ttl_s
        self.device = device
        self._loader = loader
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._calls: dict[str, Call] = {}
        self._requests: OrderedDict[tuple, str] = OrderedDict()  # (session, method, request id) → call id

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
        self.expire_sessions()
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

        names = [m["name"] for m in self.list_base_models()]
        if base_model not in names:  # (never a path: what exists on this machine is not a client's to learn)
            raise BadRequest(f"base_model {base_model[:100]!r} is not a base model here; the base models here: "
                             f"{', '.join(names)} (a server adds its own with --model NAME=PATH)")
        try:
            return load_policy(self.models.get(base_model, base_model), device=self.device)
        except (OSError, ValueError, HeteroRLError) as exc:
            raise BadRequest(f"base_model {base_model!r} cannot be loaded here: {exc}") from None

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
        self.expire_sessions()
        with self._lock:
            found = self._sessions.get(session_id)
            if found is not None:
                found.used = time.monotonic()
        if found is None:
            raise NotFound(f"no session {session_id!r} here (create one with POST /api/v1/sessions, or it was idle "
                           f"past --session-ttl-s, or the service restarted)")
        return found

    def expire_sessions(self) -> list[str]:
        """Close the sessions idle past ``session_ttl_s`` with no call waiting or running; their ids."""
        if self.session_ttl_s is None:
            return []
        cutoff = time.monotonic() - self.session_ttl_s
        with self._lock:
            busy = {c.owner for c in self._calls.values() if c.done_at is None}
            idle = [sid for sid, s in self._sessions.items() if s.used < cutoff and sid not in busy]
        for session_id in idle:
            try:
                self.close_session(session_id, expired=True)
            except NotFound:  # (closed meanwhile)
                pass
        return idle

    def close_session(self, session_id: str, expired: bool = False) -> None:
        session = self._sessions.get(session_id) if expired else self.session(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r} here")
        with self._lock:
            self._sessions.pop(session_id, None)
        for sampler in session.samplers.values():
            sampler.close()
        session.training.close()

    def close(self) -> None:
        for session_id in list(self._sessions):
            self.close_session(session_id)

    def shutdown(self, timeout_s: float) -> tuple[int, int]:
        """Stop taking calls and end the sessions: calls still queued are cancelled, calls running get
        ``timeout_s`` to finish. (cancelled, still running): a caller that must stop now ends the process when
        the second is not 0 (a running call cannot be interrupted)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            pending = [c.future for c in self._calls.values() if c.done_at is None]
        cancelled = sum(1 for future in pending if future.cancel())
        for session in sessions:
            for client in [session.training, *session.samplers.values()]:
                client._executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        running = [f for f in pending if not f.done()]
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = [f for f in running if not f.done()]
        return cancelled, len(running)

    # -- calls ------------------------------------------------------------------------------------------------
    def call(self, session_id: str, method: str, args: dict, request_id: str | None = None) -> str:
        """Submit ``method`` of the session's training client; the call's id. A ``request_id`` seen before
        returns the first call's id: a retried request is not run twice."""
        session = self.session(session_id)
        if method not in TRAINING_METHODS:
            raise BadRequest(f"unknown training method {method!r}; one of {', '.join(TRAINING_METHODS)}")
        return self._submit(session_id, method, request_id, lambda: self._start(session, method, args or {}))

    def sampler_call(self, model_id: str, method: str, args: dict, request_id: str | None = None) -> str:
        """Submit ``method`` of the sampling client ``model_id`` ("heterorl:SESSION/VERSION" or "latest")."""
        session_id, sampler = self.sampler(model_id)
        if method not in SAMPLER_METHODS:
            raise BadRequest(f"unknown sampling method {method!r}; one of {', '.join(SAMPLER_METHODS)}")
        args = args or {}
        _check_sampling_size(method, args, self.max_request_tokens)  # (before anything is started)
        return self._submit(session_id, f"sampler:{model_id}:{method}", request_id,
                            lambda: _start_sampling(sampler, method, args))

    def _submit(self, owner: str, method: str, request_id: str | None, start: Callable[[], Future]) -> str:
        """Start a call of session ``owner``; a ``request_id`` already seen for the same session and method
        returns that call's id instead (a retry runs once; the same id elsewhere is another request)."""
        self._expire()
        key = (owner, method, request_id)
        with self._lock:
            if owner in self._sessions:
                self._sessions[owner].used = time.monotonic()
            if request_id is not None and key in self._requests:
                return self._requests[key]
            self._check_room(owner)
        try:
            future = start()
        except (TypeError, KeyError) as exc:  # arguments the method does not take, or lacks
            raise BadRequest(f"bad arguments: {type(exc).__name__}: {exc}") from None
        call_id = f"f-{uuid.uuid4().hex}"
        call = Call(future, owner, time.monotonic())
        with self._lock:
            self._calls[call_id] = call
            if request_id is not None:
                self._requests[key] = call_id
        future.add_done_callback(lambda f: self._finish(call, f))
        return call_id

    def _check_room(self, owner: str) -> None:
        """`TooBusy` when the session, or the service, already has as many calls waiting or running as it takes
        (called holding the lock)."""
        pending = [c.owner for c in self._calls.values() if c.done_at is None]
        mine = sum(1 for o in pending if o == owner)
        if mine >= self.max_pending_per_session:
            raise TooBusy(f"session {owner} has {mine} calls waiting or running, its limit "
                          f"({self.max_pending_per_session}): wait for their results before sending more")
        if len(pending) >= self.max_pending:
            raise TooBusy(f"this service has {len(pending)} calls waiting or running, its limit: retry later")

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
        owner = session.session_id if method == "save_state" else args.get("session") or session.session_id
        if not isinstance(owner, str) or not _SESSION_ID.fullmatch(owner):  # (a session id, never a path)
            raise BadRequest(f"load_state: session={owner!r} is not a session id (s- and 12 hex digits)")
        path = self.state_dir / owner / name
        if path.is_symlink() or path.parent.is_symlink():  # (planted: a state is a file this service wrote)
            raise BadRequest(f"the state {name!r} of session {owner} is a link, which the service does not follow")
        if method == "save_state":
            path.parent.mkdir(parents=True, exist_ok=True)
            return _then(training.save_state(path), lambda _: name)
        if not path.is_file():
            raise NotFound(f"session {owner} saved no state named {name!r} (states outlive a restart; sessions do "
                           "not)")
        return _then_or_refuse(training.load_state(path), f"the state {name!r} of session {owner} cannot be loaded")

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
        with self._lock:
            if call.owner in self._sessions:  # (a poll is a sign of life: its session does not expire meanwhile)
                self._sessions[call.owner].used = time.monotonic()
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
        """(session id, sampling client) of "heterorl:SESSION/VERSION", "heterorl:SESSION/latest" or "latest"
        (only while one session serves samplers: with several it would be another user's model)."""
        served = self.samplers()
        if model_id == "latest" and model_id not in served and any(m.endswith("/latest") for m in served):
            raise BadRequest("model 'latest' is ambiguous here: several sessions serve sampling clients; name "
                             "one, e.g. heterorl:SESSION/latest")
        if model_id not in served:
            raise NotFound(f"no sampling client {model_id!r}; serving: {', '.join(sorted(served)) or 'none yet'} "
                           "(save_weights_and_get_sampling_client makes one)")
        return served[model_id]

    def samplers(self) -> dict[str, tuple[str, SamplingClient]]:
        """Every model id served → (session id, sampling client)."""
        served, newest, serving = {}, None, 0
        with self._lock:
            for session_id, session in self._sessions.items():
                for version, sampler in session.samplers.items():
                    served[f"heterorl:{session_id}/{version}"] = (session_id, sampler)
                if session.samplers:
                    latest = next(reversed(session.samplers.values()))
                    served[f"heterorl:{session_id}/latest"] = (session_id, latest)
                    newest = None if newest is not None else (session_id, latest)
                    serving = serving + 1
        if newest is not None and serving == 1:  # "latest": only when one session serves (else: whose?)
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


def _check_sampling_size(method: str, args: dict, max_tokens_out: int) -> None:
    """`BadRequest` for a sampling call bigger than the service takes, from its arguments' sizes alone (before any
    tokenization, allocation or generation)."""
    key = "prompt_tokens" if method == "sample" else "tokens"
    prompts = args.get(key)
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest(f"{method}: {key} must be a list of token ids, or a list of such lists")
    groups = prompts if isinstance(prompts[0], list) else [prompts]
    given = sum(len(p) if isinstance(p, list) else 1 for p in groups)
    if given > MAX_PROMPT_TOKENS:
        raise BadRequest(f"{method}: {given:,} prompt tokens in one call; this service takes at most "
                         f"{MAX_PROMPT_TOKENS:,}: send fewer or shorter prompts")
    if method != "sample":
        return
    samples, params = args.get("num_samples", 1), args.get("sampling_params") or {}
    length = params.get("max_tokens", SamplingParams().max_tokens) if isinstance(params, dict) else None
    if type(samples) is not int or samples < 1 or type(length) is not int or length < 1:
        raise BadRequest(f"sample: num_samples ({samples!r}) and sampling_params.max_tokens ({length!r}) must be "
                         "integers >= 1")
    seed = params.get("seed") if isinstance(params, dict) else None
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise BadRequest(f"sample: sampling_params.seed={seed!r}: give an integer in [0, 2**63)")
    asked = len(groups) * samples * length
    if asked > max_tokens_out:
        raise BadRequest(f"sample: {len(groups)} prompts x {samples} samples x {length} max_tokens = {asked:,} "
                         f"tokens; one call generates at most {max_tokens_out:,} here: split it into smaller calls")


def _then_or_refuse(future: Future, message: str) -> Future:
    """``future``, whose error (if any) becomes a `BadRequest` saying ``message`` and the error's kind, never its
    text (which may name the server's paths)."""
    out: Future = Future()

    def chain(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            out.set_result(f.result())
        else:
            out.set_exception(BadRequest(f"{message} ({type(exc).__name__})"))
    future.add_done_callback(chain)
    return out


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
