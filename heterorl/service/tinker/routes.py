"""The Tinker REST API on `heterorl serve`, under ``/tinker``: point the SDK's ``base_url`` (or
``TINKER_BASE_URL``) at ``http://HOST:PORT/tinker`` and its ``ServiceClient``, training and sampling clients, futures
and ``RestClient`` run against this service (docs/SERVICE.md, "From Tinker", maps each call).

Every submit answers at once with a future (``{"request_id"}``); ``retrieve_future`` holds the request up to
`RETRIEVE_WAIT_S` for it, then answers 408 ``try_again`` (the SDK polls again). Results are JSON, except a
forward/forward_backward output and a sample, which are protobuf. A failed call is ``{"error", "category"}``
(``user`` for what the caller can fix). A request this service cannot honour is a 4xx naming the call and why; a
malformed body a 422. Bodies, sessions, calls and samples have the bounds of heterorl's own routes.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from heterorl.errors import HeteroRLError
from heterorl.runs import finite_or_null
from heterorl.service.calls import BadRequest, NotFound, TooBusy
from heterorl.service.guard import parse_body, read_body
from heterorl.service.memory import OverMemoryBudget
from heterorl.service.sessions import Service
from heterorl.service.tinker import book as tinker_book
from heterorl.service.tinker import protobuf
from heterorl.service.tinker.checkpoints import CheckpointStore
from heterorl.service.tinker.convert import ATTN, MLP
from heterorl.service.tinker.names import SessionFinished, TinkerNames

PREFIX = "/tinker"
RETRIEVE_WAIT_S = 30.0  # a retrieve_future waits this long for its call (the SDK's read timeout is 45 s)
PROTOBUF = "application/x-protobuf"
USER_ERRORS = ("BadRequest", "NotFound", "HeteroRLError", "LossInputError", "TinkerLossError", "SamplingError",
               "LoraError", "SessionFinished", "OverMemoryBudget", "TooBusy")
NOT_SERVED = {
    "auth/token": "JWT exchange (this service checks the API key itself)",
    "save_weights_external": "exporting weights to outside storage",
    "create_custom_loss": "server-side custom losses (forward_backward_custom needs none)",
    "copy_weights": "copying checkpoints between runs",
    "retrieve_futures": "batched future polling (this service tells the SDK to poll one future at a time)",
    "join_sampling_session": "joining another process's sampling session",
    "cancel_future": "cancelling a future",
    "audit": "audit logs", "billing": "billing", "auth/apikey": "API key management",
    "publish": "publishing checkpoints", "ttl": "checkpoint expiry", "external_weights_urls": "download URLs",
    "project": "projects", "trace_export": "trace export", "sessions/search": "session search",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSession(_Body):
    tags: list[str] = Field(default_factory=list, max_length=100)
    user_metadata: dict | None = None


class SessionRef(_Body):
    session_id: str = Field(max_length=100)


class CreateModel(_Body):
    session_id: str = Field(max_length=100)
    model_seq_id: int = Field(ge=0, lt=10**9)
    base_model: str = Field(min_length=1, max_length=1000)
    lora_config: dict | None = None
    user_metadata: dict | None = None


class ModelRef(_Body):
    model_id: str = Field(max_length=200)


class OptimStep(_Body):
    model_id: str = Field(max_length=200)
    seq_id: int
    adam_params: dict | None = None
    optimizer_params: dict | None = None


class SaveForSampler(_Body):
    model_id: str = Field(max_length=200)
    seq_id: int
    path: str | None = Field(default=None, max_length=200)
    sampling_session_seq_id: int | None = None


class SaveWeights(_Body):
    model_id: str = Field(max_length=200)
    seq_id: int
    path: str = Field(max_length=200)
    overwrite: bool = False


class LoadWeights(_Body):
    model_id: str | None = Field(default=None, max_length=200)
    seq_id: int | None = None
    session_id: str | None = Field(default=None, max_length=100)
    model_seq_id: int | None = Field(default=None, ge=0, lt=10**9)
    path: str = Field(max_length=500)
    optimizer: bool = False
    user_metadata: dict | None = None


class CreateSamplingSession(_Body):
    session_id: str = Field(max_length=100)
    sampling_session_seq_id: int = Field(ge=0)
    model_path: str | None = Field(default=None, max_length=500)
    base_model: str | None = Field(default=None, max_length=1000)


class Sample(_Body):
    sampling_session_id: str = Field(max_length=200)
    seq_id: int
    num_samples: int = Field(default=1, ge=1, le=10_000)
    prompt: dict
    sampling_params: dict = Field(default_factory=dict)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: dict | None = None
    prompt_logprobs_last_n: int | None = None


class RetrieveFuture(_Body):
    request_id: str = Field(max_length=200)
    allow_metadata_only: bool = False


class WeightsInfo(_Body):
    tinker_path: str = Field(max_length=500)


async def _json(request: Request, model: type[BaseModel], limit: int):
    """The body validated against ``model`` off the event loop (`parse_body`)."""
    return await parse_body(request, model, limit)


def _refused(call: str, exc: Exception) -> JSONResponse:
    """A call this service will not run as asked: 4xx naming the call and why (a body the SDK shows)."""
    status = 404 if isinstance(exc, NotFound) else 410 if isinstance(exc, SessionFinished) else \
        429 if isinstance(exc, TooBusy) else 507 if isinstance(exc, OverMemoryBudget) else 400
    return JSONResponse({"detail": f"{call}: {exc}", "call": call}, status_code=status)


async def _guarded(call: str, fn, *args):
    """``fn(*args)`` on the thread pool; a refusal (`HeteroRLError`, a bad protobuf) answered as `_refused`."""
    try:
        return await run_in_threadpool(fn, *args)
    except (HeteroRLError, protobuf.ProtobufError) as exc:
        return _refused(call, exc)


def _future(request_id):
    """A submit's answer: the future of its call (``{"request_id"}``), or the refusal."""
    return {"request_id": request_id} if isinstance(request_id, str) else request_id


