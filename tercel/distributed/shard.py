"""How a decoder splits across tensor-parallel ranks, and the checks that run before any weight loads.

Attention heads split evenly; KV heads split too, or, when there are fewer KV heads than ranks, each
rank keeps the one KV head its query heads read (replicated). The MLP's intermediate size and the
vocabulary (embedding rows, lm_head rows) split evenly. The hidden size never splits: every rank
holds the full residual stream, so norms, RoPE and captured hidden states are plain per-rank work.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ConfigError, ModelConfig


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else str(ds[0])


def check_splittable(cfg: ModelConfig, tp_size: int, device: torch.device, ranks_here: int | None = None) -> None:
    """ConfigError naming the numbers and the fix when cfg cannot run on tp_size ranks. ranks_here: the
    ranks on this host (torchrun's LOCAL_WORLD_SIZE; default all of them), each of which needs a GPU."""
    if tp_size == 1:
        return
    if cfg.num_heads % tp_size:
        raise ConfigError(f"tp_size={tp_size} does not divide num_attention_heads={cfg.num_heads}; use tp_size "
                          f"{_divisors(cfg.num_heads)}.")
    kv = cfg.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ConfigError(f"tp_size={tp_size} neither divides num_key_value_heads={kv} nor is a multiple of it; "
                          f"use a tp_size that divides {kv} or that {kv} divides (and divides "
                          f"num_attention_heads={cfg.num_heads}).")
    for name, n in (("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide {name}={n}; use a tp_size that divides it "
                              f"({_divisors(n) if n < 10_000 else 'e.g. 1'}).")
    here = tp_size if ranks_here is None else ranks_here
    if device.type == "cuda" and here > torch.cuda.device_count():
        raise ConfigError(f"tp_size={tp_size} puts {here} ranks on this host but only {torch.cuda.device_count()} "
                          f"GPU(s) are visible; lower tp_size, or start the ranks on several hosts with torchrun "
                          f"(docs/parallel.md).")


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank `rank` of `size`: which heads, KV heads, MLP columns and vocabulary rows it holds."""

    rank: int
    size: int
    head_dim: int
    heads: tuple[int, int]  # [start, end) query heads
    kv_heads: tuple[int, int]  # [start, end) KV heads
    inter: tuple[int, int]  # [start, end) of the MLP's intermediate columns
    vocab: tuple[int, int]  # [start, end) of the vocabulary

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> "TPShard":
        def part(n: int) -> tuple[int, int]:
            k = n // size
            return rank * k, (rank + 1) * k

        kv = cfg.num_kv_heads
        # fewer KV heads than ranks: size // kv consecutive ranks share (replicate) one KV head
        kv_heads = part(kv) if kv % size == 0 else (rank // (size // kv), rank // (size // kv) + 1)
        return cls(rank, size, cfg.head_dim, part(cfg.num_heads), kv_heads, part(cfg.intermediate_size),
                   part(cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: the model class builds its local shapes from it."""
        return replace(cfg, num_heads=self.heads[1] - self.heads[0], num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.inter[1] - self.inter[0], vocab_size=self.vocab[1] - self.vocab[0])

    def slice_of(self, hf_name: str) -> tuple[int, int, int] | str | None:
        """How the HF tensor hf_name is cut for this rank: (dim, start, end); 'rank0' for a row-parallel
        bias (added once: rank 0 keeps it, the others hold zeros); None: replicated whole."""
        hd = self.head_dim
        if ".q_proj." in hf_name:
            return 0, self.heads[0] * hd, self.heads[1] * hd
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            return 0, self.kv_heads[0] * hd, self.kv_heads[1] * hd
        if ".gate_proj." in hf_name or ".up_proj." in hf_name:
            return 0, *self.inter
        if hf_name.endswith(("o_proj.bias", "down_proj.bias")):
            return "rank0"
        if hf_name.endswith("o_proj.weight"):
            return 1, self.heads[0] * hd, self.heads[1] * hd
        if hf_name.endswith("down_proj.weight"):
            return 1, *self.inter
        if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, *self.vocab
        return None
