"""LoRA adapters in the vLLM engine (`make test-vllm`): an adapter version runs beside the weights and samples
what the torch engine samples with the same adapter merged; a second version replaces the first."""

import pytest
import torch

from heterorl.config import LoraConfig
from heterorl.engines import SamplingParams, TorchEngine
from heterorl.errors import SamplingError
from heterorl.policies import load_policy, shipped_policy
from heterorl.training.session import AdamParams, Datum, TrainingClient
from heterorl.transport.client import AdapterWeights

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")

from heterorl.engines.vllm_engine import VLLMEngine  # noqa: E402

POLICY = "arith-hash-sft-base"


def _trained(training: TrainingClient, lr: float) -> AdapterWeights:
    """One step of cross-entropy on sums answered wrong (the greedy answers move), as an adapter version."""
    tokenizer = training.tokenizer
    datums = []
    for a, b in ((123, 456), (905, 17), (48, 600), (999, 999)):
        prompt = tokenizer.encode(f"{a}+{b}=")
        datums.append(Datum(tokens=prompt + tokenizer.encode(f"#### {a + b + 111}"), prompt_len=len(prompt)))
    training.forward_backward(datums, loss_fn="cross_entropy").result()
    training.optim_step(AdamParams(learning_rate=lr)).result()
    _, tensors = training.save_weights_for_sampler("adapter").result()
    return AdapterWeights(tensors, training.adapter_meta)


def test_an_adapter_runs_beside_the_weights_as_the_merged_model_samples():
    _, tokenizer = load_policy(POLICY)
    training = TrainingClient(*load_policy(POLICY), seed=0, lora=LoraConfig(rank=8))
    prompts = [tokenizer.encode(p) for p in ("123+456=", "905+17=", "48+600=", "999+999=")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = VLLMEngine(shipped_policy(POLICY), eos_token_id=tokenizer.eos_token_id, kv_cache_gib=0.25, lora_rank=8)
    try:
        before = [g[0].tokens for g in engine.generate(prompts, params)]
        for lr in (3e-2, 1e-2):  # two versions: the second replaces the first
            engine.load_state_dict(_trained(training, lr))
            expected = TorchEngine(training.frozen_copy(), tokenizer).generate(prompts, params)
            got = engine.generate(prompts, params)
            assert [g[0].tokens for g in got] == [g[0].tokens for g in expected]
            for a, b in zip(got, expected):
                assert max(abs(x - y) for x, y in zip(a[0].logprobs, b[0].logprobs)) < 1e-4
        assert [g[0].tokens for g in got] != before  # the adapter really ran
        sequence = prompts[0] + got[0][0].tokens
        teacher = engine.compute_logprobs([sequence])[0][len(prompts[0]) - 1:]
        assert max(abs(x - y) for x, y in zip(teacher, got[0][0].logprobs)) < 1e-4  # scored with the adapter too
    finally:
        engine.close()


def test_an_engine_started_without_lora_refuses_an_adapter():
    engine = VLLMEngine.__new__(VLLMEngine)  # (no engine process needed to refuse)
    engine._adapters = None
    with pytest.raises(SamplingError, match="without LoRA .*lora.apply=merged"):
        engine.load_state_dict(AdapterWeights({"x.lora_A.weight": torch.zeros(1, 1)}, {"rank": 1}))
