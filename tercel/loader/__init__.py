"""Checkpoint loading: HF directories (safetensors) and GGUF files, plus tokenizers.

The names below load on first use, so the torch-free modules here (paths, cache) import without torch."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = ["LoadedModel", "load_model", "resolve_model_path"]

if TYPE_CHECKING:
    from .model_loader import LoadedModel, load_model
    from .paths import resolve_model_path


def __getattr__(name: str) -> Any:
    if name in ("LoadedModel", "load_model"):
        return getattr(import_module(".model_loader", __name__), name)
    if name == "resolve_model_path":
        return getattr(import_module(".paths", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
