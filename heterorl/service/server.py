"""`heterorl serve`: training sessions over HTTP (FastAPI + uvicorn), and the OpenAI-compatible endpoint over
their sampling clients.

Routes (all under a bearer token when the service has one; docs/SERVICE.md):

    POST   /api/v1/sessions                     {base_model, seed?, share_prompts?, lora?, name?} → the session
    GET    /api/v1/sessions                     the caller's sessions: ids, names, base models, versions
    GET    /api/v1/sessions/{id}                the session: version, step, samplers (an id or a name)
    DELETE /api/v1/sessions/{id}
    POST   /api/v1/sessions/{id}/calls          {method, args, request_id?} → {future_id}
    POST   /api/v1/samplers/calls               {model, method, args, request_id?} → {future_id}
    GET    /api/v1/futures/{id}?wait_s=30       {status: pending} | {status: done, result | error}
    DELETE /api/v1/futures/{id}                 cancel it: {state: cancelled | stopping | running | done}
    GET    /api/v1/sessions/{id}/weights/{v}    a version's weights (safetensors), after save_weights_for_sampler
    GET    /api/v1/sessions/{id}/tokenizer      its tokenizer's files (zip)
    GET    /api/v1/memory                       {budget_bytes, used_bytes, calls_bytes, sessions, samplers}: bytes held
    GET    /health                              no token needed
    /v1/models, /v1/completions, /v1/chat/completions (heterorl.service.openai_api)
    /tinker/api/v1/...                   Tinker's REST API, for its SDK and cookbook (heterorl.service.tinker)

Bodies are JSON, or msgpack with ``Content-Type: application/msgpack`` (token arrays travel smaller); answers
follow ``Accept``. A malformed body is a 422 naming the field, an unknown id a 404 naming it, a call the session
cannot run a 400 with the error a local call would raise, a body over ``max_body_bytes`` a 413, a missing or
wrong token a 401 (nothing runs), a session that does not fit the memory budget a 507 (and a sampling client
evicted to keep within it a 404 saying so). Calls run as futures in submission order per session, whatever happens
to the connection that submitted them; a retried request (same ``request_id``) runs once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from heterorl.errors import HeteroRLError
from heterorl.runs import finite_or_null
from heterorl.service import wire
from heterorl.service.bounds import bounded_errors
from heterorl.service.calls import BadRequest, NotFound, TooBusy
from heterorl.service.guard import (
    BODY_IDLE_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEY_MISSING,
    guard,
    header_timeout_protocol,
    key_list,
    matching_key,
    parse_body,
)
from heterorl.service.memory import OverMemoryBudget
from heterorl.service.sessions import Service, tokenizer_zip
from heterorl.transport.sockets import is_loopback_host as is_loopback

log = logging.getLogger("heterorl.service")
MAX_WAIT_S = 60.0  # the longest a long-poll holds a request open
SHUTDOWN_GRACE_S = 10.0  # on SIGTERM/SIGINT, requests in flight get this long to finish before they are cut


class CreateSession(BaseModel):
    base_model: str = Field(min_length=1, max_length=1000)
    seed: int | None = None
    share_prompts: bool = True
    lora: dict[str, Any] | None = None  # {rank, alpha, dropout, target_modules}: a LoRA session
    name: str | None = Field(default=None, max_length=64)  # a name for its model ids, unique while it lives


class TrainingCall(BaseModel):
    method: str = Field(min_length=1, max_length=100)
    args: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = Field(default=None, max_length=200)


class SamplerCall(TrainingCall):
    model: str = Field(min_length=1, max_length=300)


def create_app(service: Service, *, api_key: str | Sequence[str] | None = None, max_body_bytes: int = 64 * 2**20,
               openai: bool = True, docs: bool = False, batching: bool = True, tinker: bool = True) -> FastAPI:
    """The service's FastAPI app. ``api_key``: the bearer token every route but /health requires (None: none;
    several: one per user, each user's sessions its own, `Service.sampler`).
    ``docs``: serve /docs, /redoc and /openapi.json (behind the key, like every route). ``batching``: concurrent
    OpenAI requests to one model share engine calls where they can. ``tinker``: serve Tinker's REST API under
    /tinker (`heterorl.service.tinker.routes`)."""
    app = FastAPI(title="heterorl training sessions", version="1", docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)

    keys = key_list(api_key)

    def authorize(authorization: str | None = Header(default=None),
                  x_api_key: str | None = Header(default=None)) -> None:
        if keys is not None and matching_key(authorization, keys, x_api_key) is None:  # (`Guard` checked it first)
            raise HTTPException(401, KEY_MISSING, headers={"WWW-Authenticate": "Bearer"})

    _error_handlers(app)
    guard(app, api_key, max_body_bytes)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    app.include_router(_api_router(service, max_body_bytes), dependencies=[Depends(authorize)])
    if tinker:
        from heterorl.service.tinker.routes import tinker_router

        app.include_router(tinker_router(service, max_body_bytes), dependencies=[Depends(authorize)])
    if openai:
        from heterorl.service.openai_api import openai_router

        router = openai_router(lambda: {model: sampler for model, (_, sampler) in service.samplers().items()},
                               batching=batching, lookup=_openai_lookup(service))
        app.include_router(router, dependencies=[Depends(authorize)])
    return app


def _openai_lookup(service: Service) -> Callable:
    """The sampling client of an OpenAI request's model, found as the session API finds it (a use of it, for the
    memory budget; why an id is not served: evicted, closed, ambiguous)."""
    from heterorl.service.openai_api import RequestRefused

    def lookup(model_id: str):
        try:
            return service.sampler(model_id)[1]
        except NotFound as exc:
            raise RequestRefused(404, str(exc), "model", "model_not_found") from None
        except BadRequest as exc:
            raise RequestRefused(400, str(exc), "model") from None

    return lookup


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(TooBusy)
    async def too_busy(request: Request, exc: TooBusy):
        return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": "1"})

    @app.exception_handler(OverMemoryBudget)  # (Starlette takes the handler of the nearest class in the MRO)
    async def over_budget(request: Request, exc: OverMemoryBudget):
        return JSONResponse({"detail": str(exc), "error": wire.error_to_wire(exc)}, status_code=507)

    @app.exception_handler(HeteroRLError)
    async def refused(request: Request, exc: HeteroRLError):  # BadRequest and what a primitive refuses at once
        return JSONResponse({"detail": str(exc), "error": wire.error_to_wire(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):  # (never the refused value itself)
        return JSONResponse({"detail": bounded_errors(exc.errors())}, status_code=422)


async def _body(request: Request, model: type[BaseModel], limit: int):
    """The request's body (JSON or msgpack) validated against ``model``, off the event loop (`parse_body`): 422
    naming the field otherwise."""
    return await parse_body(request, model, limit)


def _answer(request: Request, value: Any) -> Response:
    if wire.MSGPACK in request.headers.get("accept", ""):
        return Response(wire.pack(value, wire.MSGPACK), media_type=wire.MSGPACK)
    return JSONResponse(finite_or_null(value))  # (standard JSON: a skipped step's grad_norm inf is null)


def _api_router(service: Service, limit: int) -> APIRouter:
    api = APIRouter(prefix="/api/v1")

    @api.post("/sessions")
    async def create(request: Request):
        body = await _body(request, CreateSession, limit)
        found = await run_in_threadpool(service.create_session, body.base_model, body.seed, body.share_prompts,
                                        body.lora, body.name)
        return _answer(request, found)

    @api.get("/base_models")
    async def base_models() -> dict:
        return {"base_models": await run_in_threadpool(service.list_base_models)}

    @api.get("/sessions")
    def sessions() -> dict:
        """The caller's sessions: their ids, and each one's name, base model, version and newest sampler."""
        described = service.list_sessions()
        return {"sessions": [d["session_id"] for d in described], "described": described}

    @api.get("/sessions/{session_id}")
    def describe(session_id: str) -> dict:
        return service.describe(session_id)

    @api.delete("/sessions/{session_id}")
    async def close(session_id: str) -> dict:
        await run_in_threadpool(service.close_session, session_id)
        return {"closed": session_id}

    @api.post("/sessions/{session_id}/calls")
    async def call(session_id: str, request: Request):
        body = await _body(request, TrainingCall, limit)
        call_id = service.call(session_id, body.method, body.args, body.request_id)
        return _answer(request, {"future_id": call_id})

    @api.post("/samplers/calls")
    async def sampler_call(request: Request):
        body = await _body(request, SamplerCall, limit)
        call_id = service.sampler_call(body.model, body.method, body.args, body.request_id)
        return _answer(request, {"future_id": call_id})

    @api.get("/futures/{future_id}")
    async def future(future_id: str, request: Request, wait_s: float = 0.0):
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise BadRequest(f"wait_s={wait_s}: give 0 to {MAX_WAIT_S:g} seconds")
        return _answer(request, await service.poll(future_id, wait_s))

    @api.get("/memory")
    def memory() -> dict:
        return service.memory()

    @api.delete("/futures/{future_id}")
    async def cancel(future_id: str) -> dict:
        return {"future_id": future_id, "state": service.cancel_call(future_id)}

    @api.get("/sessions/{session_id}/tokenizer")
    async def tokenizer(session_id: str) -> Response:
        data = await run_in_threadpool(tokenizer_zip, service.session(session_id).training.tokenizer)
        return Response(data, media_type="application/zip")

    @api.get("/sessions/{session_id}/weights/{version}")
    async def weights(session_id: str, version: int) -> Response:
        data = await run_in_threadpool(service.weights, session_id, version)
        return Response(data, media_type="application/octet-stream")

    return api


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one) and the URL it serves; a clear error when the
    address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: an answer's headers and body are separate writes, and with Nagle on the
    # body would wait for the client's delayed ACK (measured: 48 ms per request on loopback)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # (at once: a client told the URL may connect before the server's loop accepts)
    except OSError as exc:
        sock.close()
        raise HeteroRLError(f"cannot listen on {host}:{port} ({exc}): choose another port") from None
    return sock, f"http://{host if family == socket.AF_INET else f'[{host}]'}:{sock.getsockname()[1]}"


class ServerThread:
    """An app served by uvicorn from a daemon thread of this process (tests, a rollout worker's endpoint): the
    socket is bound before it starts, so ``url`` is known at once (``port`` 0: a free one)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout_s: float = HEADER_TIMEOUT_S, body_idle_s: float = BODY_IDLE_TIMEOUT_S) -> None:
        import uvicorn

        self._socket, self.url = listen(host, port)
        self.host, self.port = host, self._socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                                    http=header_timeout_protocol(header_timeout_s, body_idle_s)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                       name="heterorl-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise HeteroRLError(f"the HTTP server on {self.url} did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(service: Service, host: str, port: int, *, api_key: str | Sequence[str] | None, max_body_bytes: int,
          log_level: str = "info", on_listening: Callable[[str], None] | None = None,
          docs: bool = False, batching: bool = True, grace_s: float = SHUTDOWN_GRACE_S) -> str | None:
    """Run the service until SIGTERM or SIGINT; the signal's name (None: the server stopped by itself). A
    non-loopback ``host`` needs an API key. The socket is bound first and ``on_listening`` called with its URL
    (with the port the system chose when ``port`` is 0). Requests in flight at the signal get
    ``grace_s`` to finish; the caller then stops the sessions (`Service.shutdown`)."""
    import uvicorn

    if api_key is None and not is_loopback(host):
        raise HeteroRLError(f"refusing to serve training sessions on {host} without an API key: give "
                            "--api-key-file (a file holding the key), or bind 127.0.0.1")
    sock, url = listen(host, port)
    early: list[int] = []  # a signal before uvicorn listens for them (e.g. right after the URL is printed)
    previous = _catch_signals(lambda sig, frame: early.append(sig))
    try:
        if on_listening is not None:
            on_listening(url)
        app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes, docs=docs, batching=batching)
        server = _signalled_server_class()(uvicorn.Config(
            app, log_level=log_level, lifespan="off", http=header_timeout_protocol(),
            timeout_graceful_shutdown=grace_s))
        if early:
            server.handle_exit(early[0], None)
        server.run(sockets=[sock])
    finally:
        sock.close()
        _catch_signals(previous)
    return server.stopped_by


def _catch_signals(handler) -> dict:
    """Give SIGINT and SIGTERM to ``handler`` (a function, or {signal: handler} to restore); the handlers before.
    Only the main thread may: elsewhere nothing changes."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = handler if isinstance(handler, dict) else {signal.SIGINT: handler, signal.SIGTERM: handler}
    return {sig: signal.signal(sig, h) for sig, h in handlers.items()}


def _signalled_server_class():
    """(made on first use: uvicorn is imported only to serve)"""
    import uvicorn

    class SignalledServer(uvicorn.Server):
        """uvicorn's server that remembers the signal it stopped on instead of raising it again when it is done
        (which would end the process before the sessions are stopped and the stop is reported)."""

        stopped_by: str | None = None

        def handle_exit(self, sig, frame) -> None:
            import signal

            self.stopped_by = signal.Signals(sig).name
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            original = _catch_signals(self.handle_exit)
            try:
                yield
            finally:
                _catch_signals(original)

    return SignalledServer


__all__ = ["ServerThread", "create_app", "is_loopback", "listen", "serve"]
