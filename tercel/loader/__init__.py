"""Checkpoint loading: HF directories (safetensors) and GGUF files, plus tokenizers."""
from .model_loader import LoadedModel, load_model, resolve_model_path

__all__ = ["LoadedModel", "load_model", "resolve_model_path"]
