"""What `heterorl serve` holds for Tinker's SDK (`TinkerBook`): its sessions, models, sampling sessions and
checkpoints by Tinker's names, over heterorl's own `Service`.

A Tinker session is a namespace ("t-" and 12 hex digits). A Tinker model (``SESSION:train:N``) is a heterorl
training session; a sampling session (``SESSION:sample:N``) is one of its sampling clients, or of a session made
to sample a checkpoint or a base model. Calls are `Service` calls: run in order per model, bounded in number,
kept ``result_ttl_s`` after they finish, and run once per Tinker request (a retried ``seq_id`` returns the first
call's id). Checkpoints are heterorl training states (`CheckpointStore`), which outlive the service.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from heterorl.errors import HeteroRLError
from heterorl.service.calls import BadRequest, NotFound, TooBusy
from heterorl.service.openai_generation import Generation, RequestBatcher
from heterorl.service.sessions import Service, _check_sampling_size, _then
from heterorl.service.tinker import losses, protobuf
from heterorl.service.tinker.checkpoints import CheckpointStore, now_iso
from heterorl.service.tinker.convert import adam_params, cut, lora_spec, prompt_logprobs, prompt_tokens, sampling_params
from heterorl.training.session import read_training_state

MAX_SESSIONS = 256  # Tinker sessions (namespaces, a few hundred bytes each); models count as heterorl sessions
MAX_SAMPLING_SESSIONS = 4096  # names of sampling sessions remembered; the oldest are forgotten beyond
MAX_DATUMS = 1024  # per forward_backward request (the SDK splits bigger calls into requests of 1024)


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


class TinkerBook:
    """Tinker's names for `Service`'s sessions, samplers and states (see the module)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.store = CheckpointStore(service.state_dir / "tinker")
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, TinkerSession] = OrderedDict()
        self._models: dict[str, Model] = {}
        self._samplers: OrderedDict[str, SamplingSession] = OrderedDict()
        self._loads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinker-load")  # model loads
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampling client → its batcher
        self._hosts: dict[tuple, str] = {}  # (base, adapter config, base only) → the session that samples them
        self._host_lock = threading.Lock()
        self._answering: set = set()  # the tasks that answer sample calls (held: the loop keeps weak references)

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

    def training(self, model_id: str):
        model = self.model(model_id)
        return self.service.session(model.session_id)

    def resolve_base(self, base_model: str) -> str:
        """heterorl's name of a base model named as the SDK names it: a name `heterorl serve` loads (``--model
        NAME=PATH``, the shipped policies) or the absolute path of one of their folders. (A name is answered
        without looking at any folder: SmolLM2's is made on its first load, which may take minutes.)"""
        names = [m["name"] for m in self.service.list_base_models()]
        if base_model in names:
            return base_model
        if base_model.startswith("/"):
            wanted = str(Path(base_model).resolve())
            for name in sorted(names, key=lambda n: n == "smollm2"):  # (SmolLM2's folder is made when first asked)
                if self.base_folder(name) == wanted:
                    return name
        raise BadRequest(f"base_model {base_model[:200]!r} is not served here: give one of {', '.join(names)}, or "
                         "the absolute path of its folder (a server adds folders with --model NAME=PATH)")

    def base_folder(self, name: str) -> str | None:
        """The folder a base model loads from (what the SDK loads its tokenizer from); None when it has none."""
        from heterorl.policies import policy_folder

        try:
            folder = Path(self.service.models[name]) if name in self.service.models else policy_folder(name)
            return str(folder.resolve())
        except (HeteroRLError, OSError):
            return None

    def create_model(self, session_id: str, seq: int, base_model: str, lora_config: dict | None,
                     user_metadata: dict | None) -> str:
        """Submit the load of a model (a heterorl session) as a call; its id."""
        self.session(session_id)
        name = self.resolve_base(base_model)
        spec = lora_spec(lora_config)
        model_id = f"{session_id}:train:{int(seq)}"

        def load() -> dict:
            seed = (lora_config or {}).get("seed")
            described = self.service.create_session(name, seed if isinstance(seed, int) else None, True, spec)
            self._add_model(Model(model_id, described["session_id"], base_model,
                                  spec["rank"] if spec else None, dict(user_metadata or {})))
            return {"model_id": model_id, "type": "create_model"}

        return self._submit(session_id, "create_model", model_id, lambda: self._loads.submit(load))

    def _add_model(self, model: Model) -> None:
        with self._lock:
            self._models[model.model_id] = model
            session = self._sessions.get(model.model_id.split(":")[0])
            if session is not None:
                session.models.append(model.model_id)
        lora = self.service.session(model.session_id).training.lora
        self.store.write_run(model.model_id, {
            "training_run_id": model.model_id, "base_model": model.base_model, "is_lora": model.lora_rank is not None,
            "lora_rank": model.lora_rank, "user_metadata": model.user_metadata, "created": model.created,
            "lora": lora.to_dict() if lora is not None else None})

    def info(self, model_id: str) -> dict:
        model = self.model(model_id)
        folder = self.base_folder(self.resolve_base(model.base_model))
        data = {"model_name": model.base_model, "arch": type(self.training(model_id).training.model).__name__}
        if folder is not None:
            data["tokenizer_id"] = folder
        return {"type": "get_info", "model_id": model_id, "model_data": data, "is_lora": model.lora_rank is not None,
                "lora_rank": model.lora_rank, "model_name": model.base_model, "optimizer_config": {"type": "adamw"}}

    def _submit(self, owner: str, kind: str, key: str, start) -> str:
        """A call of ``owner`` (a heterorl or Tinker session) run once per (``kind``, ``key``)."""
        return self.service._submit(owner, f"tinker:{kind}", key, start)

    # -- training calls -----------------------------------------------------------------------------------
    def forward_backward(self, request: protobuf.ForwardBackwardRequest) -> str:
        session = self.training(request.model_id)
        datums, loss_fn, config = losses.build(request.data, request.loss_fn, request.loss_fn_config)
        ours = request.loss_fn not in losses.TINKER_LOSSES
        method = session.training.forward if request.forward_only else session.training.forward_backward

        def answer(out) -> bytes:
            metrics = losses.metrics_for_tinker(out.loss, out.metrics, ours)
            return protobuf.forward_backward_output([np.asarray(lp, dtype=np.float32) for lp in out.logprobs],
                                                    metrics)

        return self._submit(session.session_id, "forward_backward", f"{request.model_id}/{request.seq_id}",
                            lambda: _then(method(datums, loss_fn, config), answer))

    def optim_step(self, model_id: str, seq: int, adam: dict) -> str:
        session = self.training(model_id)
        params = adam_params(adam)

        def answer(out) -> dict:
            metrics = {"optim/step:max": float(out.step), "optim/skipped:max": float(out.skipped)}
            if math.isfinite(out.grad_norm):
                metrics["optim/grad_norm:mean"] = out.grad_norm
            return {"metrics": metrics}

        return self._submit(session.session_id, "optim_step", f"{model_id}/{seq}",
                            lambda: _then(session.training.optim_step(params), answer))

    def save_state(self, model_id: str, seq: int, name: str, overwrite: bool) -> str:
        """``save_state``: the weights (a LoRA adapter) and the optimizer, as ``tinker://MODEL/weights/NAME``."""
        session = self.training(model_id)
        path = self.store.path(model_id, "weights", name)
        if path.exists() and not overwrite:
            raise BadRequest(f"model {model_id} already has a checkpoint named {name!r}; choose another "
                             "name or pass overwrite")
        path.parent.mkdir(parents=True, exist_ok=True)
        return self._submit(session.session_id, "save_weights", f"{model_id}/{seq}", lambda: _then(
            session.training.save_state(path), lambda _: {"path": f"tinker://{model_id}/weights/{name}",
                                                          "type": "save_weights"}))

    def save_for_sampler(self, model_id: str, seq: int, name: str | None, sampler_seq: int | None) -> str:
        """``save_weights_for_sampler(name)``: the weights as ``tinker://MODEL/sampler_weights/NAME`` (and a sampling
        client of them kept); without a name, a sampling session (``save_weights_and_get_sampling_client``)."""
        session = self.training(model_id)
        model = self.model(model_id)
        owner = model_id.split(":")[0]
        if name is None:
            if not isinstance(sampler_seq, int):
                raise BadRequest("give a path (a name) or a sampling_session_seq_id")
            sampler_id = f"{owner}:sample:{sampler_seq}"

            def made(sampler) -> dict:
                kept = self.service._keep_sampler(session, sampler)
                self._add_sampler(sampler_id, SamplingSession(kept["model"], model.base_model, None))
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return self._submit(session.session_id, "save_weights_for_sampler", f"{model_id}/{seq}",
                                lambda: _then(session.training.snapshot(), made))
        path = self.store.path(model_id, "sampler_weights", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tinker_path = f"tinker://{model_id}/sampler_weights/{name}"
        return self._submit(session.session_id, "save_weights_for_sampler", f"{model_id}/{seq}", lambda: _then(
            session.training.save_state(path), lambda _: {"path": tinker_path, "type": "save_weights_for_sampler"}))

    def load_state(self, model_id: str, seq: int, tinker_path: str, optimizer: bool) -> str:
        """``load_state`` / ``load_state_with_optimizer`` on an existing model."""
        session = self.training(model_id)
        _, _, _, path = self.store.checkpoint(tinker_path)
        return self._submit(session.session_id, "load_weights", f"{model_id}/{seq}",
                            lambda: self._load_into(session.training, path, optimizer, model_id, tinker_path))

    def _load_into(self, training, path: Path, optimizer: bool, model_id: str, tinker_path: str) -> Future:
        state = read_training_state(path)
        if not optimizer:
            state["optimizer"] = None

        def done(_) -> dict:
            if not optimizer:
                training.optimizer = None  # (a fresh AdamW at the next step; runs before the next call)
            return {"path": tinker_path, "model_id": model_id, "type": "load_weights"}

        return _then(training.load_state(state), done)

    def create_from_state(self, session_id: str, seq: int, tinker_path: str, optimizer: bool,
                          user_metadata: dict | None) -> str:
        """``create_training_client_from_state[_with_optimizer]``: a new model with the checkpoint's base and
        adapter, loaded from it."""
        self.session(session_id)
        source, _, _, path = self.store.checkpoint(tinker_path)
        meta = self.store.run_meta(source)
        name = self.resolve_base(meta["base_model"])
        model_id = f"{session_id}:train:{int(seq)}"

        def load() -> dict:
            lora = meta.get("lora")
            described = self.service.create_session(name, None, True, lora)
            self._add_model(Model(model_id, described["session_id"], meta["base_model"], meta.get("lora_rank"),
                                  dict(user_metadata or meta.get("user_metadata") or {})))
            training = self.service.session(described["session_id"]).training
            return self._load_into(training, path, optimizer, model_id, tinker_path).result()

        return self._submit(session_id, "load_weights", model_id, lambda: self._loads.submit(load))

    # -- sampling -----------------------------------------------------------------------------------------
    def _add_sampler(self, sampler_id: str, entry: SamplingSession) -> None:
        with self._lock:
            self._samplers[sampler_id] = entry
            while len(self._samplers) > MAX_SAMPLING_SESSIONS:
                self._samplers.popitem(last=False)
            session = self._sessions.get(sampler_id.split(":")[0])
            if session is not None:
                session.samplers.append(sampler_id)
                del session.samplers[:-MAX_SAMPLING_SESSIONS]

    def sampler(self, sampler_id: str) -> SamplingSession:
        with self._lock:
            found = self._samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if found is None:
            raise NotFound(f"no sampling session {str(sampler_id)[:100]!r} here (save_weights_and_get_sampling_client "
                           "or create_sampling_client makes one)")
        return found

    def create_sampling_session(self, session_id: str, seq: int, model_path: str | None,
                                base_model: str | None) -> str:
        """A sampling session of a checkpoint (``model_path``) or of a base model; its id. Checkpoints are sampled
        by a host: one heterorl session per base model and adapter config (`_host`), which loads each checkpoint
        asked for and keeps a sampling client of it (its newest --max-samplers, as every session)."""
        self.session(session_id)
        sampler_id = f"{session_id}:sample:{int(seq)}"
        with self._lock:
            if sampler_id in self._samplers:  # (a retry)
                return sampler_id
        if model_path is not None:
            source, _, _, path = self.store.checkpoint(model_path)
            meta = self.store.run_meta(source)
            base, lora = meta["base_model"], meta.get("lora")
        elif base_model is not None:
            base, lora, path = base_model, None, None
        else:
            raise BadRequest("give model_path (a tinker:// checkpoint) or base_model")
        name = self.resolve_base(base)
        with self._host_lock:  # (one load into a host at a time: its weights are the checkpoint's until snapshot)
            session = self._host(name, lora, base_only=path is None)
            training = session.training
            if path is not None:
                state = read_training_state(path)
                state["version"] = training.version  # (versions count the host's snapshots, whatever was loaded)
                training.load_state(state).result()
            elif session.samplers:  # the base model's sampler: one is enough
                model = f"heterorl:{session.session_id}/{next(reversed(session.samplers))}"
                self._add_sampler(sampler_id, SamplingSession(model, base, None))
                return sampler_id
            kept = self.service._keep_sampler(session, training.snapshot().result())
        self._add_sampler(sampler_id, SamplingSession(kept["model"], base, model_path))
        return sampler_id

    def _host(self, name: str, lora: dict | None, base_only: bool):
        """The heterorl session that samples checkpoints of base ``name`` with adapter ``lora`` (or, ``base_only``,
        the base model itself), made when there is none or it was closed (idle past --session-ttl-s)."""
        key = (name, json.dumps(lora, sort_keys=True), base_only)
        session_id = self._hosts.get(key)
        if session_id is not None:
            try:
                return self.service.session(session_id)
            except NotFound:
                pass
        live = set(self.service.session_ids())
        self._hosts = {k: v for k, v in self._hosts.items() if v in live}  # (forget the closed ones)
        described = self.service.create_session(name, None, True, lora)
        self._hosts[key] = described["session_id"]
        return self.service.session(described["session_id"])

    def sample(self, body: dict) -> tuple[str, int]:
        """Submit ``asample`` (on the event loop: its generation joins those of other requests to the same
        sampler that can share an engine call, `RequestBatcher`); (call id, number of sequences)."""
        sampler_id = body.get("sampling_session_id")
        entry = self.sampler(sampler_id)
        heterorl_session, sampler = self.service.sampler(entry.model)
        prompt = prompt_tokens(body.get("prompt"))
        n = body.get("num_samples", 1)
        params, stops = sampling_params(body.get("sampling_params") or {})
        for feature in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(feature):
                raise BadRequest(f"{feature} is not supported by heterorl serve; ask for logprobs and prompt_logprobs "
                                 "only")
        if body.get("target_prompt_logprobs") is not None:
            raise BadRequest("target_prompt_logprobs is not supported by heterorl serve")
        _check_sampling_size("sample", {"prompt_tokens": prompt, "num_samples": n,
                                        "sampling_params": {"max_tokens": params.max_tokens}},
                             self.service.max_request_tokens)
        from heterorl.service.openai_api import _prompts_fit

        try:
            _prompts_fit(sampler, [prompt], params, n)
        except Exception as exc:  # (the OpenAI layer's refusal: the prompt and max_tokens exceed the context)
            raise BadRequest(str(getattr(exc, "message", exc))) from None
        want_prompt, last_n = bool(body.get("prompt_logprobs")), body.get("prompt_logprobs_last_n")
        loop = asyncio.get_running_loop()

        def start() -> Future:
            generation = Generation([prompt], n, params, tokenizer=sampler.tokenizer, stops=[], token_ids=False,
                                    stream=False)
            self._batcher(sampler, entry.model).submit(generation)
            out: Future = Future()

            async def answer() -> None:
                try:
                    samples = (await generation.result())[0]
                    scored = await asyncio.wrap_future(sampler.compute_logprobs(prompt)) if want_prompt and \
                        len(prompt) > 1 else []
                    sequences = await asyncio.to_thread(cut, sampler.tokenizer, prompt, samples, stops)
                    out.set_result(protobuf.sample_response(
                        sequences, prompt_logprobs(scored, last_n) if want_prompt else None))
                except BaseException as exc:  # handed to whoever retrieves the call
                    out.set_exception(exc)

            task = loop.create_task(answer())
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)
            return out

        call_id = self.service.calls.submit(heterorl_session, "tinker:asample", f"{sampler_id}/{body.get('seq_id')}",
                                            start, sampler=(heterorl_session, sampler.version))
        return call_id, n

    def _batcher(self, sampler, model: str) -> RequestBatcher:
        found = self._batchers.get(sampler)
        if found is None:
            found = self._batchers[sampler] = RequestBatcher(sampler, on_closed=lambda exc: NotFound(
                f"the sampler {model} was closed while this sample was generated ({exc})"))
        return found


class SessionFinished(HeteroRLError):
    """A call on a Tinker session that was finished (HTTP 410 to a heartbeat)."""


