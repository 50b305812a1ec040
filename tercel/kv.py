"""Paged KV cache: one slab of fixed-size blocks per layer, and a free-list block allocator.

Block 0 is reserved as the dummy block: padded tokens (CUDA-graph padding policy) write there,
so they can never touch a live request's KV.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ConfigError, EngineConfig, ModelConfig

DUMMY_BLOCK = 0


class BlockAllocator:
    """Reference-counted blocks. A block whose KV the prefix cache published (tercel.prefix_cache) keeps
    its content key when its last holder lets go: it stays findable by that key, and is evicted (oldest
    first) only when a fresh block is needed and the free list is empty."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ConfigError(f"KV pool has {num_blocks} blocks; at least 2 are needed (one is reserved).")
        self.num_blocks = num_blocks
        # LIFO free list: recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))
        self._refs = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently freed first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no request holds (reusable by a prefix hit, evictable under pressure)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks findable by content, held or not."""
        return len(self._by_key)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        take = min(n, len(self._free))
        out = self._free[len(self._free) - take:][::-1]
        del self._free[len(self._free) - take:]
        for _ in range(n - take):
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key[block]]
            self._key[block] = None
            self.num_evictions += 1
            out.append(block)
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last tail block goes first (evicted before the head)."""
        released = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None
                else:
                    released.append(b)
        self._free.extend(released)

    # ---- content keys (the prefix cache) ------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def share(self, block: int) -> None:
        """One more holder of a cached block (a prefix hit)."""
        self._refs[block] += 1
        self._evictable.pop(block, None)

    def publish(self, block: int, key: bytes) -> None:
        """Make a held, fully written block findable by key. A key already cached (two requests computed
        the same content at once) keeps its first block; this one stays private and is freed as usual."""
        if self._key[block] is None and key not in self._by_key:
            self._key[block] = key
            self._by_key[key] = block

    def ref_count(self, block: int) -> int:
        return self._refs[block]


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
        self.table_cuts = 0  # block tables cut in place so far (batching.TableRows repacks after one)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's k/v at slots src copied to dst (accepted tree nodes compacted after a verify)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def free_unused_blocks(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the blocks of block_table past those num_tokens need (in place)."""
        need = -(-num_tokens // self.block_size)
        if len(block_table) > need:
            self.allocator.free(block_table[need:])
            del block_table[need:]
            self.table_cuts += 1


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
