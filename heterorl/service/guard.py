"""What every HTTP app of the service puts in front of its routes (`guard`): the key checked on the headers before
anything is read, and bodies bounded while they are read, declared or chunked."""

from __future__ import annotations

import json
import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class BodyTooLarge(Exception):
    pass


KEY_MISSING = ("missing or wrong API key: send 'Authorization: Bearer KEY' (or 'X-API-Key: KEY', as Tinker's SDK "
               "does, where TINKER_API_KEY=tml-KEY) with the key in the service's --api-key-file")
OPEN_PATHS = ("/health",)  # the only route answered without the key
HEADER_TIMEOUT_S = 10.0  # a connection's request headers must be complete this long after it opens or a request
# begins (a client that sends them slowly, or never, is closed: it would hold a connection, and a descriptor)
MAX_HEADERS = 100  # header fields of one request (431 beyond, as they arrive)
MAX_HEADER_BYTES = 64 * 2**10  # bytes of one request's header names and values together (431 beyond)
BODY_IDLE_TIMEOUT_S = 10.0  # once the headers are in, a body that sends nothing for this long is closed as well


@dataclass(frozen=True)
class Caller:
    """Who sends a request: which of the service's keys it carries (0 with one key, or none), and the session it
    names in its ``X-Heterorl-Session`` header (an id or a name; "": none). `Service.sampler` resolves "latest"
    for it."""

    key: int = 0
    session: str = ""


CALLER: ContextVar[Caller] = ContextVar("heterorl_caller", default=Caller())  # noqa: B039 (frozen); set by `Guard`
SESSION_HEADER = "x-heterorl-session"


def key_list(api_key: str | Sequence[str] | None) -> list[str] | None:
    """The service's keys: one (a string), several (one per user: each user's sessions are its own), or None."""
    if api_key is None:
        return None
    return [api_key] if isinstance(api_key, str) else list(api_key)


def matching_key(authorization: str | None, api_keys: Sequence[str], x_api_key: str | None = None) -> int | None:
    """The index of the key in ``api_keys`` the request carries (each compared in constant time), or None."""
    found = None
    for index, key in enumerate(api_keys):
        if key_matches(authorization, key, x_api_key) and found is None:
            found = index
    return found


def key_matches(authorization: str | None, api_key: str, x_api_key: str | None = None) -> bool:
    """The request carries the key: ``Authorization: Bearer KEY``, or ``X-API-Key: KEY`` or ``X-API-Key: tml-KEY``
    (Tinker's SDK sends its key so, and takes only keys that start with ``tml-``)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode()):
        return True
    given = (x_api_key or "").encode()
    return bool(given) and (secrets.compare_digest(given, api_key.encode())
                            or secrets.compare_digest(given, b"tml-" + api_key.encode()))


async def read_body(request, limit: int) -> bytes:
    """A route's whole request body, `BodyTooLarge` as soon as it passes ``limit`` bytes (the rest is never read)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"the body exceeds this service's limit of {limit:,} bytes (--max-body-mb)")
    return bytes(body)


async def parse_body(request, model, limit: int):
    """A route's body (JSON, or msgpack by its content type) read within ``limit`` bytes (`read_body`) and
    validated against the pydantic ``model`` off the event loop: a large body is decoded in a thread while other
    requests (``/health``) are answered. `RequestValidationError` naming the field otherwise: an array or map of
    more than `bounds.MAX_BODY_ELEMENTS` entries, a nest deeper than the decoder takes, a field's error."""
    from fastapi.concurrency import run_in_threadpool

    body = await read_body(request, limit)
    return await run_in_threadpool(_validated, body, request.headers.get("content-type"), model)


def _validated(body: bytes, content_type: str | None, model):
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from heterorl.service import wire
    from heterorl.service.bounds import MAX_BODY_ELEMENTS

    try:
        data = wire.unpack(body, content_type, MAX_BODY_ELEMENTS)
    except Exception as exc:  # not JSON / msgpack at all, or an array or map past the bound
        raise RequestValidationError([{"loc": ("body",), "msg": f"cannot be decoded: {str(exc)[:300]}",
                                       "type": "decode"}]) from None
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    except RecursionError:
        raise RequestValidationError([{"loc": ("body",), "msg": "nested too deeply", "type": "depth"}]) from None


