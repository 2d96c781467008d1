"""What each of Tinker's names stands for on `heterorl serve` (`TinkerNames`): its sessions, the models and the
sampling sessions named in them, each bounded in number.

A Tinker session is a namespace ("t-" and 12 hex digits), alive while its client beats (the SDK beats every
10 s) and finished by its client or after --session-ttl-s of silence; finishing it closes its models' heterorl
sessions. A Tinker model (``SESSION:train:N``) names a heterorl training session; a sampling session
(``SESSION:sample:N``) names one of heterorl's sampling clients (``heterorl:s-.../VERSION``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from heterorl.errors import HeteroRLError
from heterorl.service.calls import NotFound, TooBusy
from heterorl.service.sessions import Service
from heterorl.service.tinker.checkpoints import now_iso

MAX_SESSIONS = 256  # Tinker sessions (namespaces, a few hundred bytes each); models count as heterorl sessions
MAX_SAMPLING_SESSIONS = 4096  # names of sampling sessions remembered; the oldest are forgotten beyond


@dataclass
class Model:
    """A Tinker model: its heterorl session and what `get_info` and the run listings say of it."""

    model_id: str
    session_id: str  # heterorl's ("s-...")
    base_model: str
    lora_rank: int | None
    user_metadata: dict
    created: str = field(default_factory=now_iso)


@dataclass
class SamplingSession:
    model: str  # heterorl's sampler id ("heterorl:s-.../VERSION")
    base_model: str
    model_path: str | None


@dataclass
class TinkerSession:
    seen: float = field(default_factory=time.monotonic)  # its last request or heartbeat (the SDK beats every 10 s)
    finished: bool = False
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


class SessionFinished(HeteroRLError):
    """A call on a Tinker session that was finished (HTTP 410 to a heartbeat)."""


class TinkerNames:
    """Tinker's sessions, models and sampling sessions by name (see the module). Thread-safe."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, TinkerSession] = OrderedDict()
        self._models: dict[str, Model] = {}
        self._samplers: OrderedDict[str, SamplingSession] = OrderedDict()

    # -- sessions -----------------------------------------------------------------------------------------
    def create_session(self) -> str:
        """A new session's id. Sessions silent for --session-ttl-s (a client gone without closing its
        ServiceClient) are finished first."""
        self.expire_sessions()
        with self._lock:
            live = [sid for sid, s in self._sessions.items() if not s.finished]
            if len(live) >= MAX_SESSIONS:
                raise TooBusy(f"create_session: this service holds {MAX_SESSIONS} open Tinker sessions; finish "
                              "one (ServiceClient.close) before opening another")
            while len(self._sessions) >= 2 * MAX_SESSIONS:  # (finished ones are forgotten first)
                oldest = next((sid for sid, s in self._sessions.items() if s.finished), None)
                if oldest is None:
                    break
                del self._sessions[oldest]
            session_id = f"t-{uuid.uuid4().hex[:12]}"
            self._sessions[session_id] = TinkerSession()
        return session_id

    def expire_sessions(self) -> None:
        ttl = self.service.session_ttl_s
        if ttl is None:
            return
        cutoff = time.monotonic() - ttl
        with self._lock:
            silent = [sid for sid, s in self._sessions.items() if not s.finished and s.seen < cutoff]
        for session_id in silent:
            self.finish(session_id)

    def session(self, session_id: str, *, open_only: bool = True) -> TinkerSession:
        with self._lock:
            found = self._sessions.get(session_id) if isinstance(session_id, str) else None
            if found is not None:
                found.seen = time.monotonic()
        if found is None:
            raise NotFound(f"no Tinker session {str(session_id)[:100]!r} here (ServiceClient makes one; sessions "
                           "do not outlive the service)")
        if open_only and found.finished:
            raise SessionFinished(f"the Tinker session {session_id} is finished")
        return found

    def heartbeat(self, session_id: str) -> None:
        """A sign of life: the session's models are not closed as idle (`Service.session_ttl_s`)."""
        session = self.session(session_id)
        for model_id in list(session.models):
            try:
                self.service.session(self._models[model_id].session_id)
            except (NotFound, KeyError):
                pass

    def finish(self, session_id: str) -> None:
        """End a session: its models' heterorl sessions are closed (their checkpoints stay)."""
        session = self.session(session_id, open_only=False)
        with self._lock:
            already, session.finished = session.finished, True
        if already:
            return
        for model_id in session.models:
            with self._lock:
                model = self._models.pop(model_id, None)  # (its run description stays on disk, listed)
            if model is not None:
                try:
                    self.service.close_session(model.session_id)
                except NotFound:
                    pass

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    # -- models -------------------------------------------------------------------------------------------
    def model(self, model_id: str) -> Model:
        with self._lock:
            found = self._models.get(model_id) if isinstance(model_id, str) else None
        if found is None:
            raise NotFound(f"no Tinker model {str(model_id)[:100]!r} here (create_lora_training_client makes one; "
                           "models do not outlive the service, their checkpoints do)")
        return found

    def add_model(self, model: Model) -> None:
        """Name ``model`` in its session (``SESSION:train:N``)."""
        with self._lock:
            self._models[model.model_id] = model
            session = self._sessions.get(model.model_id.split(":")[0])
            if session is not None:
                session.models.append(model.model_id)

    # -- sampling sessions --------------------------------------------------------------------------------
    def add_sampler(self, sampler_id: str, entry: SamplingSession) -> None:
        """Name ``entry`` in its session (``SESSION:sample:N``); beyond `MAX_SAMPLING_SESSIONS`, the oldest names
        are forgotten."""
        with self._lock:
            self._samplers[sampler_id] = entry
            while len(self._samplers) > MAX_SAMPLING_SESSIONS:
                self._samplers.popitem(last=False)
            session = self._sessions.get(sampler_id.split(":")[0])
            if session is not None:
                session.samplers.append(sampler_id)
                del session.samplers[:-MAX_SAMPLING_SESSIONS]

    def has_sampler(self, sampler_id: str) -> bool:
        with self._lock:
            return sampler_id in self._samplers

    def sampler(self, sampler_id: str) -> SamplingSession:
        with self._lock:
            found = self._samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if found is None:
            raise NotFound(f"no sampling session {str(sampler_id)[:100]!r} here (save_weights_and_get_sampling_client "
                           "or create_sampling_client makes one)")
        return found
