"""Tercel: a compact speculative-decoding LLM inference engine."""
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