class Guard:
    """ASGI middleware that bounds a request before any route reads it: the key is checked on the headers
    (401 before one byte of the body is read), a declared body over ``max_body_bytes`` is refused (413), and a
    body sent without a length (chunked) is read here and refused (413) as soon as it passes ``max_body_bytes``.
    Only /health is answered without the key."""

    def __init__(self, app, api_keys: Sequence[str] | None, max_body_bytes: int) -> None:
        self.app, self.api_keys, self.max_body_bytes = app, api_keys, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = 0
        if self.api_keys is not None and scope["path"] not in OPEN_PATHS:
            key = matching_key(headers.get("authorization"), self.api_keys, headers.get("x-api-key"))
            if key is None:
                return await _refuse(send, 401, KEY_MISSING, {"www-authenticate": "Bearer"})
        CALLER.set(Caller(key or 0, headers.get(SESSION_HEADER, "")[:100]))  # (the routes run in this context)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _refuse(send, 413, f"the body of {int(length):,} bytes exceeds this service's limit of "
                                            f"{self.max_body_bytes:,} (--max-body-mb)")
        if not length.isdigit() and headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_bounded(receive)  # (no length declared: read it here, up to the limit)
            if body is None:
                return await _refuse(send, 413, f"the body exceeds this service's limit of {self.max_body_bytes:,} "
                                                "bytes (--max-body-mb)")
            receive = _replay(body, receive)
        read = 0

        async def bounded_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body_bytes:
                    raise BodyTooLarge(f"the body exceeds this service's limit of {self.max_body_bytes:,} bytes "
                                       "(--max-body-mb)")
            return message

        return await self.app(scope, bounded_receive, send)

    async def _read_bounded(self, receive) -> bytes | None:
        """The whole body, or None as soon as it passes ``max_body_bytes`` (the rest is never read)."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return bytes(body)
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive):
    """A receive that gives ``body`` once, then what ``receive`` gives (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _refuse(send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps({"detail": message}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout_s: float = HEADER_TIMEOUT_S, body_idle_s: float = BODY_IDLE_TIMEOUT_S):
    """uvicorn's HTTP protocol (httptools) that closes a connection whose request headers are not complete within
    ``timeout_s`` of the connection opening or the request beginning, or whose body then sends nothing for
    ``body_idle_s`` (while the server waits for it: not while the server itself has paused reading). Pass it as
    ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _timer = None
        _fields = _field_bytes = 0
        _too_large = ""  # why the request's headers were refused (`on_header`), for `send_400_response`

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(timeout_s)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._fields = self._field_bytes = 0
            self._arm(timeout_s)

        def on_header(self, name: bytes, value: bytes) -> None:
            """A header field, counted: past `MAX_HEADERS` fields or `MAX_HEADER_BYTES` bytes the request is
            refused (431) as the parser meets it, before the rest is kept (10,000 headers, or one of 1 MB, were
            taken)."""
            self._fields, self._field_bytes = self._fields + 1, self._field_bytes + len(name) + len(value)
            if self._fields > MAX_HEADERS or self._field_bytes > MAX_HEADER_BYTES:
                self._too_large = (f"the request's headers pass this service's limit of {MAX_HEADERS} fields and "
                                   f"{MAX_HEADER_BYTES:,} bytes")
                raise ValueError(self._too_large)  # (the parser stops, and uvicorn answers: `send_400_response`)
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            if not self._too_large:
                return super().send_400_response(msg)
            body = self._too_large.encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                                 b"charset=utf-8\r\ncontent-length: " + str(len(body)).encode() +
                                 b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_idle_s)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._arm(body_idle_s)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._too_slow, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self, seconds: float) -> None:
            self._timer = None
            if self.flow is not None and self.flow.read_paused:  # (the server is the one not reading: wait on)
                self._arm(seconds)
            elif not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def guard(app: FastAPI, api_key: str | Sequence[str] | None, max_body_bytes: int) -> None:
    """Put `Guard` in front of ``app``'s routes (``api_key``: one key, several, or None), and answer a body that
    grew past the limit while a route read it with a 413."""
    app.add_middleware(Guard, api_keys=key_list(api_key), max_body_bytes=max_body_bytes)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge):
        return JSONResponse({"detail": str(exc)}, status_code=413)


__all__ = ["BODY_IDLE_TIMEOUT_S", "BodyTooLarge", "CALLER", "Caller", "Guard", "HEADER_TIMEOUT_S", "KEY_MISSING",
           "OPEN_PATHS", "SESSION_HEADER", "guard", "header_timeout_protocol", "key_list", "key_matches",
           "matching_key", "read_body"]
