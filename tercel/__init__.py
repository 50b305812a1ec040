"""Tercel: a compact speculative-decoding LLM inference engine."""
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
