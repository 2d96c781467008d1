"""Sampling engines behind ``SamplingEngine``: ``TorchEngine`` (CPU/GPU, any HF causal LM), and the teacher-forced
log-probs it shares with training (``logprobs``). A loop gets its engine from ``SamplingClient.for_model``."""

from heterorl.engines.base import SampleOutput, SamplingEngine, SamplingParams
from heterorl.engines.torch_engine import TorchEngine

__all__ = ["SampleOutput", "SamplingEngine", "SamplingParams", "TorchEngine"]
