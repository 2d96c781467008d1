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
from typing import Callable

from heterorl.engines.base import GenerationWatch
from heterorl.errors import HeteroRLError
from heterorl.service import memory, wire
from heterorl.service.bounds import MAX_REQUEST_TOKENS, check_sampling_size, check_training_size
from heterorl.service.calls import BadRequest, CallBook, NotFound
from heterorl.service.guard import CALLER
from heterorl.training.session import SamplingClient, TrainingClient
from heterorl.transport.weights.inflight import MALLOC_TRIM

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SESSION_ID = re.compile(r"s-[0-9a-f]{12}")
TRAINING_METHODS = ("forward", "forward_backward", "optim_step", "save_weights_for_sampler",
                    "save_weights_and_get_sampling_client", "save_state", "load_state")
SAMPLER_METHODS = ("sample", "compute_logprobs")


@dataclass
class Session:
    session_id: str
    base_model: str
    training: TrainingClient
    samplers: OrderedDict = field(default_factory=OrderedDict)  # version → SamplingClient, oldest first
    weights: OrderedDict = field(default_factory=OrderedDict)  # version → state dict exported for download
    used: float = field(default_factory=time.monotonic)  # when a request last named it (`Service.session_ttl_s`)
    name: str = ""  # the caller's name for it (""; none): its model ids may say it in place of the id
    owner: int = 0  # which of the service's keys made it (`guard.Caller.key`): "latest" looks among its owner's

    @property
    def label(self) -> str:
        """How its model ids name it: by its name when it has one."""
        return self.name or self.session_id


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
    ``max_samplers`` sampling clients (older ones are closed and their model ids answer 404); all of them hold at
    most ``memory_budget_mb`` together ("auto": half the memory; None: no bound; `memory.Budget` says how)."""

    def __init__(self, state_dir: str | Path, *, result_ttl_s: float = 600.0, max_sessions: int = 8,
                 max_samplers: int = 8, device: str = "cpu",
                 loader: Callable[[str], tuple] | None = None, models: dict[str, str] | None = None,
                 max_pending_per_session: int = 64, max_pending: int = 512,
                 max_request_tokens: int = MAX_REQUEST_TOKENS, session_ttl_s: float | None = 3600.0,
                 memory_budget_mb: float | str | None = "auto") -> None:
        """``models``: local Hugging Face folders sessions may start from by name ({name: path};
        `list_base_models` names them with the built-in policies). Calls waiting or running: at most
        ``max_pending_per_session`` per session and ``max_pending`` in all (`TooBusy` beyond). One sampling call
        generates at most ``max_request_tokens`` (prompts x samples x max_tokens). A session no request named for
        ``session_ttl_s`` (None: never) is closed when the next request arrives, unless a call of it is still
        waiting or running."""
        self.state_dir = Path(state_dir)
        self.models = dict(models or {})
        self.result_ttl_s, self.max_sessions, self.max_samplers = result_ttl_s, max_sessions, max_samplers
        self.max_request_tokens, self.session_ttl_s = max_request_tokens, session_ttl_s
        self.device = device
        self.budget = memory.Budget(memory.budget_bytes(memory_budget_mb, device))
        self._loader = loader
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self.calls = CallBook(result_ttl_s=result_ttl_s, max_pending_per_session=max_pending_per_session,
                              max_pending=max_pending)

    # -- sessions -------------------------------------------------------------------------------------------
    def list_base_models(self) -> list[dict]:
        """The policies sessions can start from by name: [{name, description}] (`policies.base_models`)."""
        from heterorl.policies import base_models

        return [{"name": name, "description": what} for name, what in base_models(self.models).items()]

    def create_session(self, base_model: str, seed: int | None = None, share_prompts: bool = True,
                       lora: dict | None = None, name: str | None = None) -> dict:
        """Load ``base_model`` (a name `list_base_models` gives, or a Hugging Face folder on this machine) with a
        fresh optimizer; its description. ``lora`` ({rank, alpha, dropout, target_modules}): train a low-rank
        adapter on it (a mismatch with the model is a `BadRequest` naming it). ``name``: what its model ids say
        in place of its id (``heterorl:NAME/latest``), unique among the live sessions."""
        spec = _lora_spec(lora)
        if name is not None and (not _NAME.fullmatch(name) or _SESSION_ID.fullmatch(name) or len(name) > 64):
            raise BadRequest(f"session name {name[:100]!r}: give 1 to 64 letters, digits, '.', '_' or '-', starting "
                             "with a letter or digit (and not of a session id's form, s-<12 hex digits>)")
        self.expire_sessions()
        with self._lock:
            if name is not None and any(s.name == name for s in self._sessions.values()):
                raise BadRequest(f"a live session is named {name!r} already: choose another name, or close it")
            if len(self._sessions) >= self.max_sessions:
                raise BadRequest(f"this service holds its maximum of {self.max_sessions} sessions: close one "
                                 "(DELETE /api/v1/sessions/ID) or start it with a larger --max-sessions")
            self._make_room("a new session", None)  # (refused before loading when the budget is used up)
        model, tokenizer = self._load(base_model)
        try:
            training = TrainingClient(model, tokenizer, device=self.device, seed=seed, share_prompts=share_prompts,
                                      lora=spec)
        except HeteroRLError as exc:  # (a LoRA config that does not fit the model)
            raise BadRequest(str(exc)) from None
        session = Session(f"s-{uuid.uuid4().hex[:12]}", base_model, training, name=name or "", owner=CALLER.get().key)
        try:
            with self._lock:
                evicted = self._make_room(f"a session of {base_model}", memory.session_bytes(training, ()))
                self._sessions[session.session_id] = session
        except memory.OverMemoryBudget:
            training.close()
            raise
        for sampler in evicted:
            sampler.close()
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
        return {"session_id": session.session_id, "name": session.name or None, "base_model": session.base_model,
                "version": training.version,
                "step": training.step, "vocab_size": model.get_input_embeddings().num_embeddings,
                "parameters": sum(p.numel() for p in model.parameters()),
                "trainable_parameters": sum(p.numel() for p in training.trainable_parameters()),
                "lora": training.lora.to_dict() if training.lora is not None else None,
                "adapter": training.adapter_meta,
                "samplers": [f"heterorl:{session.label}/{v}" for v in session.samplers]}

    def list_sessions(self) -> list[dict]:
        """The caller's sessions (those its key made), each as {session_id, name, base_model, version, latest}."""
        owner = CALLER.get().key
        with self._lock:
            mine = [s for s in self._sessions.values() if s.owner == owner]
            return [{"session_id": s.session_id, "name": s.name or None, "base_model": s.base_model,
                     "version": s.training.version,
                     "latest": f"heterorl:{s.label}/latest" if s.samplers else None} for s in mine]

    def session(self, session_id: str) -> Session:
        """The session of ``session_id`` (its id or its name) that the caller's key made."""
        self.expire_sessions()
        owner = CALLER.get().key
        with self._lock:
            found = self._sessions.get(session_id) or next(
                (s for s in self._sessions.values() if s.name and s.name == session_id), None)
            if found is not None and found.owner != owner:
                found = None  # (another key's: as if it did not exist)
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
        busy = {c.owner for c in self.calls.pending()}
        with self._lock:
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
            self._sessions.pop(session.session_id, None)
        for sampler in session.samplers.values():
            sampler.close()
        session.training.close()

    def close(self) -> None:
        for session_id in list(self._sessions):
            self.close_session(session_id, expired=True)  # (every key's)

    def shutdown(self, timeout_s: float) -> tuple[int, int]:
        """Stop taking calls and end the sessions: calls still queued are cancelled, sampling calls running are
        stopped between two decode steps, other calls running get ``timeout_s`` to finish. (cancelled, still
        running): a caller that must stop now ends the process when the second is not 0 (a training call that
        runs cannot be interrupted)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        pending = self.calls.pending()
        cancelled = sum(1 for call in pending if call.future.cancel())
        for call in pending:
            if call.watch is not None:
                call.watch.cancel()
        for session in sessions:
            for client in [session.training, *session.samplers.values()]:
                client._executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        running = [c.future for c in pending if not c.future.done()]
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
        if method in ("forward", "forward_backward"):
            check_training_size(method, args or {}, session.training)  # (before any tensor is made)
            lengths = [len(d.get("tokens") or ()) for d in args["datums"]]  # (checked just above)
            return self._submit(session.session_id, method, request_id, lambda: self.start_counted(
                session, method, lengths, lambda: self._start(session, method, args)))
        return self._submit(session.session_id, method, request_id, lambda: self._start(session, method, args or {}))

    def start_counted(self, session: Session, method: str, lengths: list[int], start: Callable[[], Future]) -> Future:
        """``start()``, a forward or forward_backward call of ``session`` on datums of ``lengths`` tokens, with
        what it will allocate counted in the memory budget (`memory.training_call_bytes`) until it ends: samplers
        are evicted for it, or it is refused (`OverMemoryBudget`). Once it ends the memory it freed goes back to
        the system (`malloc_trim`: without it the allocator kept it, and the floor rose from 0.4 to 3.9 GB over
        12 calls of 1,024 datums)."""
        nbytes = memory.training_call_bytes(session.training.model, lengths, method == "forward_backward")
        sid = session.session_id
        with self._lock:
            evicted = self._make_room(f"a {method} call of {sum(lengths):,} tokens in {len(lengths):,} datums "
                                      f"(session {sid})", self.budget.call_extra(sid, nbytes))
            self.budget.add_call(sid, nbytes)
        for sampler in evicted:
            sampler.close()
        try:
            future = start()
        except BaseException:
            self._end_call(sid, nbytes)
            raise
        future.add_done_callback(lambda _: self._end_call(sid, nbytes))
        return future

    def _end_call(self, session_id: str, nbytes: int) -> None:
        with self._lock:
            self.budget.end_call(session_id, nbytes)
        if MALLOC_TRIM is not None:
            MALLOC_TRIM(0)

    def sampler_call(self, model_id: str, method: str, args: dict, request_id: str | None = None) -> str:
        """Submit ``method`` of the sampling client ``model_id`` ("heterorl:SESSION/VERSION" or "latest")."""
        session_id, sampler = self.sampler(model_id)
        if method not in SAMPLER_METHODS:
            raise BadRequest(f"unknown sampling method {method!r}; one of {', '.join(SAMPLER_METHODS)}")
        args = args or {}
        check_sampling_size(method, args, self.max_request_tokens)  # (before anything is started)
        watch = GenerationWatch() if method == "sample" else None  # (`cancel` stops it between decode steps)
        return self._submit(session_id, f"sampler:{model_id}:{method}", request_id,
                            lambda: _start_sampling(sampler, method, args, model_id, watch),
                            sampler=(session_id, sampler.version), watch=watch)

    def _submit(self, owner: str, method: str, request_id: str | None, start: Callable[[], Future],
                **call) -> str:
        """Start a call of session ``owner`` (`CallBook.submit`: a ``request_id`` already seen for the same session
        and method returns that call's id instead)."""
        with self._lock:
            if owner in self._sessions:
                self._sessions[owner].used = time.monotonic()
        return self.calls.submit(owner, method, request_id, start, **call)

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
        return _state_call(self.state_dir, session, method, args)

    def _keep_weights(self, session: Session, version: int, state: dict) -> int:  # (whole or adapter)
        with self._lock:
            dropped = next(iter(session.weights.values())) if len(session.weights) >= 2 else {}
            evicted = self._make_room(f"the weights of version {version} of session {session.session_id}",
                                      memory.tensors_bytes(state.values()) - memory.tensors_bytes(dropped.values()))
            session.weights[version] = state
            while len(session.weights) > 2:
                session.weights.popitem(last=False)
        for sampler in evicted:
            sampler.close()
        return version

    def _keep_sampler(self, session: Session, sampler: SamplingClient) -> dict:
        model_id = f"heterorl:{session.session_id}/{sampler.version}"
        try:
            with self._lock:
                evicted = self._make_room(f"the sampling client {model_id}", memory.sampler_bytes(sampler), session)
                session.samplers[sampler.version] = sampler
                self.budget.use((session.session_id, sampler.version))
                while len(session.samplers) > self.max_samplers:
                    evicted.append(self._evict(session, next(iter(session.samplers)), "was closed: its session "
                                               f"keeps its newest {self.max_samplers} (--max-samplers)"))
        except memory.OverMemoryBudget:  # (the session goes on as it was)
            sampler.close()
            raise
        for old in evicted:
            old.close()
        return {"version": sampler.version, "model": model_id}

    def get_call(self, call_id: str):
        return self.calls.get(call_id)

    async def poll(self, call_id: str, wait_s: float = 0.0) -> dict:
        """The call's state: ``pending``, or ``done`` with its ``result`` or ``error``; waits up to ``wait_s``
        for it to finish (long-poll) without holding a thread. A poll is a sign of life of its session."""
        call = self.calls.get(call_id)
        with self._lock:
            if call.owner in self._sessions:  # (its session does not expire meanwhile)
                self._sessions[call.owner].used = time.monotonic()
        return await self.calls.poll(call, wait_s)

    def cancel_call(self, call_id: str) -> str:
        """Cancel a call (`CallBook.cancel`): what became of it."""
        return self.calls.cancel(call_id)

    # -- samplers and weights -----------------------------------------------------------------------------
    def sampler(self, model_id: str) -> tuple[str, SamplingClient]:
        """(session id, sampling client) of "heterorl:SESSION/VERSION" or "heterorl:SESSION/latest" (SESSION: its
        id or its name), or "latest": the newest sampler of the session the caller's ``X-Heterorl-Session``
        header names, else of the one session its key made that serves samplers (`latest_session`); a use of it,
        for the eviction of the least recently used. `NotFound` saying why for an evicted one."""
        if model_id == "latest":
            model_id = f"heterorl:{self.latest_session().label}/latest"
        served = self._served()
        if model_id not in served:
            listed = ", ".join(sorted(served)) or "none yet"
            with self._lock:
                evicted = self.budget.gone(model_id)
            raise NotFound(evicted or f"no sampling client {model_id!r}; serving: {listed} "
                           "(save_weights_and_get_sampling_client makes one)")
        session, version, sampler = served[model_id]
        with self._lock:
            if version in session.samplers:
                self.budget.use((session.session_id, version))
        return session.session_id, sampler

    def latest_session(self) -> Session:
        """The session whose newest sampler "latest" names for the caller (`guard.CALLER`): the one its
        ``X-Heterorl-Session`` header names (an id or a name), else the one session its key made that serves
        samplers. `BadRequest` when its key's sessions serve several (naming them), `NotFound` when none."""
        with self._lock:
            sessions = list(self._sessions.values())
        return _latest_of(sessions, CALLER.get())

    def touch_sampler(self, model_id: str) -> None:
        """Record a use of the sampler ``model_id`` names, as `sampler` does (the OpenAI endpoint calls it for each
        request's model: the samplers evicted first are those used least recently); its errors as `sampler`'s."""
        self.sampler(model_id)

    def samplers(self) -> dict[str, tuple[str, SamplingClient]]:
        """Every model id served → (session id, sampling client)."""
        return {model_id: (session.session_id, sampler) for model_id, (session, _, sampler) in self._served().items()}

    def _served(self) -> dict[str, tuple[Session, int, SamplingClient]]:
        """Every model id served to the caller's key (`guard.CALLER`: another key's sessions are not listed) →
        (session, version, sampling client): by each session's id and by its name, and "latest" where it names
        one session for the caller (`latest_session`)."""
        served, owner = {}, CALLER.get().key
        with self._lock:
            for session in self._sessions.values():
                if session.owner != owner:
                    continue
                labels = [session.session_id, *([session.name] if session.name else [])]
                for version, sampler in session.samplers.items():
                    for label in labels:
                        served[f"heterorl:{label}/{version}"] = (session, version, sampler)
                if session.samplers:
                    newest = next(reversed(session.samplers))
                    for label in labels:
                        served[f"heterorl:{label}/latest"] = (session, newest, session.samplers[newest])
        try:
            latest = self.latest_session()
        except (BadRequest, NotFound):
            return served
        return {**served, "latest": served[f"heterorl:{latest.session_id}/latest"]}

    def weights(self, session_id: str, version: int) -> bytes:
        session = self.session(session_id)
        with self._lock:
            state = session.weights.get(version)
        if state is None:
            raise NotFound(f"session {session_id} holds no exported weights of version {version} (the two newest "
                           "save_weights_for_sampler results are kept)")
        return wire.state_to_bytes(state)

    # -- memory -------------------------------------------------------------------------------------------
    def memory(self) -> dict:
        """What the service holds against its budget: {budget_bytes (None: no budget), used_bytes, sessions:
        {session id: bytes}, samplers: {model id: bytes}} (`heterorl.service.memory` counts them)."""
        with self._lock:
            return self.budget.report(self._sessions)

    def _make_room(self, what: str, need_bytes: int | None, newcomer: Session | None = None) -> list[SamplingClient]:
        """The samplers `memory.Budget.make_room` evicts for ``need_bytes`` more, out of service, to close once the
        lock is released (called holding the lock)."""
        busy = {c.sampler for c in self.calls.pending()}
        chosen = self.budget.make_room(what, need_bytes, self._sessions, busy, newcomer)
        return [self._evict(self._sessions[session_id], version) for session_id, version in chosen]

    def _evict(self, session: Session, version: int, why: str | None = None) -> SamplingClient:
        """Take a sampler out of service, for ``why`` (`memory.Budget.forget`; called holding the lock)."""
        self.budget.forget((session.session_id, version), why)
        return session.samplers.pop(version)


def _state_call(state_dir: Path, session: Session, method: str, args: dict) -> Future:
    """``save_state`` or ``load_state`` of ``session``: a file name in the state folder of a session (its own, or
    for a load the one ``args`` names), never a path or a link."""
    name = args.get("name", "")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{method} takes a file name (letters, digits, '.', '_', '-'; no folders), got {name!r}: "
                         "states live in the service's state folder, one per session")
    owner = session.session_id if method == "save_state" else args.get("session") or session.session_id
    if not isinstance(owner, str) or not _SESSION_ID.fullmatch(owner):  # (a session id, never a path)
        raise BadRequest(f"load_state: session={owner!r} is not a session id (s- and 12 hex digits)")
    path = state_dir / owner / name
    if path.is_symlink() or path.parent.is_symlink():  # (planted: a state is a file this service wrote)
        raise BadRequest(f"the state {name!r} of session {owner} is a link, which the service does not follow")
    if method == "save_state":
        path.parent.mkdir(parents=True, exist_ok=True)
        return _then(session.training.save_state(path), lambda _: name)
    if not path.is_file():
        raise NotFound(f"session {owner} saved no state named {name!r} (states outlive a restart; sessions do not)")
    return _then_or_refuse(session.training.load_state(path),
                           f"the state {name!r} of session {owner} cannot be loaded")


