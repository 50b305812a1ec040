"""Paged KV cache: one slab of fixed-size blocks per layer, and a free-list block allocator.

Block 0 is reserved as the dummy block: padded tokens (CUDA-graph padding policy) write there,
so they can never touch a live request's KV.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ConfigError, EngineConfig, ModelConfig

DUMMY_BLOCK = 0


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ConfigError(f"KV pool has {num_blocks} blocks; at least 2 are needed (one is reserved).")
        self.num_blocks = num_blocks
        # LIFO free list: recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return out[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)


class PagedKVCache:
    """k/v: [num_layers, num_blocks * block_size, num_kv_heads, head_dim]; slot = block * block_size + offset."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        # per-layer views made once: indexing k[layer] costs a dispatcher call each time, several per layer per step
        self.k_layers: tuple[torch.Tensor, ...] = self.k.unbind(0)
        self.v_layers: tuple[torch.Tensor, ...] = self.v.unbind(0)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)


def slot_of(block_table: Sequence[int], pos: int, block_size: int) -> int:
    """The KV slot of position pos for a request with this block table (the one slot formula)."""
    return block_table[pos // block_size] * block_size + pos % block_size


CPU_DEFAULT_KV_BYTES = 1 << 30  # the KV byte budget on the CPU when none is given


def blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    return max(0, budget_bytes // spec.bytes_per_block)


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """KV blocks for this process: num_kv_blocks, else the byte budget (GPU: a share of free memory)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = CPU_DEFAULT_KV_BYTES
    return blocks_for_budget(spec, budget)