def tinker_router(service: Service, limit: int) -> APIRouter:
    """The Tinker routes over ``service`` (`TinkerBook`); ``limit``: the body bound (--max-body-mb)."""
    book = tinker_book.TinkerBook(service)
    api = APIRouter(prefix=f"{PREFIX}/api/v1")
    _client_routes(api, service, limit)
    _session_routes(api, book.names, limit)
    _model_routes(api, book, limit)
    _weights_routes(api, book, limit)
    _sampling_routes(api, book, limit)
    _future_routes(api, service, limit)
    _checkpoint_routes(api, book.store, limit)
    _not_served_routes(api)  # (last: it answers every path the others do not)
    return api


def _client_routes(api: APIRouter, service: Service, limit: int) -> None:
    """The SDK's set-up: its config, telemetry, health and the models served."""
    @api.post("/client/config")
    async def client_config(request: Request) -> dict:
        await read_body(request, limit)
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "sample_join_sampling_session": False, "custom_loss_server_side": False,
                "fwdbwd_max_chunk_len": tinker_book.MAX_DATUMS,
                "fwdbwd_max_chunk_bytes_count": max(1, limit // 2)}

    @api.post("/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        await read_body(request, limit)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @api.post("/telemetry")
    async def telemetry(request: Request) -> dict:
        await read_body(request, limit)  # (read within the bound, and not kept)
        return {"status": "accepted"}

    @api.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @api.get("/get_server_capabilities")
    async def capabilities() -> dict:
        models = await run_in_threadpool(service.list_base_models)
        return {"supported_models": [{"model_name": m["name"], "trainable": True, "sampleable": True}
                                     for m in models]}


def _session_routes(api: APIRouter, names: TinkerNames, limit: int) -> None:
    """Sessions: created, kept alive, finished, listed."""
    @api.post("/create_session")
    async def create_session(request: Request):
        await _json(request, CreateSession, limit)
        result = await _guarded("create_session", names.create_session)
        return result if isinstance(result, Response) else {"session_id": result, "type": "create_session"}

    @api.post("/session_heartbeat")
    async def heartbeat(request: Request):
        body = await _json(request, SessionRef, limit)
        result = await _guarded("session_heartbeat", names.heartbeat, body.session_id)
        return result if isinstance(result, Response) else {"type": "session_heartbeat"}

    @api.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        await read_body(request, limit)
        result = await _guarded("finish", names.finish, session_id)
        return result if isinstance(result, Response) else {}

    @api.get("/sessions")
    def sessions(limit_: int = Query(default=100, alias="limit"), offset: int = Query(default=0, ge=0)) -> dict:
        return {"sessions": names.session_ids()[offset:offset + max(0, min(limit_, 1000))]}

    @api.get("/sessions/{session_id}")
    async def describe_session(session_id: str):
        try:
            found = names.session(session_id, open_only=False)
        except NotFound as exc:
            return _refused("get_session", exc)
        return {"training_run_ids": list(found.models), "sampler_ids": list(found.samplers)}


def _model_routes(api: APIRouter, book: tinker_book.TinkerBook, limit: int) -> None:
    """Models: created, described, trained (forward, forward_backward, optim_step)."""
    @api.post("/create_model")
    async def create_model(request: Request):
        body = await _json(request, CreateModel, limit)
        return _future(await _guarded("create_model", book.create_model, body.session_id, body.model_seq_id,
                                      body.base_model, body.lora_config, body.user_metadata))

    @api.post("/get_info")
    async def get_info(request: Request):
        body = await _json(request, ModelRef, limit)
        return await _guarded("get_info", book.info, body.model_id)

    @api.post("/forward_backward")
    async def forward_backward(request: Request):
        raw = await read_body(request, limit)
        if request.headers.get("content-encoding"):
            return JSONResponse({"detail": "forward_backward: compressed bodies are not taken (this service tells "
                                           "the SDK proto_compress_fwdbwd=false)"}, status_code=415)
        try:
            message = await run_in_threadpool(protobuf.read_forward_backward, raw, tinker_book.MAX_DATUMS)
        except protobuf.ProtobufError as exc:
            raise RequestValidationError([{"loc": ("body",), "msg": f"not a ForwardBackwardRequest: {exc}",
                                           "type": "protobuf"}]) from None
        call = "forward" if message.forward_only else "forward_backward"
        return _future(await _guarded(call, book.forward_backward, message))

    @api.post("/optim_step")
    async def optim_step(request: Request):
        body = await _json(request, OptimStep, limit)
        if body.adam_params is None:
            return _refused("optim_step", BadRequest(f"optimizer {(body.optimizer_params or {}).get('type')!r} is "
                                                     "not supported: heterorl steps with AdamW (AdamParams)"))
        return _future(await _guarded("optim_step", book.optim_step, body.model_id, body.seq_id, body.adam_params))


def _weights_routes(api: APIRouter, book: tinker_book.TinkerBook, limit: int) -> None:
    """A model's weights saved (for sampling, or with its optimizer) and loaded (into it, or into a new model)."""
    @api.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = await _json(request, SaveForSampler, limit)
        return _future(await _guarded("save_weights_for_sampler", book.save_for_sampler, body.model_id, body.seq_id,
                                      body.path, body.sampling_session_seq_id))

    @api.post("/save_weights")
    async def save_weights(request: Request):
        body = await _json(request, SaveWeights, limit)
        return _future(await _guarded("save_state", book.save_state, body.model_id, body.seq_id, body.path,
                                      body.overwrite))

    @api.post("/load_weights")
    async def load_weights(request: Request):
        body = await _json(request, LoadWeights, limit)
        if body.model_id is not None:
            return _future(await _guarded("load_state", book.load_state, body.model_id, body.seq_id or 0, body.path,
                                          body.optimizer))
        if body.session_id is None or body.model_seq_id is None:
            return _refused("load_weights", BadRequest("give model_id (load into a model) or session_id and "
                                                       "model_seq_id (a new model from the checkpoint)"))
        return _future(await _guarded("create_training_client_from_state", book.create_from_state, body.session_id,
                                      body.model_seq_id, body.path, body.optimizer, body.user_metadata))


def _sampling_routes(api: APIRouter, book: tinker_book.TinkerBook, limit: int) -> None:
    """Sampling sessions: created, described, sampled."""
    @api.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await _json(request, CreateSamplingSession, limit)
        result = await _guarded("create_sampling_client", book.sampling.create_sampling_session, body.session_id,
                                body.sampling_session_seq_id, body.model_path, body.base_model)
        return result if isinstance(result, Response) else {"sampling_session_id": result,
                                                             "type": "create_sampling_session"}

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        try:
            found = book.names.sampler(sampler_id)
        except NotFound as exc:
            return _refused("get_sampler", exc)
        return {"sampler_id": sampler_id, "base_model": found.base_model, "model_path": found.model_path}

    @api.post("/asample")
    async def asample(request: Request):
        body = await _json(request, Sample, limit)
        try:
            request_id, n = book.sampling.sample(body.model_dump())  # (on the loop: it joins the sampler's batches)
        except HeteroRLError as exc:
            return _refused("sample", exc)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}


def _future_routes(api: APIRouter, service: Service, limit: int) -> None:
    """Futures: a call's result, long-polled."""
    @api.post("/retrieve_future")
    async def retrieve_future(request: Request):
        body = await _json(request, RetrieveFuture, limit)
        try:
            state = await service.poll(body.request_id, RETRIEVE_WAIT_S)  # (a sign of life of its session)
        except NotFound as exc:
            return _refused("retrieve_future", exc)
        if state["status"] == "pending":
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"},
                                status_code=408)
        if "error" in state:
            error = state["error"]
            category = "user" if error.get("server_type", error.get("type")) in USER_ERRORS else "server"
            return {"error": error.get("message", "the call failed"), "category": category}
        value = state["result"].get("value")
        if isinstance(value, bytes):
            return Response(value, media_type=PROTOBUF)
        return JSONResponse(finite_or_null(value))


