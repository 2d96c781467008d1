"""An OpenAI-compatible HTTP API over sampling clients: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

    app.include_router(openai_router(lambda: {"latest": sampler}))

``models()`` is asked on every request which model ids are served, each by a `SamplingClient`; an agent harness
written for the OpenAI API (the ``openai`` package, any client of vLLM's server) then generates with heterorl's
own policy: the same engine, sampling and behaviour log-probs that rollouts use. docs/SERVICE.md lists the
parameters, limits and what each field holds.

Streaming: ``stream: true`` answers with server-sent events as the engine draws the tokens (a chunk per token
once no stop string can still change its text, then ``data: [DONE]``); the text the chunks carry is the text the
same request gets without ``stream``. Concurrent requests to one model share an engine call where they can, and a
client that goes away cancels its generation between decode steps (`heterorl.service.openai_generation`).

Errors are OpenAI error bodies, ``{"error": {"message", "type", "param", "code"}}``: an unknown model is a 404
listing the served ids, a body that does not validate a 422 naming the field, a request the model cannot serve
(no chat template, past its context, a parameter not supported) a 400 saying why.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator

from heterorl.engines.base import SampleOutput, SamplingParams, validate_request
from heterorl.errors import SamplingError
from heterorl.rollout.textcodec import encode_prompt
from heterorl.service.bounds import check_stops, excerpt
from heterorl.service.guard import parse_body
from heterorl.service.openai_generation import Choice, Generation, RequestBatcher, finish_all
from heterorl.training.session import SamplingClient

MAX_N = 128  # completions per prompt
MAX_CHOICES = 1024  # prompts x n in one request
MAX_TOKENS = 4096  # tokens per completion (also the chat default, within the model's context)
MAX_LOGPROBS = 20  # completions' logprobs / chat's top_logprobs
MAX_STOP = 4  # stop strings
MAX_PROMPT_CHARS = 256 * 1024  # characters of prompt text (or chat messages) in one request, before tokenizing
MAX_PROMPT_IDS = 1 << 18  # token ids given as prompts in one request
MAX_MESSAGES = 1024  # chat messages in one request
MAX_REQUEST_TOKENS = 1 << 18  # prompts x n x max_tokens: what one request may generate
MAX_BODY_BYTES = 16 * 2**20  # a body the endpoint reads at most (`openai_app`; `heterorl serve` has --max-body-mb)
MAX_BODY_BYTES_READ = 2**31  # (a route's own read: the app's guard has bounded the body already)
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's

Models = Callable[[], dict[str, SamplingClient]]


# -- request bodies ------------------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a parameter this server does not take is named, never ignored


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """What both generation routes take; a field left out or null takes its default."""

    model: str
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 keeps every token
    stop: Any = Field(None, validate_default=True)  # a string or a list of strings: `_stop_strings`
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the caller's end-user id, for its own logs: it changes nothing here
    return_tokens_as_token_ids: bool | None = None  # vLLM's extension: logprobs' tokens as "token_id:ID"
    ignore_eos: bool | None = None  # vLLM's extension: generate max_tokens tokens whatever the model samples

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"give a non-empty string or a list of at most {MAX_STOP} of them")
        check_stops("stop", stops, max_strings=MAX_STOP)  # (a BadRequest is a ValueError: the field is named)
        return stops


class CompletionRequest(_SamplingBody):
    prompt: Any  # `_prompt_form`
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_form(cls, value):
        def ids(v) -> bool:
            return isinstance(v, list) and all(type(t) is int for t in v)

        if not (isinstance(value, str) or (isinstance(value, list) and value and (
                ids(value) or all(isinstance(v, str) for v in value) or all(ids(v) for v in value)))):
            raise ValueError("give a string, a list of strings, a list of token ids or a list of lists of token ids")
        texts = [value] if isinstance(value, str) else value if isinstance(value[0], str) else []
        if sum(len(t) for t in texts) > MAX_PROMPT_CHARS:  # (checked before anything is tokenized)
            raise ValueError(f"{sum(len(t) for t in texts):,} characters of prompt text; this server takes at "
                             f"most {MAX_PROMPT_CHARS:,} per request")
        lists = [] if texts else [value] if isinstance(value[0], int) else value
        if len(texts or lists) > MAX_CHOICES or sum(len(ids) for ids in lists) > MAX_PROMPT_IDS:
            raise ValueError(f"at most {MAX_CHOICES} prompts and {MAX_PROMPT_IDS:,} prompt token ids per request")
        return value


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any  # `_text`
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value) -> str:
        """The message's text: a string, or text parts joined by newlines (as vLLM joins them)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                           and isinstance(part.get("text"), str) for part in value):
            return "\n".join(part["text"] for part in value)
        raise ValueError('give a string or a list of text parts ({"type": "text", "text": "..."}); other parts '
                         "(images, audio) are not supported")


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _bounded(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        chars = sum(len(m.content) for m in value)
        if chars > MAX_PROMPT_CHARS:  # (checked before the chat template renders or anything is tokenized)
            raise ValueError(f"{chars:,} characters of message text; this server takes at most "
                             f"{MAX_PROMPT_CHARS:,} per request")
        return value


# -- errors --------------------------------------------------------------------------------------------------------
class RequestRefused(Exception):
    """A request this server cannot serve: answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        return _error(self.status, str(self), self.param, self.code)


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _validation_error(errors: list[dict]) -> JSONResponse:
    """A 400 (as OpenAI's API answers, and so the `openai` client's ``BadRequestError``) naming each field that did
    not validate (the first three) and what it got."""
    parts, fields = [], []
    for error in errors[:3]:
        field = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
        if error["type"] == "extra_forbidden":
            message = "not a parameter this server takes (docs/SERVICE.md lists those it does)"
        elif error["type"] == "json_invalid":
            field, message = "body", f"not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})"
        else:
            got = "" if error["type"] == "missing" else f" (got {excerpt(error.get('input'), 80)})"
            message = error["msg"].removeprefix("Value error, ") + got
        parts.append(f"{field}: {message}")
        fields.append(field)
    more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
    return _error(400, "; ".join(parts) + more, fields[0] if fields else None, "invalid_value")


class _OpenAIRoute(APIRoute):
    """Answers what a route refuses as an OpenAI error body, whichever app includes the router: a body that does
    not validate (422), a `RequestRefused`, a `SamplingError` from the prompt's encoding or the engine (400)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def answer(request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _validation_error(list(exc.errors()))
            except RequestRefused as exc:
                return exc.response()
            except SamplingError as exc:
                return _error(400, str(exc))
            except _ClientGone:  # (nobody reads this answer)
                return _error(499, "the client closed the connection before the answer was ready")

        return answer


# -- from a request to sampling ------------------------------------------------------------------------------------
def _client(models: Models, model_id: str, lookup: Callable[[str], SamplingClient] | None = None) -> SamplingClient:
    """The client serving ``model_id``: ``lookup(model_id)`` when given (it raises `RequestRefused` saying why it
    serves none), else ``models()[model_id]``."""
    if lookup is not None:
        return lookup(model_id)
    served = models()
    if model_id not in served:
        listed = ", ".join(sorted(served)) or "none yet"
        raise RequestRefused(404, f"model {model_id!r} is not served here; served: {listed} (GET /v1/models)",
                             "model", "model_not_found")
    return served[model_id]


def _refuse_unsupported(body: _SamplingBody) -> None:
    """400 for a parameter this server takes only at its neutral value: it would otherwise be ignored silently."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise RequestRefused(400, f"{name}={getattr(body, name)}: penalties are not supported; leave it out "
                                 "or give 0", name)
    if body.logit_bias:
        raise RequestRefused(400, "logit_bias is not supported; leave it out", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise RequestRefused(400, "stream_options needs stream: true", "stream_options")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise RequestRefused(400, "echo=true is not supported (the prompt's log-probs are not computed); "
                                 "leave echo out or give false", "echo")
        if body.suffix:
            raise RequestRefused(400, "suffix is not supported (no fill-in-the-middle); leave it out", "suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise RequestRefused(400, f"best_of={body.best_of}: only best_of equal to n ({body.n or 1}) is "
                                 "supported (every completion generated is returned)", "best_of")
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestRefused(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise RequestRefused(400, f"max_tokens={body.max_tokens} and max_completion_tokens="
                                 f"{body.max_completion_tokens} disagree: give one of them", "max_completion_tokens")


def _completion_prompts(tokenizer, prompt) -> list[list[int]]:
    """The token ids of each prompt: text is encoded as rollouts encode it (`encode_prompt`), ids pass as given."""
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [encode_prompt(tokenizer, text) for text in prompt]
    return [list(ids) for ids in prompt]


def _chat_prompt(tokenizer, messages: list[ChatMessage], model_id: str) -> list[int]:
    """The messages rendered by the tokenizer's chat template with the assistant's turn opened, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestRefused(400, f"model {model_id!r} has no chat template (its tokenizer's chat_template is "
                             "unset): use /v1/completions with a prompt, or serve a tokenizer that has a chat "
                             "template", "messages", "no_chat_template")
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    conversation = [message.model_dump(exclude_none=True) for message in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError) as exc:
        raise RequestRefused(400, f"the chat template of model {model_id!r} cannot render these messages: {exc}",
                             "messages") from None
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


def _max_tokens(client: SamplingClient, model_id: str, prompts: list[list[int]], requested: int | None,
                prompt_field: str) -> int:
    """``requested``, checked against the model's context; None: the room the context leaves, up to MAX_TOKENS."""
    context = getattr(client.engine, "max_positions", None)
    longest = max(len(p) for p in prompts)
    if context is not None and longest >= context:
        raise RequestRefused(400, f"the prompt of {longest} tokens fills model {model_id!r}'s context of {context} "
                             "tokens: shorten it", prompt_field, "context_length_exceeded")
    if requested is None:
        return MAX_TOKENS if context is None else min(MAX_TOKENS, context - longest)
    if context is not None and longest + requested > context:
        raise RequestRefused(400, f"the prompt ({longest} tokens) + max_tokens ({requested}) exceed model "
                             f"{model_id!r}'s context of {context} tokens: give max_tokens <= {context - longest}",
                             "max_tokens", "context_length_exceeded")
    return requested


def _sampling_params(body: _SamplingBody, tokenizer, max_tokens: int) -> SamplingParams:
    """The engine's parameters. A stop string that is one token also stops the engine when it is sampled; others
    are found in the text afterwards (`_finish`)."""
    stop_ids = []
    for stop in body.stop:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == stop:
            stop_ids.append(ids[0])
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
        ignore_eos=bool(body.ignore_eos),
        stop_token_ids=tuple(stop_ids), seed=body.seed)


