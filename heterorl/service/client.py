"""Remote training sessions: the session primitives of `heterorl.training.session`, run by `heterorl serve` on
another machine (or this one) and driven from here with the same methods, arguments, futures and errors.

    from heterorl.service.client import connect

    service = connect("http://learner-host:8765", api_key=open("key").read().strip())
    training = service.create_training_client("add3-sft-base", seed=0)
    sampler = training.save_weights_and_get_sampling_client()
    groups = sampler.sample(prompts, num_samples=8, sampling_params=SamplingParams(max_tokens=8)).result()
    training.forward_backward(datums, loss_fn="gepo").result()
    training.optim_step(AdamParams(learning_rate=1e-4)).result()

``service.create_lora_training_client("arith-hash-sft-base", rank=16)`` trains a LoRA adapter instead, and
``service.list_base_models()`` names what a session can start from; `LocalService` gives the same three in this
process, with no server.

Each call is sent at once (so calls run in submission order) and returns a `concurrent.futures.Future`, which a
background thread completes by long-polling the service. A call the connection dropped is sent again under
the same request id: the service runs it once. Losses go by name (any registered one, with ``loss_config``); a
Python callable cannot cross the wire.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
import uuid
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import httpx

from heterorl.config import LORA_TARGETS, LoraConfig
from heterorl.engines.base import SamplingParams
from heterorl.errors import HeteroRLError
from heterorl.service import wire
from heterorl.training.session import AdamParams, Datum

RETRIES = 4  # attempts per request when the connection fails (the same request id each time)
POLL_S = 30.0  # how long one long-poll waits on the service


def lora_spec(rank: int = 32, alpha: float | None = None, dropout: float = 0.0,
              target_modules: Sequence[str] | None = None) -> LoraConfig:
    """The adapter of `create_lora_training_client`: ``rank``; ``alpha`` (None: 2 × rank, an update scale of 2);
    ``dropout``; ``target_modules`` (None: every attention and MLP projection of a Llama-family model)."""
    spec = LoraConfig(rank=rank, alpha=float(alpha if alpha is not None else 2 * rank), dropout=dropout,
                      target_modules=list(target_modules) if target_modules is not None else list(LORA_TARGETS))
    spec.validate("lora")
    if not spec.enabled:
        raise HeteroRLError(f"rank {rank!r}: a LoRA session needs a rank >= 1")
    return spec


class LocalService:
    """The service's session API in this process, with no server: `list_base_models`,
    `create_training_client`, `create_lora_training_client`, each giving a local `TrainingClient` (the same
    primitives and futures as a remote one)."""

    def __init__(self, models: dict[str, str] | None = None, *, device: str = "cpu") -> None:
        """``models``: local Hugging Face folders to start from by name ({name: path})."""
        from heterorl.policies import register_models

        self.models = register_models([f"{name}={path}" for name, path in (models or {}).items()])
        self.device = device

    def list_base_models(self) -> list[str]:
        from heterorl.policies import base_models

        return list(base_models(self.models))

    def _load(self, base_model: str):
        from heterorl.policies import load_policy

        return load_policy(self.models.get(base_model, base_model), device=self.device)

    def create_training_client(self, base_model: str, *, seed: int | None = None, share_prompts: bool = True):
        from heterorl.training.session import TrainingClient

        return TrainingClient(*self._load(base_model), device=self.device, seed=seed, share_prompts=share_prompts)

    def create_lora_training_client(self, base_model: str, rank: int = 32, *, alpha: float | None = None,
                                    dropout: float = 0.0, target_modules: Sequence[str] | None = None,
                                    seed: int | None = None, share_prompts: bool = True):
        from heterorl.training.session import TrainingClient

        spec = lora_spec(rank, alpha, dropout, target_modules)
        return TrainingClient(*self._load(base_model), device=self.device, seed=seed, share_prompts=share_prompts,
                              lora=spec)


def connect(url: str, api_key: str | None = None, *, timeout_s: float = 120.0, use_msgpack: bool = True
            ) -> ServiceClient:
    """A client of the `heterorl serve` at ``url`` (checked at once: a wrong address or key fails here)."""
    client = ServiceClient(url, api_key, timeout_s=timeout_s, use_msgpack=use_msgpack)
    client.check()
    return client


class ServiceClient:
    """The connection to one service: makes training and sampling clients, and runs their calls."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 120.0,
                 use_msgpack: bool = True) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._content = wire.MSGPACK if use_msgpack else wire.JSON
        self._http = httpx.Client(base_url=self.url, headers={**headers, "Accept": self._content},
                                  timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._waiters = ThreadPoolExecutor(max_workers=16, thread_name_prefix="heterorl-session-poll")
        self._closed = threading.Event()

    def check(self) -> None:
        self._request("GET", "/health")
        self._request("GET", "/api/v1/sessions")  # (answers 401 to a wrong key)

    def list_base_models(self) -> list[str]:
        """The names of the policies the service can start a session from (`base_models` has what each is)."""
        return [m["name"] for m in self.base_models()]

    def base_models(self) -> list[dict]:
        """[{name, description}] of the policies the service can start a session from."""
        return self._request("GET", "/api/v1/base_models")["base_models"]

    def training_client(self, session_id: str) -> RemoteTrainingClient:
        """The client of a session the service holds now, by its id (to re-attach from another process, or after
        this client's connection was lost); a 404 error when it does not hold it."""
        return RemoteTrainingClient(self, self._request("GET", f"/api/v1/sessions/{session_id}"))

    def create_training_client_from_state(self, base_model: str, session_id: str, name: str, *,
                                          seed: int | None = None) -> RemoteTrainingClient:
        """A fresh session of ``base_model`` that loads the state ``name`` session ``session_id`` saved, e.g.
        before the service restarted (states outlive it; sessions do not)."""
        training = self.create_training_client(base_model, seed=seed)
        training.load_state(name, session=session_id).result()
        return training

    def create_training_client(self, base_model: str, *, seed: int | None = None, share_prompts: bool = True,
                               name: str | None = None) -> RemoteTrainingClient:
        """A fresh session on the service that trains the whole of ``base_model`` (a name `list_base_models`
        gives) with a new optimizer. ``name``: what its model ids say in place of its id (``heterorl:NAME/latest``
        at the OpenAI endpoint), unique among the service's live sessions."""
        found = self._request("POST", "/api/v1/sessions", {"base_model": base_model, "seed": seed,
                                                           "share_prompts": share_prompts, "name": name})
        return RemoteTrainingClient(self, found)

    def create_lora_training_client(self, base_model: str, rank: int = 32, *, alpha: float | None = None,
                                    dropout: float = 0.0, target_modules: Sequence[str] | None = None,
                                    seed: int | None = None, share_prompts: bool = True, name: str | None = None
                                    ) -> RemoteTrainingClient:
        """A fresh session on the service that trains a LoRA adapter of ``rank`` on the frozen ``base_model``
        (`lora_spec` for the other arguments; ``name`` as in `create_training_client`); a rank or target module
        that does not fit the model is refused with the mismatch named."""
        found = self._request("POST", "/api/v1/sessions", {
            "base_model": base_model, "seed": seed, "share_prompts": share_prompts, "name": name,
            "lora": lora_spec(rank, alpha, dropout, target_modules).to_dict()})
        return RemoteTrainingClient(self, found)

    def list_sessions(self) -> list[dict]:
        """This key's sessions on the service: {session_id, name, base_model, version, latest} each."""
        return self._request("GET", "/api/v1/sessions")["described"]

    def sampling_client(self, model: str = "latest") -> RemoteSamplingClient:
        """A sampling client the service already serves: "heterorl:SESSION/VERSION", "heterorl:SESSION/latest"
        or "latest"."""
        served = {m["id"] for m in self._request("GET", "/v1/models")["data"]}
        if model not in served:
            raise HeteroRLError(f"the service serves no sampling client {model!r}; it serves: "
                                f"{', '.join(sorted(served)) or 'none yet'}")
        session_id, _, version = model.removeprefix("heterorl:").partition("/")
        return RemoteSamplingClient(self, model, int(version) if version.isdigit() else -1,
                                    session_id if model.startswith("heterorl:") else None)

    def close(self) -> None:
        self._closed.set()
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, *, raw: bool = False, **params) -> Any:
        """One request, sent again on a dropped connection; the decoded answer (bytes with ``raw``)."""
        content = None if body is None else wire.pack(body, self._content)
        headers = {} if body is None else {"Content-Type": self._content}
        for attempt in range(RETRIES):
            try:
                response = self._http.request(method, path, content=content, headers=headers, params=params or None)
                break
            except httpx.TransportError as exc:
                if attempt == RETRIES - 1 or self._closed.is_set():
                    raise HeteroRLError(f"the service at {self.url} did not answer {method} {path} ({exc}); is "
                                        "`heterorl serve` running there?") from None
                time.sleep(0.2 * 2 ** attempt)
        if response.status_code >= 400:
            raise _refusal(response, method, path)
        return response.content if raw else wire.unpack(response.content, response.headers.get("content-type"))

    def _call(self, path: str, body: dict, decode: Callable[[Any], Any] = wire.result_from_wire) -> Future:
        """Submit a call now; a future of its decoded result, completed by long-polling."""
        future_id = self._request("POST", path, {**body, "request_id": uuid.uuid4().hex})["future_id"]
        future = RemoteFuture(self, future_id)
        self._waiters.submit(self._wait, future_id, future, decode)
        return future

    def _wait(self, future_id: str, future: Future, decode: Callable[[Any], Any]) -> None:
        try:
            while not self._closed.is_set() and not future.cancelled():
                state = self._request("GET", f"/api/v1/futures/{future_id}", wait_s=POLL_S)
                if state["status"] == "done":
                    if "error" in state:
                        future.set_exception(wire.error_from_wire(state["error"]))
                    else:
                        future.set_result(decode(state["result"]))
                    return
            if not future.cancelled():
                future.set_exception(HeteroRLError("the service client was closed before the call finished"))
        except BaseException as exc:  # handed to whoever waits on the future
            if not future.done():
                future.set_exception(exc)


