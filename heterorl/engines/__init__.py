"""Sampling engines: ``TorchEngine`` (CPU/GPU, any HF causal LM); ``VLLMEngine`` behind the ``[vllm]`` extra."""

from heterorl.engines.base import SampleOutput, SamplingEngine, SamplingParams
from heterorl.engines.torch_engine import TorchEngine

__all__ = ["SampleOutput", "SamplingEngine", "SamplingParams", "TorchEngine"]
