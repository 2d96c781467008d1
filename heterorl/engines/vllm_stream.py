"""A streaming, interruptible vLLM engine: vLLM's ``AsyncLLM`` on an event loop of its own, fed one group at a time.

`VLLMEngine.generate` takes a batch and returns when its slowest completion ends; while the last long completions
run, the engine is nearly empty. This engine has no batch: `submit` hands vLLM one group (a prompt, ``n``
samples) and returns a future that completes when that group's last sample ends, while other groups keep
running, so a caller that submits a new group whenever one ends keeps vLLM's continuous batch full.

New weights are loaded while requests are in flight (`load_version`): vLLM pauses its scheduler keeping the
requests (``pause_generation(mode="keep")``), the version is loaded in place (as `VLLMEngine` does), vLLM's
weight-version label is set, and the scheduler resumes. What happens to the keys and values the old weights
computed for the requests in flight is ``inflight_kv``:

``recompute`` (default)  vLLM drops them and prefills each request's prompt and tokens so far again with the new
                         weights: every later token is drawn, and its log-prob computed, exactly as the new
                         version would from that context (measured within 1e-4 of the learner's teacher-forced
                         log-probs; tests/engines/test_vllm_stream.py);
``keep``                 they are kept: nothing is recomputed, but the tokens drawn after the update attend to
                         keys and values of the old weights, so their log-probs are those of neither version
                         (measured: up to 11 nats off after a large change; docs/ENGINES.md). Prefix caching is off
                         in this mode, so no new request starts from the old weights' cache.

Every token is stamped with the version that drew it (``SampleOutput.versions``, from vLLM's per-token weight
versions). ``max_versions_per_sample`` bounds partial rollouts: a group still in flight whose samples would span
more versions than that is aborted and started again from its prompt with the new weights (same seed), and
counted (``stats["restarted"]``); 0 = no bound. A version whose tensors do not fit the model is refused before
vLLM is paused (`SamplingError`, ``stats["weights_refused"]``): the requests in flight go on with the old
weights. An error of one request fails that group's future (``stats["request_errors"]``), not the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

from heterorl.engines.base import SampleOutput, SamplingParams, WeightUpdates, validate_prompts, validate_request
from heterorl.engines.vllm_engine import VLLMEngine, _reload_in_worker, sample_output
from heterorl.errors import SamplingError
from heterorl.loop_thread import LoopThread

INFLIGHT_KV = ("recompute", "keep")
POLL_S = 0.02  # how often `generate` looks for newer weights while its groups run


@dataclass(eq=False)
class _Group:
    """One submitted group: what to sample, the future its caller holds, and its progress on the engine's loop."""

    key: int
    prompt: list[int]
    params: SamplingParams
    num_samples: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    task: asyncio.Task | None = None
    attempt: int = 0
    tokens_out: int = 0  # tokens drawn by this attempt so far
    versions_seen: int = 1  # versions this attempt's tokens will have been drawn by
    restarting: bool = False