class RemoteFuture(Future):
    """The future of a call on the service: `cancel` cancels the call there too (one still waiting never runs, a
    sampling call that runs stops between two decode steps; `DELETE /api/v1/futures/ID`)."""

    def __init__(self, service: ServiceClient, future_id: str) -> None:
        super().__init__()
        self.service, self.future_id = service, future_id

    def cancel(self) -> bool:
        # cancelled here first: the service answers the poll of a call it cancels at once, and that answer must not
        # finish this future before the DELETE returns (the poller stops on a cancelled future)
        if self.cancelled():
            return True
        if not super().cancel():
            return False  # done already
        self.service._request("DELETE", f"/api/v1/futures/{self.future_id}")
        return True


def _refusal(response: httpx.Response, method: str, path: str) -> Exception:
    """The error a refused request stands for: the local exception a call raised (400), else a HeteroRLError
    naming the status and the service's reason."""
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text[:500]}
    if response.status_code == 400 and isinstance(body.get("error"), dict):
        return wire.error_from_wire(body["error"])
    detail = body.get("detail", body)
    if response.status_code == 422 and isinstance(detail, list):
        detail = "; ".join(f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg')}" for d in detail)
    return HeteroRLError(f"{method} {path}: {response.status_code} {response.reason_phrase}: {detail}")


def _datums(datums: Sequence[Datum]) -> list[dict]:
    return [wire.datum_to_wire(d) for d in datums]


def _loss_name(loss_fn) -> str:
    if not isinstance(loss_fn, str):
        raise HeteroRLError("a remote session takes a loss by its registered name (gepo.available_losses()), "
                            f"with loss_config for its options; {loss_fn!r} is not a name: a Python callable cannot "
                            "run on the service")
    return loss_fn


class RemoteTrainingClient:
    """`heterorl.training.session.TrainingClient`'s primitives, run by a session of a `heterorl serve`."""

    def __init__(self, service: ServiceClient, described: dict) -> None:
        self.service = service
        self.session_id: str = described["session_id"]
        self.name: str | None = described.get("name")  # its model ids' name for it (None: its id)
        self.base_model: str = described["base_model"]
        self.version: int = described["version"]
        lora = described.get("lora")
        self.lora = LoraConfig(**lora) if lora else None  # the adapter this session trains (None: the whole model)
        self.adapter_meta: dict | None = described.get("adapter")  # its base's digest, rank, alpha, targets
        self._tokenizer = None
        self._path = f"/api/v1/sessions/{self.session_id}/calls"

    @property
    def tokenizer(self):
        """The session's tokenizer, fetched from the service once."""
        if self._tokenizer is None:
            self._tokenizer = fetch_tokenizer(self.service, self.session_id)
        return self._tokenizer

    def _run(self, method: str, args: dict, decode=wire.result_from_wire) -> Future:
        return self.service._call(self._path, {"method": method, "args": args}, decode)

    def forward(self, datums: Sequence[Datum], loss_fn="cross_entropy", loss_config=None, *,
                temperature: float = 1.0) -> Future:
        """Future of ``ForwardBackwardOutput`` without touching gradients."""
        return self._run("forward", {"datums": _datums(datums), "loss_fn": _loss_name(loss_fn),
                                     "loss_config": loss_config, "temperature": temperature})

    def forward_backward(self, datums: Sequence[Datum], loss_fn="cross_entropy", loss_config=None, *,
                         temperature: float = 1.0) -> Future:
        """Future of ``ForwardBackwardOutput``; gradients accumulate on the service until ``optim_step``."""
        return self._run("forward_backward", {"datums": _datums(datums), "loss_fn": _loss_name(loss_fn),
                                              "loss_config": loss_config, "temperature": temperature})

    def optim_step(self, params: AdamParams | None = None) -> Future:
        """Future of ``OptimStepOutput``."""
        import dataclasses

        return self._run("optim_step", {"params": dataclasses.asdict(params or AdamParams())})

    def save_weights_for_sampler(self, form: str = "whole") -> Future:
        """Future of (version, state dict): the version is bumped on the service and its weights downloaded; a
        LoRA session's are the merged weights ("whole") or the adapter's tensors alone ("adapter")."""
        def fetch(raw) -> tuple[int, dict]:
            version = wire.result_from_wire(raw)
            self.version = max(self.version, version)
            data = self.service._request("GET", f"/api/v1/sessions/{self.session_id}/weights/{version}", raw=True)
            return version, wire.state_from_bytes(data)
        return self._run("save_weights_for_sampler", {"form": form}, fetch)

    def snapshot(self) -> Future:
        """Future of the `RemoteSamplingClient` `save_weights_and_get_sampling_client` returns."""
        def made(raw) -> RemoteSamplingClient:
            found = wire.result_from_wire(raw)
            self.version = max(self.version, found["version"])
            return RemoteSamplingClient(self.service, found["model"], found["version"], self.session_id,
                                        tokenizer=self._tokenizer)
        return self._run("save_weights_and_get_sampling_client", {}, made)

    def save_weights_and_get_sampling_client(self) -> RemoteSamplingClient:
        """Bump the policy version and return a sampler over a frozen copy of the current weights (on the
        service)."""
        return self.snapshot().result()

    def save_state(self, name: str) -> Future:
        """Future of ``name``: the session's weights, optimizer, version, step and RNG, kept by the service under
        that file name (its state folder, one per session)."""
        return self._run("save_state", {"name": str(name)})

    def load_state(self, name: str, session: str | None = None) -> Future:
        """Future of the restored version, from a state this session (or the session ``session``, e.g. one of
        before the service restarted: its states stay on disk) saved under ``name``."""
        def loaded(raw) -> int:
            self.version = wire.result_from_wire(raw)
            return self.version
        args = {"name": str(name)} | ({"session": session} if session is not None else {})
        return self._run("load_state", args, loaded)

    def close(self) -> None:
        """End the session on the service (its samplers go with it)."""
        self.service._request("DELETE", f"/api/v1/sessions/{self.session_id}")


class RemoteSamplingClient:
    """`heterorl.training.session.SamplingClient`'s ``sample`` and ``compute_logprobs``, run by the service."""

    def __init__(self, service: ServiceClient, model: str, version: int, session_id: str | None,
                 tokenizer=None) -> None:
        self.service, self.model, self.version, self.session_id = service, model, version, session_id
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.session_id is None:
                raise HeteroRLError(f"{self.model!r} names no session: ask for it as heterorl:SESSION/VERSION to "
                                    "get its tokenizer")
            self._tokenizer = fetch_tokenizer(self.service, self.session_id)
        return self._tokenizer

    def sample(self, prompt_tokens: Sequence[int] | Sequence[Sequence[int]], num_samples: int = 1,
               sampling_params: SamplingParams | None = None, **unsupported) -> Future:
        """Future of ``list[SampleOutput]`` (one prompt) or ``list[list[SampleOutput]]`` (a list of prompts)."""
        if unsupported:
            raise HeteroRLError(f"a remote sampling client does not take {', '.join(unsupported)} (in-flight "
                                "updates need the engine in this process)")
        prompts = [list(p) for p in prompt_tokens] if prompt_tokens and not isinstance(prompt_tokens[0], int) \
            else list(prompt_tokens)
        body = {"model": self.model, "method": "sample",
                "args": {"prompt_tokens": prompts, "num_samples": num_samples,
                         "sampling_params": wire.params_to_wire(sampling_params)}}
        return self.service._call("/api/v1/samplers/calls", body, wire.samples_from_wire)

    def compute_logprobs(self, tokens: Sequence[int]) -> Future:
        """Future of the teacher-forced log-probs of ``tokens[1:]``."""
        body = {"model": self.model, "method": "compute_logprobs", "args": {"tokens": list(tokens)}}
        return self.service._call("/api/v1/samplers/calls", body, wire.result_from_wire)

    def close(self) -> None:
        """Nothing to release here: the service keeps its newest samplers per session."""


def fetch_tokenizer(service: ServiceClient, session_id: str):
    """The session's tokenizer, as the service saved it (its files in a zip), loaded here."""
    from transformers import AutoTokenizer

    data = service._request("GET", f"/api/v1/sessions/{session_id}/tokenizer", raw=True)
    with tempfile.TemporaryDirectory(prefix="heterorl-tokenizer-") as folder:
        zipfile.ZipFile(io.BytesIO(data)).extractall(folder)
        return AutoTokenizer.from_pretrained(folder)


__all__ = ["RemoteSamplingClient", "RemoteTrainingClient", "ServiceClient", "connect"]