def _latest_of(sessions: list[Session], caller) -> Session:
    """`Service.latest_session` over ``sessions`` (a copy taken under the service's lock) for ``caller``."""
    if caller.session:
        named = [s for s in sessions if caller.session in (s.session_id, s.name) and s.owner == caller.key]
        if not named:
            raise NotFound(f"X-Heterorl-Session names {caller.session!r}: no session of this key has that id or name")
        if not named[0].samplers:
            raise NotFound(f"session {named[0].label} serves no sampling client yet "
                           "(save_weights_and_get_sampling_client makes one)")
        return named[0]
    serving = [s for s in sessions if s.owner == caller.key and s.samplers]
    if len(serving) > 1:
        raise BadRequest(f"model 'latest' is ambiguous: {len(serving)} sessions of this key serve sampling "
                         f"clients ({', '.join(s.label for s in serving[:10])}); name one, e.g. "
                         f"heterorl:{serving[0].label}/latest, or send the header 'X-Heterorl-Session: NAME'")
    if not serving:
        raise NotFound("model 'latest': no session of this key serves a sampling client yet "
                       "(save_weights_and_get_sampling_client makes one)")
    return serving[0]


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


def _start_sampling(sampler: SamplingClient, method: str, args: dict, model_id: str,
                    watch: GenerationWatch | None) -> Future:
    try:
        if method == "sample":
            return sampler.sample(args["prompt_tokens"], int(args.get("num_samples", 1)),
                                  wire.params_from_wire(args.get("sampling_params")), watch=watch)
        return sampler.compute_logprobs(args["tokens"])
    except RuntimeError:  # its executor is shut down: evicted after the call looked it up
        raise NotFound(f"the sampling client {model_id!r} was evicted as this call arrived: make a new one with "
                       "save_weights_and_get_sampling_client") from None


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
