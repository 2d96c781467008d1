"""Training-session primitives, modelled on hosted training-session APIs (Tinker).

The user owns data, reward and loop; these clients own the model:

    training = TrainingClient(model, tokenizer)
    sampler = training.save_weights_and_get_sampling_client()
    result = sampler.sample(prompt_tokens, num_samples=8, sampling_params=SamplingParams()).result()
    training.forward_backward(datums, loss_fn="grpo").result()
    training.optim_step(AdamParams(learning_rate=1e-4)).result()

Every call returns a future; calls on one client run one at a time, in
submission order, on the client's worker thread.
"""

from __future__ import annotations

import copy
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

import gepo
from heterorl.config import LoraConfig
from heterorl.engines import packing
from heterorl.engines.base import GenerationWatch, SampleOutput, SamplingEngine, SamplingParams, WeightUpdates
from heterorl.engines.logprobs import completion_logprobs
from heterorl.engines.torch_engine import TorchEngine
from heterorl.errors import HeteroRLError, SamplingError
from heterorl.policies.storage import storage_key
from heterorl.training import microbatches, precision
from heterorl.training.primitives import (  # noqa: F401 (the primitives' values, imported from here as well)
    MAX_LEARNING_RATE,
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    check_datums,
)
from heterorl.training.states import TrainingStates, read_training_state

LossFnArg = str | Callable[[gepo.LossBatch, Any], "tuple[torch.Tensor, dict[str, float]]"]


class _SerialExecutor:
    """Runs submitted calls one at a time, in submission order, returning futures."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking calls; ``wait``: until the queued ones ran; ``cancel_futures``: drop the queued ones."""
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _report_all(watch: GenerationWatch, groups: list[list[SampleOutput]]) -> None:
    """Give ``watch`` a finished generation's tokens step by step, as an engine that reports them would have."""
    rows = [sample for group in groups for sample in group]
    for step in range(max((len(s.tokens) for s in rows), default=0)):
        live = [r for r, s in enumerate(rows) if step < len(s.tokens)]
        watch.tokens(live, [rows[r].tokens[step] for r in live], [rows[r].logprobs[step] for r in live])


