"""Rotary position embedding tables (default, linear and llama3 scaling), HF's rotate-half layout."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inv_frequencies(cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # one [P, 2D] table, cos then sin: a forward gathers both with one index kernel
        self.register_buffer("cos_sin", torch.cat((emb.cos(), emb.sin()), dim=-1).to(dtype), persistent=False)
        self.dim = emb.shape[-1]

    @property
    def cos(self) -> torch.Tensor:
        return self.cos_sin[:, :self.dim]

    @property
    def sin(self) -> torch.Tensor:
        return self.cos_sin[:, self.dim:]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for these positions, shaped [T, 1, D] to broadcast over heads (once per forward;
        views of one gathered [T, 2D] block, rows strided by 2D)."""
        rows = self.cos_sin[positions][:, None, :]
        return rows[..., :self.dim], rows[..., self.dim:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads together)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