def _check_size(prompts: int, n: int, max_tokens: int | None) -> None:
    """A 400 for a request that asks more completions, or more tokens, than one request may generate."""
    if prompts * n > MAX_CHOICES:
        raise RequestRefused(400, f"{prompts} prompts x n={n} = {prompts * n} completions: this server returns at "
                             f"most {MAX_CHOICES} per request; send fewer prompts or a lower n", "n")
    if max_tokens is not None and prompts * n * max_tokens > MAX_REQUEST_TOKENS:
        raise RequestRefused(400, f"{prompts} prompts x n={n} x max_tokens={max_tokens} = {prompts * n * max_tokens:,}"
                             f" tokens: one request generates at most {MAX_REQUEST_TOKENS:,} here; lower max_tokens "
                             "or n, or split the request", "max_tokens")


def _prompts_fit(client: SamplingClient, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
    """Refuse (400) what the engine would refuse, before a stream's first byte: ids outside the vocabulary."""
    engine = client.engine
    vocab = getattr(engine, "vocab_size", None)
    if vocab is not None:
        validate_request(prompts, params, n, vocab, getattr(engine, "max_positions", None))


# -- from samples to answers ---------------------------------------------------------------------------------------
def _completion_logprobs(choice: Choice, k: int, positions: slice = slice(None)) -> dict:
    """OpenAI completions' logprobs of the tokens at ``positions``; top_logprobs holds the sampled token alone
    (the engine reports no alternatives), or is null for k = 0."""
    tokens, logprobs = choice.token_texts[positions], choice.logprobs[positions]
    return {"tokens": tokens, "token_logprobs": logprobs, "text_offset": choice.text_offsets[positions],
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if k > 0 else None}


def _chat_logprobs(choice: Choice, k: int, positions: slice = slice(None)) -> dict:
    """OpenAI chat logprobs of the tokens at ``positions``; top_logprobs holds the sampled token alone when
    k > 0, else nothing."""
    content = []
    for token, logprob in zip(choice.token_texts[positions], choice.logprobs[positions]):
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        content.append(entry | {"top_logprobs": [dict(entry)] if k > 0 else []})
    return {"content": content, "refusal": None}


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    prompt_tokens, completion_tokens = sum(map(len, prompts)), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _stream(generation: Generation, head: Callable[[], dict], chunk: Callable[[Choice, int], dict],
            finish: Callable[[Choice], dict], include_usage: bool) -> StreamingResponse:
    """Server-sent events as the tokens are drawn: per choice, a chunk per token once it is settled
    (``chunk(choice, i)``) and one with its finish_reason, choices interleaved; then, with ``include_usage``, a
    chunk with no choices and the usage; then [DONE]. An engine error after the first byte is an error event.
    A client that goes away cancels the generation (between decode steps)."""
    extra = {"usage": None} if include_usage else {}

    async def events():
        top = None
        try:
            async for index, i in generation.events():
                top = top or head()
                choice = generation.builders[index].choice
                part = finish(choice) if i is None else chunk(choice, i)
                yield _event(top | extra | {"choices": [{"index": index} | part]})
            if include_usage:
                yield _event((top or head()) | {"choices": [], "usage": _usage(
                    generation.prompts, [b.choice for b in generation.builders])})
        except SamplingError as exc:
            yield _event({"error": {"message": str(exc), "type": "invalid_request_error", "param": None,
                                    "code": None}})
        finally:
            generation.cancel()  # (a no-op once it is done; else the client went away)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


class _ClientGone(Exception):
    """The client of a request went away before its answer was ready."""


async def _unless_gone(request: Request, generation: Generation) -> list[list[SampleOutput]]:
    """The generation's samples; if the client disconnects first, the generation is cancelled (`_ClientGone`)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone, done = asyncio.ensure_future(disconnected()), asyncio.ensure_future(generation.result())
    await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
    if done.done():
        gone.cancel()
        return done.result()
    generation.cancel()
    done.cancel()
    raise _ClientGone


def _head(model: str, id_prefix: str, version: int | None) -> dict:
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
            "system_fingerprint": None if version is None else f"heterorl-v{version}"}


# -- the router ----------------------------------------------------------------------------------------------------
def openai_router(models: Models, *, owned_by: str = "heterorl", batching: bool = True,
                  lookup: Callable[[str], SamplingClient] | None = None) -> APIRouter:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` over the sampling clients ``models()``
    names (asked on every request). Refusals are OpenAI error bodies whatever app includes the router.
    ``batching``: concurrent requests to one model that can share an engine call share it (`RequestBatcher`).
    ``lookup``: finds a request's model instead of ``models()`` (`heterorl serve`'s: a use of it, for the memory
    budget's eviction, and why an id is not served)."""
    router = APIRouter(route_class=_OpenAIRoute)

    def find(model_id: str) -> SamplingClient:
        return _client(models, model_id, lookup)

    batchers = _Batchers(batching)
    _model_routes(router, models, find, owned_by)
    _completion_routes(router, find, batchers)
    _chat_routes(router, find, batchers)
    return router


class _Batchers:
    """A `RequestBatcher` per sampling client, made on its first request, which starts each request's generation
    (``batching``: in one engine call with the other requests that can share it)."""

    def __init__(self, batching: bool) -> None:
        self.batching = batching
        self._of: weakref.WeakKeyDictionary[SamplingClient, RequestBatcher] = weakref.WeakKeyDictionary()

    def start(self, client: SamplingClient, body: _SamplingBody, prompts: list[list[int]], max_tokens: int | None,
              prompt_field: str) -> Generation:
        """Start ``body.n`` completions of each prompt (in a batch with other requests where they can share it)."""
        max_tokens = _max_tokens(client, body.model, prompts, max_tokens, prompt_field)
        n = body.n or 1
        _check_size(len(prompts), n, max_tokens)
        params = _sampling_params(body, client.tokenizer, max_tokens)
        _prompts_fit(client, prompts, params, n)
        generation = Generation(prompts, n, params, tokenizer=client.tokenizer, stops=body.stop,
                                token_ids=bool(body.return_tokens_as_token_ids), stream=bool(body.stream))
        batcher = self._of.get(client)
        if batcher is None:
            batcher = self._of[client] = RequestBatcher(client, batching=self.batching, on_closed=_closed(body.model))
        batcher.submit(generation)
        return generation


def _closed(model_id: str):
    return lambda exc: RequestRefused(404, f"model {model_id!r} was closed while this request was served "
                                      f"({exc}); list the served models again (GET /v1/models)", "model",
                                      "model_not_found")


async def _answer(request: Request, generation: Generation, body: _SamplingBody) -> tuple[list[Choice], dict]:
    """The finished choices (prompt-major) and usage of a request that is not streamed."""
    groups = await _unless_gone(request, generation)
    choices = await asyncio.to_thread(finish_all, generation.tokenizer, generation.prompts, groups, body.stop,
                                      bool(body.return_tokens_as_token_ids))
    return choices, _usage(generation.prompts, choices)


def _model_routes(router: APIRouter, models: Models, find: Callable[[str], SamplingClient], owned_by: str) -> None:
    """``/v1/models``: the ids served, each "created" when this router first served it."""
    first_listed: dict[str, int] = {}

    def listed() -> list[dict]:
        served, now = models(), int(time.time())
        for model_id in [m for m in first_listed if m not in served]:
            del first_listed[model_id]
        return [{"id": m, "object": "model", "created": first_listed.setdefault(m, now), "owned_by": owned_by}
                for m in sorted(served)]

    @router.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": listed()}

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        find(model_id)
        return next(entry for entry in listed() if entry["id"] == model_id)


def _completion_routes(router: APIRouter, find: Callable[[str], SamplingClient], batchers: _Batchers) -> None:
    """``/v1/completions``: prompts (text or token ids) completed."""
    @router.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, MAX_BODY_BYTES_READ)
        client = find(body.model)
        _refuse_unsupported(body)
        count = 1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
        _check_size(count, body.n or 1, body.max_tokens or COMPLETION_MAX_TOKENS)  # (before tokenizing)
        prompts = await asyncio.to_thread(_completion_prompts, client.tokenizer, body.prompt)
        generation = batchers.start(client, body, prompts, body.max_tokens or COMPLETION_MAX_TOKENS, "prompt")
        k, kind = body.logprobs, {"object": "text_completion"}
        if body.stream:
            return _stream(generation, lambda: _head(body.model, "cmpl", generation.version) | kind,
                           lambda c, i: {"text": c.shares[i], "finish_reason": None, "logprobs":
                                         None if k is None else _completion_logprobs(c, k, slice(i, i + 1))},
                           lambda c: {"text": "", "finish_reason": c.finish_reason, "logprobs": None},
                           _include_usage(body))
        choices, usage = await _answer(request, generation, body)
        return _head(body.model, "cmpl", generation.version) | kind | {"usage": usage, "choices": [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": None if k is None else _completion_logprobs(c, k)} for i, c in enumerate(choices)]}


def _chat_routes(router: APIRouter, find: Callable[[str], SamplingClient], batchers: _Batchers) -> None:
    """``/v1/chat/completions``: messages rendered by the model's chat template, the assistant's turn completed."""
    @router.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatRequest, MAX_BODY_BYTES_READ)
        client = find(body.model)
        _refuse_unsupported(body)
        _check_size(1, body.n or 1, body.max_completion_tokens or body.max_tokens)  # (before rendering)
        prompts = [await asyncio.to_thread(_chat_prompt, client.tokenizer, body.messages, body.model)]
        generation = batchers.start(client, body, prompts, body.max_completion_tokens or body.max_tokens,
                                    "messages")
        k = body.top_logprobs or 0
        if body.stream:
            def chunk(c: Choice, i: int) -> dict:
                delta = {"content": c.shares[i]} | ({"role": "assistant"} if i == 0 else {})
                return {"delta": delta, "finish_reason": None,
                        "logprobs": _chat_logprobs(c, k, slice(i, i + 1)) if body.logprobs else None}

            return _stream(generation, lambda: _head(body.model, "chatcmpl", generation.version) | {
                "object": "chat.completion.chunk"}, chunk,
                lambda c: {"delta": {}, "finish_reason": c.finish_reason, "logprobs": None}, _include_usage(body))
        choices, usage = await _answer(request, generation, body)
        return _head(body.model, "chatcmpl", generation.version) | {
            "object": "chat.completion", "usage": usage, "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
                 "finish_reason": c.finish_reason, "logprobs": _chat_logprobs(c, k) if body.logprobs else None}
                for i, c in enumerate(choices)]}


def _body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that validates its own (`parse_body`, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema(
        ref_template="#/components/schemas/{model}")}}}}


def _include_usage(body: _SamplingBody) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def openai_app(models: Models, *, owned_by: str = "heterorl", api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """An app that serves `openai_router` alone (a rollout worker's endpoint): bodies over ``max_body_bytes`` are
    refused before they are read, and with ``api_key`` every request needs it (`guard.Guard`)."""
    from heterorl.service.guard import guard

    app = FastAPI(title="heterorl OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    guard(app, api_key, max_body_bytes)
    app.include_router(openai_router(models, owned_by=owned_by))
    return app


__all__ = ["ChatRequest", "CompletionRequest", "RequestRefused", "openai_app", "openai_router"]
