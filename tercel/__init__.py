"""Tercel: a compact speculative-decoding LLM inference engine.

The public names load on first use (PEP 562), so `tercel --help`, `--version` and the command lines'
flag checks answer before torch is imported."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {"LLM": ".llm", "LLMEngine": ".engine", "SamplingParams": ".sampling_params",
            "RequestOutputKind": ".sampling_params", "RequestOutput": ".outputs", "CompletionOutput": ".outputs"}
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from .engine import LLMEngine
    from .llm import LLM
    from .outputs import CompletionOutput, RequestOutput
    from .sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tercel' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
