"""HF checkpoint directories: config.json + single or sharded *.safetensors (never pickles)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import ConfigError


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-export the checkpoint.") from e


def hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json; pass an HF model directory or a .gguf file.")
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config fields; "
                          f"re-export the checkpoint.")
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map'; re-export the checkpoint.")
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shard(s) that do not exist: {missing}.")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{model_dir} has no *.safetensors weights (pickled .bin files are not loaded: convert them "
            f"with `safetensors` first)."
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read safetensors file {f}: {e} (the file is corrupt or truncated; "
                              f"re-download or re-export the checkpoint).") from e


def count_tensors(files: list[Path]) -> int:
    from safetensors import SafetensorError, safe_open

    n = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                n += len(list(st.keys()))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read safetensors file {f}: {e} (the file is corrupt or truncated; "
                              f"re-download or re-export the checkpoint).") from e
    return n
