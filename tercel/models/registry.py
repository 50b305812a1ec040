"""HF architecture name -> the Tercel family that serves it: one line per architecture.

Adding a family: its model file (implementing models.interface.TargetModel) and a line here. The module
is named, not imported, so reading a checkpoint's config.json never imports a model's kernels.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelEntry:
    family: str  # ModelConfig.architecture: selects the family's config rules (config.py)
    module: str
    cls: str


MODEL_REGISTRY: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", "tercel.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ModelEntry("mistral", "tercel.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ModelEntry("qwen2", "tercel.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "tercel.models.llama", "LlamaForCausalLM"),
}


def entry_for_family(family: str) -> ModelEntry:
    return next(e for e in MODEL_REGISTRY.values() if e.family == family)


def model_class(family: str) -> type:
    """The nn.Module class that serves a family (a ModelConfig.architecture value)."""
    e = entry_for_family(family)
    return getattr(importlib.import_module(e.module), e.cls)
