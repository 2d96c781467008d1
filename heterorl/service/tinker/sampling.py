"""Tinker's sampling on `heterorl serve` (`TinkerSampling`): sampling sessions of a checkpoint or a base model,
each sampled by a host, and ``asample``, whose generation joins those of other requests to the same sampler.

A host is one heterorl session per base model and adapter config: it loads each checkpoint asked for and keeps a
sampling client of it (its newest --max-samplers, as every session). A sample is a `Service` call whose
generation runs on the event loop, batched with the sampler's other requests (`RequestBatcher`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from concurrent.futures import Future
from typing import Callable

from heterorl.service.bounds import check_sampling_size
from heterorl.service.calls import BadRequest, NotFound
from heterorl.service.openai_generation import Generation, RequestBatcher
from heterorl.service.sessions import Service
from heterorl.service.tinker import protobuf
from heterorl.service.tinker.checkpoints import CheckpointStore
from heterorl.service.tinker.convert import cut, prompt_logprobs, prompt_tokens, sampling_params
from heterorl.service.tinker.names import SamplingSession, TinkerNames
from heterorl.training.session import read_training_state


class TinkerSampling:
    """Sampling sessions and samples (see the module). ``resolve_base``: heterorl's name of a base model as the SDK
    names it (`TinkerBook.resolve_base`)."""

    def __init__(self, service: Service, names: TinkerNames, store: CheckpointStore,
                 resolve_base: Callable[[str], str]) -> None:
        self.service, self.names, self.store, self.resolve_base = service, names, store, resolve_base
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampling client → its batcher
        self._hosts: dict[tuple, str] = {}  # (base, adapter config, base only) → the session that samples them
        self._host_lock = threading.Lock()
        self._answering: set = set()  # the tasks that answer sample calls (held: the loop keeps weak references)

    def create_sampling_session(self, session_id: str, seq: int, model_path: str | None,
                                base_model: str | None) -> str:
        """A sampling session of a checkpoint (``model_path``) or of a base model; its id. Checkpoints are sampled
        by a host (`_host`)."""
        self.names.session(session_id)
        sampler_id = f"{session_id}:sample:{int(seq)}"
        if self.names.has_sampler(sampler_id):  # (a retry)
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
                self.names.add_sampler(sampler_id, SamplingSession(model, base, None))
                return sampler_id
            kept = self.service._keep_sampler(session, training.snapshot().result())
        self.names.add_sampler(sampler_id, SamplingSession(kept["model"], base, model_path))
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
        entry = self.names.sampler(sampler_id)
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
        check_sampling_size("sample", {"prompt_tokens": prompt, "num_samples": n,
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
