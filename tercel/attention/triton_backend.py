"""Attention on the GPU with Tercel's Triton kernels (tercel/kernels/attention.py).

Decode batches and causal verify blocks (as decode rows) use the split-KV decode kernel; everything else
(prefill chunks, trees with custom masks) the extend kernel. RoPE and the K/V store are fused into one kernel
(forward_rope); for decode batches RoPE and the store run inside the split-KV kernel itself
(decode_attention_rope: two launches per layer instead of three; TERCEL_DECODE_ATTN picks, see
tercel/kernels/__init__.py; verify rows too with TERCEL_VERIFY_ATTN=rope), and the kernel pulls the o_proj
weight into L2 while it runs. Metadata
is a handful of device tensors, so capture_metadata is cheap and graph-safe, and replays need no
prepare_replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_batch import ForwardBatch
from ..graphs.breakable import eager_break
from ..kernels import (
    decode_attention_mode,
    decode_max_splits,
    fused_decode_enabled,
    l2_prefetch_enabled,
    verify_attention_mode,
)
from ..kernels.attention import decode_attention, decode_attention_rope, decode_splits, extend_attention
from ..kernels.fused import rope_store
from ..kv import PagedKVCache
from .base import AttentionBackend

PREFETCH_MAX_BATCH = 8
ROWS_MAX_QUERIES = 64  # causal batches of up to this many queries per request attend as decode rows


@dataclass(slots=True)
class TritonAttentionMetadata:
    decode: bool
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    num_splits: int = 1
    q_starts: torch.Tensor | None = None  # extend: where each request's queries start in T
    q_lens: torch.Tensor | None = None
    max_q_len: int = 0
    masks: torch.Tensor | None = None  # flat uint8, request b's [q, q] mask at mask_offsets[b] (-1: causal)
    mask_offsets: torch.Tensor | None = None
    rows: int = 0  # > 0: a causal verify as decode rows, this many per request (decode_attention_rope rows=)
    rows_rope: bool = False  # rows: RoPE and the K/V store in the split kernel (TERCEL_VERIFY_ATTN=rope)


class TritonAttentionBackend(AttentionBackend):
    fuses_rope = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 num_sms: int | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
        self.num_sms = num_sms
        # arrival counters of the one-launch decode (zero between launches); allocated on the first decode,
        # which comes before any capture (the runner warms up eagerly), never replaced: graphs bind it
        self._split_counters: torch.Tensor | None = None

    def _decode_meta(self, batch: ForwardBatch, block_size: int) -> TritonAttentionMetadata:
        splits = decode_splits(batch.block_tables.shape[0], self.num_kv_heads, self.num_sms, decode_max_splits())
        return TritonAttentionMetadata(True, batch.block_tables, batch.seq_lens, block_size, splits)

    def _rows_meta(self, batch: ForwardBatch, block_size: int, t: int) -> TritonAttentionMetadata:
        """A causal batch of t queries per request as b * t decode rows: row j of a request sees its first
        seq_len - t + j + 1 keys. The split-KV decode kernel then spreads each row's keys over many programs,
        where the extend kernel gives one program per (request, head) the whole context (latency-bound
        at small batch)."""
        b = batch.block_tables.shape[0]
        tables = batch.block_tables.repeat_interleave(t, dim=0)
        step = torch.arange(t, device=batch.seq_lens.device)
        seq = (batch.seq_lens[:, None] - (t - 1) + step[None, :]).reshape(-1)
        splits = decode_splits(b * t, self.num_kv_heads, self.num_sms, decode_max_splits())
        return TritonAttentionMetadata(True, tables, seq, block_size, splits, rows=t,
                                       rows_rope=verify_attention_mode() == "rope")

    def prepare(self, batch: ForwardBatch, block_size: int) -> TritonAttentionMetadata:
        if batch.is_decode:
            return self._decode_meta(batch, block_size)
        t = batch.query_lens[0]
        if batch.custom_masks is None and 1 < t <= ROWS_MAX_QUERIES and all(q == t for q in batch.query_lens):
            return self._rows_meta(batch, block_size, t)
        dev = batch.input_ids.device
        starts, offsets, flat, off, start = [], [], [], 0, 0
        for i, q in enumerate(batch.query_lens):
            starts.append(start)
            start += q
            m = batch.custom_masks[i] if batch.custom_masks is not None else None
            if m is None:
                offsets.append(-1)
            else:
                offsets.append(off)
                flat.append(m.reshape(-1).to(torch.uint8))
                off += m.numel()
        n = len(batch.query_lens)
        packed = torch.tensor(starts + list(batch.query_lens) + offsets, dtype=torch.long).to(dev, non_blocking=True)
        masks = torch.cat(flat).to(dev) if flat else None
        return TritonAttentionMetadata(False, batch.block_tables, batch.seq_lens, block_size, 1, packed[:n],
                                       packed[n:2 * n], max(batch.query_lens), masks,
                                       packed[2 * n:] if masks is not None else None)

    def capture_metadata(self, batch: ForwardBatch, block_size: int,
                         tokens_per_request: int) -> TritonAttentionMetadata:
        t = tokens_per_request
        if t == 1 and batch.custom_masks is None:
            return self._decode_meta(batch, block_size)
        if batch.custom_masks is None and t <= ROWS_MAX_QUERIES:
            return self._rows_meta(batch, block_size, t)
        b = batch.block_tables.shape[0]
        dev = batch.block_tables.device
        idx = torch.arange(b, device=dev)
        masks = offsets = None
        if batch.custom_masks is not None:
            masks = torch.stack(list(batch.custom_masks)).reshape(-1).to(torch.uint8)
            offsets = idx * (t * t)
        return TritonAttentionMetadata(False, batch.block_tables, batch.seq_lens, block_size, 1, idx * t,
                                       torch.full((b,), t, device=dev, dtype=torch.long), t, masks, offsets)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                meta: TritonAttentionMetadata, kv: PagedKVCache) -> torch.Tensor:
        kv.write(layer, batch.out_cache_loc, k, v)
        return attend(self, layer, q, meta, kv)

    def forward_rope(self, layer: int, qk: torch.Tensor, v: torch.Tensor,
                     cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                     meta: TritonAttentionMetadata, kv: PagedKVCache,
                     prefetch: torch.Tensor | None = None,
                     norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """prefetch: the weight that reads this output (o_proj), pulled into L2 while decode attention runs.
        norm_of: (residual, eps) to finish a norm folded into the qkv weight (only where stores_rope_apart)."""
        # weight-bound batches only: a large batch's attention has its own bytes to move
        prefetch = prefetch if meta.decode and qk.shape[0] <= PREFETCH_MAX_BATCH and l2_prefetch_enabled() else None
        mode = self._rope_mode(meta, qk)
        if mode != "split":
            if norm_of is not None:
                raise ValueError(f"a folded norm needs the RoPE + store kernel; this batch takes the {mode!r} kernel.")
            return attend_rope(self, layer, qk, v, cos_sin, batch.out_cache_loc, meta, kv, mode == "one", prefetch)
        q = rope_store(qk, v, cos_sin[0], cos_sin[1], batch.out_cache_loc, kv.k[layer], kv.v[layer], self.num_heads,
                       norm_of=norm_of)
        return attend(self, layer, q, meta, kv, prefetch)

    def _rope_mode(self, meta: TritonAttentionMetadata, qk: torch.Tensor) -> str:
        """split: RoPE + store (rope_store), then the attention kernels; rope / one: RoPE and the store inside
        the decode attention kernel."""
        # verify rows (TERCEL_VERIFY_ATTN=rope) read the block's earlier keys from qk / v in the kernel, never
        # another row's store, so they can take the decode kernel with RoPE and the store inside too
        rope_ok = meta.decode and fused_decode_enabled() and (not meta.rows or meta.rows_rope)
        mode = decode_attention_mode() if rope_ok else "split"
        if mode == "one" and meta.num_splits > 1 and self.split_counters(qk.shape[0], qk.device) is None:
            mode = "rope"
        return mode

    def stores_rope_apart(self, meta: TritonAttentionMetadata, qk: torch.Tensor) -> bool:
        """Whether forward_rope runs RoPE + store as its own kernel for this batch (verify rows, prefill), which
        can then finish a norm folded into the qkv weight (LlamaForCausalLM.fold_norms)."""
        return self._rope_mode(meta, qk) == "split"

    def split_counters(self, batch_size: int, device: torch.device) -> torch.Tensor | None:
        """The decode kernel's split counters, or None if this batch needs more than were allocated (never
        with the default split count: it splits only batches with batch_size * Hkv <= num_sms)."""
        if self._split_counters is None:
            n = max(batch_size * self.num_kv_heads, 2 * self.num_sms)
            self._split_counters = torch.zeros(n, dtype=torch.int32, device=device)
        c = self._split_counters
        return c if c.numel() >= batch_size * self.num_kv_heads and c.device == device else None


@eager_break
def attend(backend: TritonAttentionBackend, layer: int, q: torch.Tensor, meta: TritonAttentionMetadata,
           kv: PagedKVCache, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the cache for q [T, H, D] -> [T, H * D]. An eager break: under breakable capture
    it runs between graph segments (the place for planners or host-synced shapes)."""
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    if meta.decode:
        out = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.page_size,
                               backend.scale, meta.num_splits, window=backend.sliding_window, prefetch=prefetch)
    else:
        out = extend_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.q_starts, meta.q_lens,
                               meta.max_q_len, meta.page_size, backend.scale, window=backend.sliding_window,
                               masks=meta.masks, mask_offsets=meta.mask_offsets)
    return out.reshape(q.shape[0], -1)


@eager_break
def attend_rope(backend: TritonAttentionBackend, layer: int, qk: torch.Tensor, v: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], out_cache_loc: torch.Tensor, meta: TritonAttentionMetadata,
                kv: PagedKVCache, merge_in_kernel: bool, prefetch: torch.Tensor | None) -> torch.Tensor:
    """Decode attention with RoPE and the K/V store in the split kernel: qk [B, H + Hkv, D], v [B, Hkv, D] ->
    [B, H * D]. An eager break like attend (the store happens inside it, so a breakable replay re-runs it)."""
    counters = backend.split_counters(qk.shape[0], qk.device) if merge_in_kernel and meta.num_splits > 1 else None
    out = decode_attention_rope(qk, v, cos_sin[0], cos_sin[1], out_cache_loc, kv.k[layer], kv.v[layer],
                                meta.block_tables, meta.seq_lens, meta.page_size, backend.scale, meta.num_splits,
                                counters, window=backend.sliding_window, merge_in_kernel=merge_in_kernel,
                                prefetch=prefetch, rows=max(1, meta.rows))
    return out.reshape(qk.shape[0], -1)
