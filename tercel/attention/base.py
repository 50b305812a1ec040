"""The attention backend interface: one file per backend (torch_ref, triton_backend).

  prepare(batch, block_size)            eager forwards: metadata from the batch, host values allowed
  capture_metadata(batch, block_size, t) graph forwards: metadata for a uniform batch (t queries per
                                        request) from device tensors and static shapes only; it is
                                        called inside the captured region, so replays recompute it
  init_capture(max_requests, t)         once before capturing: allocate static metadata buffers
  prepare_replay(batch, num_live)       before each replay, outside the graph: refresh what only the
                                        host knows (planners, host seq lens); most backends need none
  forward(layer, q, k, v, batch, meta, kv)  per layer: store k/v at out_cache_loc, attend
  fuses_rope / forward_rope(...)        backends that rotate q/k and store k/v in one kernel (prefetch: a
                                        weight the caller reads next, a hint to pull into cache meanwhile)
"""
from __future__ import annotations

from typing import Any

import torch

from ..forward_batch import ForwardBatch
from ..kv import PagedKVCache


class AttentionBackend:
    fuses_rope: bool = False

    def prepare(self, batch: ForwardBatch, block_size: int) -> Any:
        raise NotImplementedError

    def capture_metadata(self, batch: ForwardBatch, block_size: int, tokens_per_request: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a CUDA graph.")

    def init_capture(self, max_requests: int, tokens_per_request: int) -> None:
        return None

    def prepare_replay(self, batch: ForwardBatch, num_live: int) -> None:
        return None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                meta: Any, kv: PagedKVCache) -> torch.Tensor:
        raise NotImplementedError

    def forward_rope(self, layer: int, qk: torch.Tensor, v: torch.Tensor,
                     cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, meta: Any,
                     kv: PagedKVCache, prefetch: torch.Tensor | None = None,
                     norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not fuse RoPE.")

    def stores_rope_apart(self, meta: Any, qk: torch.Tensor) -> bool:
        """Whether forward_rope can finish a norm folded into the qkv weight for this batch (norm_of)."""
        return False