class SamplingClient:
    """Samples from a frozen snapshot of the policy at version ``version``."""

    def __init__(self, engine: SamplingEngine, tokenizer, version: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.version = version
        self._executor = _SerialExecutor("sampling-client")

    @classmethod
    def for_model(cls, model, tokenizer, *, device: str = "cpu", version: int = -1) -> SamplingClient:
        """A sampler over ``model`` itself (no copy) with the default engine: the one place a loop's choice of
        engine is made. ``version`` -1: it holds no policy version yet (see `load_weights`)."""
        return cls(TorchEngine(model, tokenizer, device=device), tokenizer, version)

    def load_weights(self, version: int, state: dict) -> None:
        """Replace the weights with policy version ``version`` (a state dict, as
        `TrainingClient.save_weights_for_sampler` makes), between samples: a sample in progress finishes with
        the weights it started with."""
        def load() -> None:
            load_version = getattr(self.engine, "load_version", None)  # an engine that stamps versions on tokens
            if load_version is not None:
                load_version(version, state)
            else:
                self.engine.load_state_dict(state)
            self.version = version

        self._executor.submit(load).result()

    def sample(
        self, prompt_tokens: Sequence[int] | Sequence[Sequence[int]], num_samples: int = 1,
        sampling_params: SamplingParams | None = None, *, weight_updates: Callable | None = None,
        watch: GenerationWatch | None = None, reuse_prefixes: bool = False,
    ) -> Future:
        """Future of ``list[SampleOutput]`` (one prompt) or ``list[list[SampleOutput]]`` (a list of prompts).

        ``weight_updates``: in-flight updates, for an engine that takes them (`SamplingEngine.
        supports_inflight_updates`): a callable polled between decode steps that returns (version, state dict)
        of newer weights or None; the engine loads them at once and each sample's ``versions`` names the
        version that drew each token. The sampler then holds the newest version loaded.

        ``watch`` (`GenerationWatch`): the tokens as they are drawn, and a cancel that stops the generation
        between decode steps (`GenerationCancelled`); its ``version`` is set to the version that generates. An
        engine without ``supports_watch`` honours a cancel only before it starts, and reports every token at
        the end.

        ``reuse_prefixes``: the engine keeps each context it generated from, and a prompt that extends one
        prefills only its new tokens (`SamplingEngine.supports_prefix_reuse`; ignored by an engine without)."""
        params = sampling_params or SamplingParams()
        single = len(prompt_tokens) > 0 and isinstance(prompt_tokens[0], int)
        prompts = [prompt_tokens] if single else prompt_tokens
        if weight_updates is not None and not self.engine.supports_inflight_updates:
            raise SamplingError(f"{type(self.engine).__name__} cannot take weights during a generation: sample "
                                "without weight_updates and load new weights between samples (load_weights)")

        def run() -> list:
            extra = {}
            if watch is not None:
                watch.check()
                watch.version = self.version
                if self.engine.supports_watch:
                    extra["watch"] = watch
            if reuse_prefixes and self.engine.supports_prefix_reuse:
                extra["reuse_prefixes"] = True
            if weight_updates is None:
                groups = self.engine.generate(prompts, params, num_samples, **extra)
            else:
                updates = WeightUpdates(self.version, weight_updates)
                try:
                    groups = self.engine.generate(prompts, params, num_samples, updates=updates, **extra)
                finally:
                    self.version = updates.version
            if watch is not None and not self.engine.supports_watch:
                _report_all(watch, groups)
            for group in groups:
                for sample in group:
                    sample.text = self.tokenizer.decode(sample.tokens, skip_special_tokens=True)
            return groups[0] if single else groups

        return self._executor.submit(run)

    def compute_logprobs(self, tokens: Sequence[int]) -> Future:
        """Future of the teacher-forced log-probs of ``tokens[1:]``."""
        return self._executor.submit(lambda: self.engine.compute_logprobs([tokens])[0])

    def close(self) -> None:
        """Finish the queued calls, then release the engine."""
        self._executor.shutdown()
        self.engine.close()


def resolve_loss(loss_fn: LossFnArg, loss_config) -> tuple[Callable, Any]:
    """The loss function and its config for ``loss_fn`` (a registered gepo loss name, or a callable passed
    through) and ``loss_config`` (a dict of options, a config object, or None for the defaults); HeteroRLError
    naming the problem for an unknown loss or option."""
    if callable(loss_fn):
        return loss_fn, loss_config
    try:
        spec = gepo.get_loss(loss_fn)
        config = loss_config if loss_config is not None and not isinstance(loss_config, dict) else \
            gepo.make_loss_config(loss_fn, loss_config)
    except (KeyError, ValueError, TypeError) as exc:
        raise HeteroRLError(str(exc).strip("'\"")) from None
    return spec.fn, config


class TrainingClient:
    """Owns the trainable model, its optimizer and the policy version counter.

    ``seed`` (optional) seeds torch's global RNG, so runs that pass one are reproducible.
    """

    def __init__(self, model, tokenizer, *, device: str = "cpu", seed: int | None = None,
                 data_parallel: bool = False, shard: bool = False, share_prompts: bool = True,
                 lora: LoraConfig | None = None, tokens_per_microbatch: int = 0,
                 activation_checkpointing: bool = False, train_dtype: str = "float32"):
        """``data_parallel``: when torch.distributed is initialised with several ranks, wrap the model in
        DistributedDataParallel (gloo on CPU, NCCL on GPU) so ``forward_backward`` averages gradients over the
        ranks; every rank must then call the same primitives in the same order.

        ``shard`` (with several ranks): shard the model with FSDP2 instead (`heterorl.training.sharding`): each
        rank holds 1/world of the parameters, gradients and optimizer state, and gets the same updates as under
        DDP. Whole weights exist only on rank 0, gathered by every export (``save_weights_for_sampler``, a
        snapshot): a collective, so every rank calls it; samplers and ``full_model`` live on rank 0 (the other
        ranks get None). States are folders written by every rank (DCP; `save_state` / `load_state`).

        ``share_prompts``: run a prompt that several datums repeat once per forward (a group's completions
        packed into one row behind it, each seeing only the prompt and itself): same log-probs and gradients,
        a fraction of the tokens. Off, whole datums are still packed several to a row where the model allows it
        (their position ids restarting, `heterorl.engines.packing`).

        ``lora`` (``rank`` > 0): train a low-rank adapter on the frozen model (heterorl.training.lora): only the
        adapter has gradients and optimizer state, `save_state` writes only it (with its config and the base's
        digest, checked on load), and `save_weights_for_sampler` exports the merged weights or the adapter.

        ``tokens_per_microbatch`` (> 0): a ``forward_backward`` runs the model on micro-batches of at most that many
        tokens (`heterorl.training.microbatches`): the same loss and gradients, memory set by that number, one
        more forward without gradients. 0: the whole call at once. ``activation_checkpointing`` and
        ``train_dtype`` ("bfloat16": autocast): `heterorl.training.precision`."""
        if seed is not None:  # (first: a LoRA adapter's initial A is drawn from it)
            torch.manual_seed(seed)
        self.lora = lora if lora is not None and lora.enabled else None
        self.base_hash: str | None = None  # LoRA: the digest of the frozen base (`lora.base_hash`)
        if self.lora is not None:
            from heterorl.training import lora as lora_lib

            if shard:
                raise HeteroRLError("LoRA with a sharded client is not supported: the adapter is small; shard=False")
            model = model.to(device)
            self.base_hash = lora_lib.base_hash(model)
            model = lora_lib.attach(model, self.lora)
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.share_prompts = share_prompts
        self.tokens_per_microbatch = tokens_per_microbatch
        self.train_dtype = train_dtype
        precision.autocast(device, train_dtype)  # (an unknown dtype is refused here, not at the first call)
        if activation_checkpointing:
            precision.checkpoint_activations(self.model)
        self.version = 0
        self.step = 0
        self.optimizer: torch.optim.AdamW | None = None
        self._executor = _SerialExecutor("training-client")
        self._forward_model = self.model
        self.sharded = shard and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self._mirror = None  # sharded: rank 0's whole copy, as of the last export
        if self.sharded:
            self._setup_sharding()
        elif data_parallel and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self._forward_model = DistributedDataParallel(self.model, device_ids=ids)  # syncs rank 0's weights
        self._states = TrainingStates(self.model, self.lora, self.base_hash, self.device, self.sharded)

    def _setup_sharding(self) -> None:
        from heterorl.training import sharding

        self._aliases = sharding.tied_names(self.model)
        self._shape = sharding.skeleton(self.model)
        if torch.distributed.get_rank() == 0:
            whole = {name: t.detach().to("cpu", copy=True) for name, t in self.model.state_dict().items()}
            self._mirror = sharding.build_from(self._shape, whole, self.device)
        sharding.fully_shard_model(self.model)

    @property
    def full_model(self) -> torch.nn.Module | None:
        """The whole model: the training model itself, or, sharded, rank 0's copy as of the last export (None on
        the other ranks)."""
        return self._mirror if self.sharded else self.model

    # -- loss computation -------------------------------------------------
    def _loss_batch(self, datums: Sequence[Datum], with_grad: bool, temperature: float = 1.0,
                    completion_logprobs: torch.Tensor | None = None) -> gepo.LossBatch:
        """The loss's batch of ``datums``, their log-probs taken here (``with_grad`` or not) unless given."""
        check_datums(datums, temperature)
        if completion_logprobs is None:
            completion_logprobs = self._completion_logprobs(datums, with_grad, temperature)
        width = completion_logprobs.shape[1]
        mask = torch.zeros((len(datums), width), device=self.device)
        behaviour = torch.zeros_like(mask) if datums[0].behaviour_logprobs is not None else None
        versions = torch.zeros_like(mask, dtype=torch.long) if datums[0].policy_versions is not None else None
        for i, d in enumerate(datums):
            n = d.completion_len
            mask[i, :n] = torch.tensor(d.weights) if d.weights is not None else 1.0
            if behaviour is not None:
                if d.behaviour_logprobs is None:
                    raise HeteroRLError(f"datum {i} has no behaviour_logprobs but datum 0 does: give all or none")
                behaviour[i, :n] = torch.tensor(d.behaviour_logprobs)
            if versions is not None:
                if d.policy_versions is None:
                    raise HeteroRLError(f"datum {i} has no policy_versions but datum 0 does: give all or none")
                versions[i, :n] = torch.tensor(d.policy_versions)

        def per_datum(name: str, dtype) -> torch.Tensor | None:
            values = [getattr(d, name) for d in datums]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise HeteroRLError(f"datum {values.index(None)} has no {name} but others do: give all or none")
            return torch.tensor(values, dtype=dtype, device=self.device)

        return gepo.LossBatch(
            logprobs=completion_logprobs,
            mask=mask,
            behaviour_logprobs=behaviour,
            advantages=per_datum("advantage", torch.float32),
            rewards=per_datum("reward", torch.float32),
            group_ids=per_datum("group_id", torch.long),
            policy_versions=versions,
            current_version=self.version,
        )

    def _completion_logprobs(self, datums: Sequence[Datum], with_grad: bool, temperature: float) -> torch.Tensor:
        """(B, longest completion) log-probs of each datum's completion tokens; past a completion's end, garbage.

        Padding-free where the model allows it and it pays (`heterorl.engines.packing.plan`): datums that repeat a
        prompt (a group's completions) behind one copy of it (``share_prompts=False`` turns that off), or
        whole sequences one after another, several to a row."""
        forward_model = self._forward_model if with_grad else self.model
        tokens, prompt_lens = [d.tokens for d in datums], [d.prompt_len for d in datums]
        with torch.set_grad_enabled(with_grad), precision.autocast(self.device, self.train_dtype):
            rows = packing.plan(self.model, tokens, prompt_lens, self.share_prompts)
            if rows is not None:
                return packing.packed_completion_logprobs(self.model, tokens, prompt_lens, rows, self.pad_token_id,
                                                          temperature, forward_model, self.device)
            return completion_logprobs(self.model, tokens, prompt_lens, self.pad_token_id, temperature,
                                       forward_model, self.device)

    def _run_loss(self, datums, loss_fn, loss_config, backward: bool, temperature: float) -> ForwardBackwardOutput:
        fn, config = resolve_loss(loss_fn, loss_config)
        self.model.train(backward)
        check_datums(datums, temperature)
        batches = microbatches.split([d.tokens for d in datums], [d.prompt_len for d in datums],
                                     self.tokens_per_microbatch if backward else 0)
        if len(batches) > 1:
            return self._run_loss_in_microbatches(datums, fn, config, batches, temperature)
        batch = self._loss_batch(datums, with_grad=backward, temperature=temperature)
        loss, metrics = fn(batch, config)
        if not torch.isfinite(loss):
            raise HeteroRLError(f"loss is {float(loss)} (not finite); metrics: {metrics}")
        if backward:
            loss.backward()
        logprobs = [batch.logprobs[i, : d.completion_len].detach().cpu().tolist() for i, d in enumerate(datums)]
        return ForwardBackwardOutput(loss=float(loss.detach()), metrics=metrics, logprobs=logprobs)

    def _run_loss_in_microbatches(self, datums, fn, config, batches: list[list[int]],
                                  temperature: float) -> ForwardBackwardOutput:
        """`_run_loss` with gradients, in micro-batches of at most ``tokens_per_microbatch`` tokens
        (`heterorl.training.microbatches`): the same loss and gradients, one more forward without gradients."""
        def loss_of(logprobs: torch.Tensor):
            loss, metrics = fn(self._loss_batch(datums, False, temperature, logprobs), config)
            if not torch.isfinite(loss):
                raise HeteroRLError(f"loss is {float(loss.detach())} (not finite); metrics: {metrics}")
            return loss, metrics

        loss, metrics, logprobs = microbatches.backward(
            batches, [d.completion_len for d in datums],
            lambda indices, grad: self._completion_logprobs([datums[i] for i in indices], grad, temperature),
            loss_of, getattr(self._forward_model, "no_sync", None))
        return ForwardBackwardOutput(loss=float(loss), metrics=metrics, logprobs=[
            logprobs[i, :d.completion_len].cpu().tolist() for i, d in enumerate(datums)])

    # -- primitives ---------------------------------------------------------
    def forward(self, datums: Sequence[Datum], loss_fn: LossFnArg = "cross_entropy", loss_config=None, *,
                temperature: float = 1.0) -> Future:
        """Future of ``ForwardBackwardOutput`` without touching gradients (see ``forward_backward``)."""
        return self._executor.submit(self._run_loss, list(datums), loss_fn, loss_config, False, temperature)

    def forward_backward(self, datums: Sequence[Datum], loss_fn: LossFnArg = "cross_entropy", loss_config=None, *,
                         temperature: float = 1.0) -> Future:
        """Future of ``ForwardBackwardOutput``; gradients accumulate until ``optim_step``. A batch the loss refuses
        (``gepo.LossInputError``: inconsistent input, a non-finite loss) raises before ``backward``, so it leaves
        the accumulated gradients as they were.

        ``temperature``: the one the completions were sampled at. The learner's log-probs are then those of
        the same tempered distribution as the behaviour log-probs, so on-policy importance weights are 1."""
        return self._executor.submit(self._run_loss, list(datums), loss_fn, loss_config, True, temperature)

    def _optim_step(self, params: AdamParams) -> OptimStepOutput:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.trainable_parameters(), lr=params.learning_rate, betas=(params.beta1, params.beta2),
                eps=params.eps, weight_decay=params.weight_decay,
            )
        for group in self.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        trainable = self.trainable_parameters()
        if not any(p.grad is not None for p in trainable):
            raise HeteroRLError("optim_step called with no gradients: call forward_backward first")
        max_norm = params.grad_clip_norm if params.grad_clip_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # (sharded: a DTensor)
        if not math.isfinite(grad_norm):  # clipping scaled every gradient by 0 (or NaN): a step would teach nothing
            self.optimizer.zero_grad(set_to_none=True)  # (the norm is global, so every data-parallel rank skips)
            return OptimStepOutput(grad_norm=grad_norm, step=self.step, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return OptimStepOutput(grad_norm=grad_norm, step=self.step)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: every one, or with LoRA the adapter's."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def optim_step(self, params: AdamParams | None = None) -> Future:
        """Future of ``OptimStepOutput``: one AdamW step on the accumulated gradients, then zero them. When their
        norm is not finite (inf or NaN) no step is taken, the step count stays, and the output says ``skipped``."""
        return self._executor.submit(self._optim_step, params or AdamParams())

    def frozen_copy(self) -> torch.nn.Module | None:
        """A copy of the model in eval mode with no gradients: a sampler's own weights. Sharded: gathered (every
        rank calls it), on rank 0; None on the others."""
        if self.sharded:
            from heterorl.training.sharding import build_from

            _, state = self._export(bump=False)
            return build_from(self._shape, state, self.device) if state else None
        frozen = copy.deepcopy(self.model).eval()
        if self.lora is not None:  # a plain model with the adapter merged: it samples as fast as the base
            frozen = frozen.merge_and_unload()
        for p in frozen.parameters():
            p.requires_grad_(False)
        return frozen

    def _snapshot(self) -> SamplingClient | None:
        self.version += 1
        frozen = self.frozen_copy()
        if frozen is None:  # a sharded rank > 0: it took part in the gather
            return None
        return SamplingClient.for_model(frozen, self.tokenizer, device=self.device, version=self.version)

    def live_sampling_client(self) -> SamplingClient:
        """A sampler over the training model itself, not a copy: it always samples the current weights (its
        ``version`` stays the one at creation). For evaluation between steps: it must not sample while an
        update runs. No version bump, no copy. Sharded: over rank 0's whole copy, which every export refreshes
        (so it samples the weights of the last export)."""
        if self.sharded and self._mirror is None:
            raise HeteroRLError("a sharded learner samples on rank 0 only (the other ranks hold shards)")
        return SamplingClient.for_model(self.full_model, self.tokenizer, device=str(self.device),
                                        version=self.version)

    def _export(self, bump: bool = True, form: str = "whole") -> tuple[int, dict]:
        if form not in ("whole", "adapter"):
            raise HeteroRLError(f"save_weights_for_sampler(form={form!r}): one of 'whole' (the weights an engine "
                                "loads; with LoRA, merged) or 'adapter' (LoRA's tensors alone)")
        if form == "adapter" and self.lora is None:
            raise HeteroRLError("save_weights_for_sampler(form='adapter') needs a LoRA client "
                                "(create_lora_training_client, or TrainingClient(..., lora=LoraConfig(rank=...)))")
        if bump:
            self.version += 1
        if self.sharded:
            return self.version, self._gather()
        if self.lora is not None:
            from heterorl.training import lora as lora_lib

            if form == "adapter":
                return self.version, lora_lib.adapter_state(self.model)
            return self.version, lora_lib.merged_state(self.model, self.lora)
        copies, state = {}, {}
        for name, tensor in self.model.state_dict().items():  # tied weights stay one tensor (copied once)
            key = storage_key(tensor) or name
            if key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            state[name] = copies[key]
        return self.version, state

    def _gather(self) -> dict:
        """Sharded: the whole weights on rank 0 (``{}`` elsewhere), also loaded into rank 0's copy."""
        from heterorl.training.sharding import gather_full_state

        state = gather_full_state(self.model, self._aliases)
        if state:
            with torch.no_grad():
                for name, tensor in self._mirror.state_dict().items():
                    tensor.copy_(state[name])
        return state

    def _export_shards(self) -> tuple[int, dict]:
        if not self.sharded:
            raise HeteroRLError("save_shards_for_sampler is for a sharded client (shard=True under several ranks)")
        self.version += 1
        return self.version, self.model.state_dict()

    def save_shards_for_sampler(self) -> Future:
        """Sharded: future of (version, this rank's state dict as it holds it: DTensors, each rank's part of
        dim 0), for a fan-out in which every rank sends its own slices (`heterorl.transport.weights.shards`). No
        collective and no copy (the slices are copied when published, before the next call runs); bumps the
        version as `save_weights_for_sampler` does."""
        return self._executor.submit(self._export_shards)

    def refresh_full_model(self) -> Future:
        """Sharded: gather the weights into rank 0's whole copy (``full_model``), as an export does (a collective:
        every rank calls it); not sharded: nothing to do."""
        return self._executor.submit(self._gather if self.sharded else lambda: None)

    def save_weights_for_sampler(self, form: str = "whole") -> Future:
        """Future of (version, state dict): bump the version and copy the weights for remote samplers. Sharded:
        every rank calls it (the weights are gathered); rank 0 gets them, the others an empty dict. With LoRA,
        ``form`` "whole" gives the base with the adapter merged (what any engine loads), "adapter" the adapter's
        tensors alone (`lora.adapter_state`; `adapter_meta` says what they belong to)."""
        return self._executor.submit(self._export, True, form)

    @property
    def adapter_meta(self) -> dict | None:
        """LoRA: the base's digest, rank, alpha and target modules, as a worker checks them; None otherwise."""
        if self.lora is None:
            return None
        from heterorl.training.lora import adapter_meta

        return adapter_meta(self.lora, self.base_hash)

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Bump the policy version and return a sampler over a frozen copy of the current weights."""
        return self.snapshot().result()

    def snapshot(self) -> Future:
        """Future of `save_weights_and_get_sampling_client`'s sampler, in submission order with the other calls."""
        return self._executor.submit(self._snapshot)

    def state_dict(self) -> dict:
        """Weights (with LoRA: the adapter's, its config and the base's digest), optimizer, version, step, RNG."""
        return self._states.state_dict(self.optimizer, self.version, self.step)

    def save_state(self, path) -> Future:
        """Future of the path: weights, optimizer, version, step and RNG, written atomically (a temporary file
        renamed over ``path``: a killed process leaves the old state or the new one, never a torn one)."""
        return self._executor.submit(lambda: self._states.save(path, self.optimizer, self.version, self.step))

    def _load_state(self, state) -> int:
        self.optimizer, self.version, self.step = self._states.load(state, self.optimizer,
                                                                    self.trainable_parameters())
        if self.sharded:
            self._gather()  # rank 0's whole copy holds the loaded weights
        return self.version

    def load_state(self, state) -> Future:
        """Future of the restored version. ``state``: a path `save_state` wrote, or what `read_training_state`
        read from one."""
        return self._executor.submit(self._load_state, state)

    def close(self) -> None:
        self._executor.shutdown()


__all__ = [
    "AdamParams", "Datum", "ForwardBackwardOutput", "OptimStepOutput", "SampleOutput",
    "SamplingClient", "SamplingParams", "TrainingClient", "read_training_state",
]
