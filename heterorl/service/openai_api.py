"""An OpenAI-compatible HTTP API over sampling clients: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

    app.include_router(openai_router(lambda: {"latest": sampler}))

``models()`` is asked on every request which model ids are served, each by a `SamplingClient`; an agent harness
written for the OpenAI API (the ``openai`` package, any client of vLLM's server) then generates with heterorl's
own policy: the same engine, sampling and behaviour log-probs that rollouts use. docs/SERVICE.md lists the
parameters, limits and what each field holds.

Streaming: the engines generate a whole batch at once, so ``stream: true`` answers with the server-sent events of
a stream (one chunk per token, then ``data: [DONE]``) after the whole completion has been generated; the text the
chunks carry is the text the same request would get without ``stream``.

Errors are OpenAI error bodies, ``{"error": {"message", "type", "param", "code"}}``: an unknown model is a 404
listing the served ids, a body that does not validate a 422 naming the field, a request the model cannot serve
(no chat template, past its context, a parameter not supported) a 400 saying why.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator

from heterorl.engines.base import STOP_LENGTH, SampleOutput, SamplingParams
from heterorl.errors import SamplingError
from heterorl.training.session import SamplingClient
from heterorl.training.textcodec import encode_prompt

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
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a log-prob below this is reported as this
DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before a completion's first token (a leading space depends on them)

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

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"give a non-empty string or a list of at most {MAX_STOP} of them")
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
            shown = repr(error.get("input"))
            got = "" if error["type"] == "missing" else f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
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

        return answer


# -- from a request to sampling ------------------------------------------------------------------------------------
def _client(models: Models, model_id: str) -> SamplingClient:
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


async def _sample(client: SamplingClient, model_id: str, prompts: list[list[int]], n: int,
                  params: SamplingParams) -> tuple[list[list[SampleOutput]], int | None]:
    """Each prompt's ``n`` samples, awaited without holding the event loop (the client's own thread samples), and
    the policy version that drew them: the version the client held both when the request was queued and when it
    finished (versions only grow), None when a new one was loaded meanwhile."""
    _check_size(len(prompts), n, params.max_tokens)
    version = client.version
    try:
        future = client.sample(prompts, n, params)
    except RuntimeError as exc:  # the client's thread was shut down: the model was closed after it was looked up
        raise RequestRefused(404, f"model {model_id!r} was closed while this request was served ({exc}); list the "
                             "served models again (GET /v1/models)", "model", "model_not_found") from None
    groups = await asyncio.wrap_future(future)
    return groups, (version if client.version == version else None)


# -- from samples to answers ---------------------------------------------------------------------------------------
@dataclass
class _Choice:
    """One completion as answered: ``text`` cut before the first stop string, ``tokens`` through the token that
    ended it (the end-of-sequence token, or the one that completed the stop string), with their log-probs,
    their own texts (special tokens shown), where each one's text starts in the completion before the stop string
    was cut, and each one's part of ``text`` (the stream's chunks; they concatenate to ``text``)."""

    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    token_texts: list[str]
    text_offsets: list[int]
    shares: list[str]


def _token_pieces(tokenizer, context: list[int], tokens: list[int]) -> list[str]:
    """Each token's piece of the decoded completion (special tokens skipped), decoded incrementally as vLLM
    does: a token is decoded after the few before it, so that text that depends on its neighbours (a leading
    space, a character split over byte tokens) comes out as the whole sequence's decode has it; a token that ends
    inside a character adds nothing until the one that completes it."""
    ids = [*context, *tokens]
    prefix, read = 0, len(context)
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
    pieces = []
    for end in range(len(context) + 1, len(ids) + 1):
        after = tokenizer.decode(ids[prefix:end], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, end
            before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        else:
            pieces.append("")
    return pieces


def _finish(tokenizer, prompt: list[int], sample: SampleOutput, stops: list[str], token_ids: bool) -> _Choice:
    """The answer for ``sample``: cut at the stop string completed first (the one a check after each token finds
    first), finish_reason "stop" for a stop string, an end-of-sequence or stop token, "length" otherwise."""
    pieces = _token_pieces(tokenizer, prompt[-DETOKENIZE_CONTEXT:], sample.tokens)
    full = "".join(pieces)
    ends = list(itertools.accumulate(map(len, pieces)))
    found = [(full.index(stop) + len(stop), full.index(stop)) for stop in stops if stop in full]
    if found:
        stop_end, cut = min(found)
        kept = next(i for i, end in enumerate(ends) if end >= stop_end) + 1
        text, reason = full[:cut], "stop"
    else:
        kept, text = len(pieces), full
        reason = "length" if sample.stop_reason == STOP_LENGTH else "stop"
    starts = [end - len(piece) for end, piece in zip(ends, pieces)][:kept]
    tokens = sample.tokens[:kept]
    texts = ([f"token_id:{t}" for t in tokens] if token_ids else
             [tokenizer.decode([t], skip_special_tokens=False) for t in tokens])
    return _Choice(text=text, finish_reason=reason, tokens=tokens,
                   logprobs=[max(float(lp), LOGPROB_FLOOR) for lp in sample.logprobs[:kept]], token_texts=texts,
                   text_offsets=starts, shares=[text[min(s, len(text)):min(e, len(text))]
                                                for s, e in zip(starts, ends[:kept])])


def _finish_all(tokenizer, prompts, groups, stops: list[str], token_ids: bool) -> list[_Choice]:
    return [_finish(tokenizer, prompt, sample, stops, token_ids) for prompt, group in zip(prompts, groups)
            for sample in group]


def _completion_logprobs(choice: _Choice, k: int, positions: slice = slice(None)) -> dict:
    """OpenAI completions' logprobs of the tokens at ``positions``; top_logprobs holds the sampled token alone
    (the engine reports no alternatives), or is null for k = 0."""
    tokens, logprobs = choice.token_texts[positions], choice.logprobs[positions]
    return {"tokens": tokens, "token_logprobs": logprobs, "text_offset": choice.text_offsets[positions],
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)] if k > 0 else None}


def _chat_logprobs(choice: _Choice, k: int, positions: slice = slice(None)) -> dict:
    """OpenAI chat logprobs of the tokens at ``positions``; top_logprobs holds the sampled token alone when
    k > 0, else nothing."""
    content = []
    for token, logprob in zip(choice.token_texts[positions], choice.logprobs[positions]):
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        content.append(entry | {"top_logprobs": [dict(entry)] if k > 0 else []})
    return {"content": content, "refusal": None}


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> dict:
    prompt_tokens, completion_tokens = sum(map(len, prompts)), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _stream(head: dict, choices: list[_Choice], chunk: Callable[[_Choice, int], dict],
            finish: Callable[[_Choice], dict], usage: dict, body: _SamplingBody) -> StreamingResponse:
    """Server-sent events: per choice, a chunk per token (``chunk(choice, i)``) and one with its finish_reason;
    then, with stream_options.include_usage, a chunk with no choices and the usage; then [DONE]."""
    if not (body.stream_options and body.stream_options.include_usage):
        usage = None
    extra = {} if usage is None else {"usage": None}

    def events():
        for index, choice in enumerate(choices):
            for i in range(len(choice.tokens)):
                yield _event(head | extra | {"choices": [{"index": index} | chunk(choice, i)]})
            yield _event(head | extra | {"choices": [{"index": index} | finish(choice)]})
        if usage is not None:
            yield _event(head | {"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _generate(client: SamplingClient, body: _SamplingBody, prompts: list[list[int]], max_tokens: int | None,
                    prompt_field: str, id_prefix: str) -> tuple[dict, list[_Choice], dict]:
    """Sample ``body.n`` completions of each prompt and finish them: the answer's head (id, created, model,
    system_fingerprint), its choices (prompt-major) and its usage."""
    max_tokens = _max_tokens(client, body.model, prompts, max_tokens, prompt_field)
    groups, version = await _sample(client, body.model, prompts, body.n or 1,
                                    _sampling_params(body, client.tokenizer, max_tokens))
    choices = await asyncio.to_thread(_finish_all, client.tokenizer, prompts, groups, body.stop,
                                      bool(body.return_tokens_as_token_ids))
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model,
            "system_fingerprint": None if version is None else f"heterorl-v{version}"}
    return head, choices, _usage(prompts, choices)


# -- the router ----------------------------------------------------------------------------------------------------
def openai_router(models: Models, *, owned_by: str = "heterorl") -> APIRouter:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` over the sampling clients ``models()``
    names (asked on every request). Refusals are OpenAI error bodies whatever app includes the router."""
    router = APIRouter(route_class=_OpenAIRoute)
    first_listed: dict[str, int] = {}  # a model id's "created": when this router first served it

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
        _client(models, model_id)
        return next(entry for entry in listed() if entry["id"] == model_id)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        client = _client(models, body.model)
        _refuse_unsupported(body)
        count = 1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
        _check_size(count, body.n or 1, body.max_tokens or COMPLETION_MAX_TOKENS)  # (before tokenizing)
        prompts = await asyncio.to_thread(_completion_prompts, client.tokenizer, body.prompt)
        head, choices, usage = await _generate(client, body, prompts, body.max_tokens or COMPLETION_MAX_TOKENS,
                                               "prompt", "cmpl")
        head, k = head | {"object": "text_completion"}, body.logprobs
        if body.stream:
            return _stream(head, choices, lambda c, i: {
                "text": c.shares[i], "finish_reason": None,
                "logprobs": None if k is None else _completion_logprobs(c, k, slice(i, i + 1))},
                lambda c: {"text": "", "finish_reason": c.finish_reason, "logprobs": None}, usage, body)
        return head | {"usage": usage, "choices": [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": None if k is None else _completion_logprobs(c, k)} for i, c in enumerate(choices)]}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        client = _client(models, body.model)
        _refuse_unsupported(body)
        _check_size(1, body.n or 1, body.max_completion_tokens or body.max_tokens)  # (before rendering)
        prompts = [await asyncio.to_thread(_chat_prompt, client.tokenizer, body.messages, body.model)]
        head, choices, usage = await _generate(client, body, prompts, body.max_completion_tokens or body.max_tokens,
                                               "messages", "chatcmpl")
        k = body.top_logprobs or 0
        if body.stream:
            def chunk(c: _Choice, i: int) -> dict:
                delta = {"content": c.shares[i]} | ({"role": "assistant"} if i == 0 else {})
                return {"delta": delta, "finish_reason": None,
                        "logprobs": _chat_logprobs(c, k, slice(i, i + 1)) if body.logprobs else None}

            return _stream(head | {"object": "chat.completion.chunk"}, choices, chunk,
                           lambda c: {"delta": {}, "finish_reason": c.finish_reason, "logprobs": None}, usage, body)
        return head | {"object": "chat.completion", "usage": usage, "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
             "finish_reason": c.finish_reason, "logprobs": _chat_logprobs(c, k) if body.logprobs else None}
            for i, c in enumerate(choices)]}

    return router


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