class StreamingVLLMEngine(VLLMEngine):
    """`VLLMEngine` over vLLM's ``AsyncLLM``: groups submitted one by one (`submit`), weights loaded while they run
    (`load_version`). The keyword arguments are `VLLMEngine`'s, plus ``inflight_kv`` and
    ``max_versions_per_sample`` (the module docstring); LoRA adapters are not supported (merge them)."""

    supports_inflight_updates = True  # `generate(..., updates=)` loads newer weights while its groups run

    def __init__(self, folder, *, eos_token_id: int, inflight_kv: str = "recompute",
                 max_versions_per_sample: int = 0, version: int = 0, **kwargs):
        if inflight_kv not in INFLIGHT_KV:
            raise SamplingError(f"inflight_kv={inflight_kv!r}: choose recompute (exact log-probs after an update) or "
                                "keep (no recomputation; log-probs after an update are those of neither version)")
        if not isinstance(max_versions_per_sample, int) or max_versions_per_sample < 0:
            raise SamplingError(f"max_versions_per_sample={max_versions_per_sample!r}: give an integer >= 0 (0: no "
                                "bound; 1: no sample is drawn by two versions)")
        if kwargs.get("lora_rank"):
            raise SamplingError("the streaming vLLM engine does not load LoRA adapters: merge them into the weights "
                                "(lora.apply: merged) or turn runtime.vllm_streaming off")
        self.inflight_kv = inflight_kv
        self.max_versions = max_versions_per_sample
        self.version = version  # the version of the weights vLLM holds (its label on every token it draws)
        self.stats: Counter = Counter()  # restarted, weights_refused, request_errors, updates_in_flight
        self._groups: dict[int, _Group] = {}
        self._keys = itertools.count()
        self._loop = LoopThread("heterorl-vllm-stream")
        if inflight_kv == "keep":  # a new request must never start from keys and values of older weights
            kwargs.setdefault("enable_prefix_caching", False)
        super().__init__(folder, eos_token_id=eos_token_id, **kwargs)

    def _start(self, engine_args: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        async def start():
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
            await llm.update_weight_version(str(self.version))
            return llm

        self.llm = self._loop.run(start())

    # ------------------------------------------------------------------------------------------------ sampling
    def submit(self, prompt: Sequence[int], params: SamplingParams, num_samples: int = 1) -> concurrent.futures.Future:
        """Start one group; a future of its ``num_samples`` `SampleOutput` s (each with ``versions``), done when the
        last one ends. ``params.seed`` seeds the group. A bad prompt or setting raises `SamplingError` here."""
        prompt = validate_request([prompt], params, num_samples, self.vocab_size, self.max_positions)[0]
        group = _Group(next(self._keys), prompt, params, num_samples)
        self._loop.loop.call_soon_threadsafe(self._launch, group)
        return group.future

    def _launch(self, group: _Group) -> None:  # on the loop
        group.attempt += 1
        group.tokens_out, group.versions_seen, group.restarting = 0, 1, False
        self._groups[group.key] = group
        group.task = asyncio.get_running_loop().create_task(self._run(group, group.attempt))
        group.task.add_done_callback(functools.partial(self._ended, group))

    async def _run(self, group: _Group, attempt: int) -> list[SampleOutput]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        n = group.num_samples
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        spans: list = [None] * n
        params = self._params(group.params, n, group.params.seed, output_kind=RequestOutputKind.DELTA)
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=group.prompt), params,
                                           request_id=f"g{group.key}-{attempt}", lora_request=self._lora_request):
            for completion in out.outputs:
                tokens[completion.index].extend(completion.token_ids)
                logprobs[completion.index].extend(completion.logprobs or ())
                finish[completion.index] = completion.finish_reason or finish[completion.index]
                spans[completion.index] = completion.weight_versions or spans[completion.index]
            group.tokens_out = sum(map(len, tokens))
        samples = []
        for i in range(n):
            sample = sample_output(tokens[i], logprobs[i], finish[i], group.params, self.eos_token_id)
            sample.versions = _versions(spans[i], len(tokens[i]), self.version)
            samples.append(sample)
        return samples

    def _ended(self, group: _Group, task: asyncio.Task) -> None:  # on the loop
        if task.cancelled():
            if group.restarting:  # aborted to start again (`max_versions_per_sample`)
                self._launch(group)
                return
            self._groups.pop(group.key, None)
            if not group.future.done():
                group.future.cancel()
            return
        self._groups.pop(group.key, None)
        if group.future.done():  # its caller cancelled it (a worker at the end of its run)
            return
        error = task.exception()
        if error is None:
            group.future.set_result(task.result())
            return
        self.stats["request_errors"] += 1
        if isinstance(error, SamplingError):
            group.future.set_exception(error)
        else:  # vLLM wraps the cause (EngineGenerateError from ...)
            cause = error.__cause__ or error
            group.future.set_exception(SamplingError(f"vLLM failed this group's request: {type(cause).__name__}: "
                                                     f"{cause}"))

    def in_flight_tokens(self) -> list[int]:
        """Tokens drawn so far by each group in flight (its current attempt)."""
        return self._loop.run(self._progress())

    async def _progress(self) -> list[int]:
        return [g.tokens_out for g in self._groups.values()]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, num_samples: int = 1,
                 updates: WeightUpdates | None = None) -> list[list[SampleOutput]]:
        """Every prompt submitted as its own group (prompt ``i`` seeded ``params.seed + i``); with ``updates``,
        newer weights are loaded while they run (`load_version`)."""
        prompts = validate_request(prompts, params, num_samples, self.vocab_size, self.max_positions)
        futures = [self.submit(p, params if params.seed is None else replace(params, seed=params.seed + i),
                               num_samples) for i, p in enumerate(prompts)]
        if updates is not None:
            while not all(f.done() for f in futures):
                concurrent.futures.wait(futures, timeout=POLL_S, return_when=concurrent.futures.ALL_COMPLETED)
                got = updates.poll()
                if got is not None:
                    self.load_version(*got)
        return [f.result() for f in futures]

    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs through vLLM's prompt log-probs (the unmodified model, temperature 1)."""
        sequences = validate_prompts(sequences, self.vocab_size)
        return self._loop.run(self._prompt_logprobs(sequences))

    async def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm.inputs import TokensPrompt

        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)

        async def one(seq: list[int]) -> list[float]:
            last = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=seq), params,
                                               request_id=f"lp{next(self._keys)}", lora_request=self._lora_request):
                last = out
            return [float(step[token].logprob) for step, token in zip(last.prompt_logprobs[1:], seq[1:])]

        return list(await asyncio.gather(*(one(s) for s in sequences)))

    # ------------------------------------------------------------------------------------------------- weights
    def load_state_dict(self, state_dict) -> None:
        """`load_version` as the next version number."""
        self.load_version(self.version + 1, state_dict)

    def load_version(self, version: int, state_dict) -> None:
        """Load policy version ``version`` now, while groups are in flight (the module docstring says what becomes of
        them). Weights that do not fit the model are refused before anything is paused."""
        if getattr(state_dict, "adapter", None):
            raise SamplingError("the streaming vLLM engine does not load LoRA adapters: merge them into the weights "
                                "(lora.apply: merged)")
        try:
            state = {name: t.detach().cpu().contiguous() for name, t in self.check_state_dict(state_dict).items()}
        except SamplingError:
            self.stats["weights_refused"] += 1
            raise
        self._loop.run(self._update(version, state))

    async def _update(self, version: int, state: dict) -> None:
        started = time.monotonic()
        in_flight = list(self._groups.values())
        await self.llm.pause_generation(mode="keep", clear_cache=self.inflight_kv == "recompute")
        try:
            await self.llm.collective_rpc(functools.partial(_reload_in_worker, weights=state))
            await self.llm.update_weight_version(str(version))
            self.version = version
            if in_flight:
                self.stats["updates_in_flight"] += 1
            for group in in_flight:
                if group.tokens_out > 0:  # (a group that has drawn nothing yet is drawn by the new version alone)
                    group.versions_seen += 1
                if self.max_versions and group.versions_seen > self.max_versions and group.task is not None:
                    self.stats["restarted"] += 1
                    group.restarting = True
                    group.task.cancel()  # vLLM aborts its request; `_ended` starts it again
        finally:
            await self.llm.resume_generation()
        self.stats["update_ms"] += int(1000 * (time.monotonic() - started))

    def close(self) -> None:
        """Stop vLLM's engine processes and the event loop."""
        llm = self.__dict__.pop("llm", None)
        loop = self._loop._loop
        try:
            if loop is not None:  # vLLM's output handler first: left running, it logs the engine's stop as its death
                self._loop.submit(_cancel_all()).result(timeout=10)
        finally:
            if llm is not None:
                llm.shutdown()
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)


async def _cancel_all() -> None:
    """Cancel every task left on the engine's loop (vLLM's output handler, groups not collected) and let them end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _versions(spans, count: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's weight-version spans (``[(version, start, end)]`` over the output tokens)."""
    versions = [fallback] * count
    for span in spans or ():
        for i in range(max(0, span.start), min(count, span.end)):
            versions[i] = int(span.version)
    return versions
