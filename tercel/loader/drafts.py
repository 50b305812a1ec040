"""Load speculative draft checkpoints (config.json + safetensors, never pickles) into the draft models of
tercel.models: EAGLE-3 / EAGLE heads (models/eagle3.py) and DFlash block drafters (models/dflash.py).
The models define their structure and weight names; this module reads the files."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..models.dflash import DFlashConfig, DFlashDraftModel, sort_target_layers
from ..models.eagle3 import EagleDraftConfig, EagleDraftModel
from ..models.linear import prepack_for_cpu
from ..models.rope import RotaryEmbedding
from . import hf


def read_draft_config(path: str | Path, target: ModelConfig) -> EagleDraftConfig:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"draft model path {str(path)!r} is not a directory with config.json + *.safetensors.")
    return EagleDraftConfig.from_dict(hf.hf_config(path), target, str(path / "config.json"))


def _has_head(cfg: EagleDraftConfig, names: set[str], path: Path) -> bool:
    """Whether an EAGLE-3 checkpoint brings its own lm_head; without one (and untied) the target's
    head serves, which needs the full vocabulary."""
    if cfg.kind != "eagle3" or cfg.tie_word_embeddings or "lm_head.weight" in names:
        return True
    if cfg.draft_vocab_size != cfg.layers.vocab_size:
        raise ConfigError(f"{path}: no lm_head.weight, so the target's lm_head would be used, but "
                          f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.layers.vocab_size}; add the "
                          f"draft's lm_head.weight or drop draft_vocab_size from config.json.")
    return False


def load_eagle_draft(path: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                     max_positions: int) -> EagleDraftModel:
    """Load an EAGLE-3 or EAGLE draft directory (config.json + safetensors, never pickles) for `target`."""
    path = Path(path)
    cfg = read_draft_config(path, target)
    files = hf.safetensors_files(path)
    names = set()
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(n.removeprefix("model.") for n in st.keys())
    with torch.device("meta"):
        model = EagleDraftModel(cfg, max_positions, dtype, has_embed="embed_tokens.weight" in names,
                                has_head=_has_head(cfg, names, path))
    model = model.to(dtype).to_empty(device=device)
    model.rope = RotaryEmbedding(cfg.layers, max_positions, dtype).to(device)
    model.draft_to_target = torch.arange(cfg.draft_vocab_size, device=device)
    model.load_weights(hf.iter_safetensors(files), str(path))
    model = model.eval().requires_grad_(False)
    prepack_for_cpu(model, device, dtype)
    return model


def load_dflash(path: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> DFlashDraftModel:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"DFlash draft path {path} is not a directory with config.json + *.safetensors.")
    cfg = DFlashConfig.from_dict(hf.hf_config(path), target, str(path / "config.json"))
    with torch.device("meta"):
        model = DFlashDraftModel(cfg, max_positions, dtype)
    model = model.to(dtype).to_empty(device=device)
    model.rope = RotaryEmbedding(cfg.layers, max_positions, dtype).to(device)
    model.load_weights(hf.iter_safetensors(hf.safetensors_files(path)), str(path))
    sort_target_layers(model)
    model = model.eval().requires_grad_(False)
    prepack_for_cpu(model, device, dtype)
    return model