def _checkpoint_routes(api: APIRouter, store: CheckpointStore, limit: int) -> None:
    """Training runs and their checkpoints on disk (the SDK's ``RestClient``): listed, described, deleted."""
    @api.get("/training_runs")
    async def training_runs(limit_: int = Query(default=20, alias="limit"), offset: int = Query(default=0, ge=0)):
        ids = await run_in_threadpool(store.training_runs)
        count = max(0, min(int(limit_), 1000))
        runs = [await run_in_threadpool(store.training_run, m) for m in ids[offset:offset + count]]
        return {"training_runs": runs, "cursor": {"offset": offset, "limit": count, "total_count": len(ids)}}

    @api.get("/training_runs/{model_id}")
    async def training_run(model_id: str):
        return await _guarded("get_training_run", store.training_run, model_id)

    @api.get("/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str):
        found = await _guarded("list_checkpoints", store.checkpoints, model_id)
        return found if isinstance(found, Response) else {"checkpoints": found}

    @api.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str):
        result = await _guarded("delete_checkpoint", store.delete_checkpoint, model_id, checkpoint_id)
        return result if isinstance(result, Response) else {}

    @api.get("/checkpoints")
    async def user_checkpoints(limit_: int = Query(default=100, alias="limit"), offset: int = Query(default=0, ge=0)):
        ids = await run_in_threadpool(store.training_runs)
        every = [c for m in ids for c in await run_in_threadpool(store.checkpoints, m)]
        count = max(0, min(int(limit_), 1000))
        return {"checkpoints": every[offset:offset + count],
                "cursor": {"offset": offset, "limit": count, "total_count": len(every)}}

    @api.post("/weights_info")
    async def weights_info(request: Request):
        body = await _json(request, WeightsInfo, limit)

        def info() -> dict:
            model_id, _, _, _ = store.checkpoint(body.tinker_path)
            meta = store.run_meta(model_id)
            lora = meta.get("lora") or {}
            targets = set(lora.get("target_modules") or ())
            return {"base_model": meta["base_model"], "is_lora": meta["is_lora"], "lora_rank": meta.get("lora_rank"),
                    "train_unembed": False, "train_attn": bool(targets & set(ATTN)),
                    "train_mlp": bool(targets & set(MLP)), "optimizer_config": {"type": "adamw"}}

        return await _guarded("weights_info", info)


def _not_served_routes(api: APIRouter) -> None:
    """Every other path: a 404 naming the Tinker feature not served, or saying there is no such route."""
    @api.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_served(rest: str):
        feature = next((what for key, what in NOT_SERVED.items() if key in rest), None)
        why = f"{feature} is not supported by heterorl serve" if feature else "no such Tinker route here"
        return JSONResponse({"detail": f"/api/v1/{rest[:200]}: {why} (docs/SERVICE.md, 'From Tinker', lists what is "
                                       "served)"}, status_code=404)
