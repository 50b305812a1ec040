"""Reference attention over the paged KV cache in plain PyTorch (CPU and GPU).

prepare() turns block tables into KV slot indices once per forward; forward() runs per layer.
Decode batches (one query per request) go through one batched SDPA; extend/verify requests
(several queries: prefill chunks, verify blocks, trees) run one SDPA each. In a mixed batch (prefill chunks
beside running requests) the decodes still go through one batched SDPA: one per request per layer made a
100-request step several times slower on a CPU, most of it per-op overhead.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..forward_batch import ForwardBatch
from ..kv import PagedKVCache
from .base import AttentionBackend
from .sdpa import sdpa


@dataclass(slots=True)
class TorchAttentionMetadata:
    decode: bool
    # decode: [B, S_max] slot indices (padded with slot 0) and [B, 1, 1, S_max] validity mask
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # extend: per request (query offset, query len, kv slot indices [S], attention mask [q, S])
    per_request: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
    # extend batches with decodes in them (a prefill beside running requests): the decode rows run as one
    # batched decode (the rows, their slots and mask as above), only the others per request
    decode_rows: slice | torch.Tensor | None = None
    # graph-safe (capture_metadata): every request has `uniform` queries; slots [B, S], mask [B, 1, q, S]
    uniform: int = 0
    # decode of one request that sees every key (the CPU latency case): decided once here, not per layer
    single: bool = False
    # uniform batches as plain matmuls + softmax instead of SDPA: what a compiler fuses (graphs/compiled.py)
    matmul: bool = False


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape: index_select is several times cheaper than advanced
    indexing on CPU (~10 vs ~55 us per layer at decode sizes), the same values."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _slot_indices(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def _decode_slots(self, tables: torch.Tensor, seq_lens: torch.Tensor, s_max: int,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, s_max] KV slots and the [B, s_max] mask of the keys each decode query sees (padding reads slot 0)."""
        pos = torch.arange(s_max, device=tables.device)
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        valid = pos[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= pos[None, :] > (seq_lens[:, None] - 1 - self.sliding_window)
        return slots, valid

    def prepare(self, batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
        device = batch.input_ids.device
        if batch.is_decode:
            slots, valid = self._decode_slots(batch.block_tables, batch.seq_lens, max(batch.seq_lens_cpu), block_size)
            # one request that sees all its keys (a sliding window may cut some off): checked once here
            if len(batch.seq_lens_cpu) == 1 and (self.sliding_window is None or bool(valid.all())):
                return TorchAttentionMetadata(True, slots=slots, mask=valid[:, None, None, :], single=True)
            # padded keys read slot 0 but are masked out
            slots = torch.where(valid, slots, torch.zeros_like(slots))
            return TorchAttentionMetadata(True, slots=slots, mask=valid[:, None, None, :])
        # decodes beside prefill chunks: one batched SDPA for them instead of one per request per layer (the
        # scheduler puts them first, so their rows are usually a leading slice)
        qlens, custom = batch.query_lens, batch.custom_masks
        dec = [i for i, q in enumerate(qlens) if q == 1 and (custom is None or custom[i] is None)]
        meta = TorchAttentionMetadata(False, per_request=[])
        if len(dec) >= 2:
            idx = torch.tensor(dec, device=device)
            slots, valid = self._decode_slots(batch.block_tables[idx], batch.seq_lens[idx],
                                              max(batch.seq_lens_cpu[i] for i in dec), block_size)
            meta.slots = torch.where(valid, slots, torch.zeros_like(slots))
            meta.mask = valid[:, None, None, :]
            offsets = list(itertools.accumulate(qlens, initial=0))
            rows = [offsets[i] for i in dec]
            meta.decode_rows = slice(0, len(dec)) if rows[-1] == len(dec) - 1 else torch.tensor(rows, device=device)
        skip = set(dec) if meta.decode_rows is not None else set()
        per_request = meta.per_request
        offset = 0
        for i, (q_len, s_len) in enumerate(zip(batch.query_lens, batch.seq_lens_cpu)):
            if i in skip:
                offset += q_len
                continue
            slots = _slot_indices(batch.block_tables[i], s_len, block_size)
            prefix = s_len - q_len
            kv_idx = torch.arange(s_len, device=device)
            q_idx = torch.arange(q_len, device=device) + prefix
            mask = kv_idx[None, :] <= q_idx[:, None]
            custom = batch.custom_masks[i] if batch.custom_masks is not None else None
            if custom is not None:
                mask = mask.clone()
                mask[:, prefix:] = custom.to(device)
            if self.sliding_window is not None:
                mask &= kv_idx[None, :] > (q_idx[:, None] - self.sliding_window)
            per_request.append((offset, q_len, slots, mask))
            offset += q_len
        return meta

    def capture_metadata(self, batch: ForwardBatch, block_size: int, tokens_per_request: int) -> TorchAttentionMetadata:
        """Graph-safe: keys span the whole block-table width and are masked from the device seq_lens,
        so no host value is read. Keys no query may see read the dummy slot 0."""
        t, tables, seq = tokens_per_request, batch.block_tables, batch.seq_lens
        dev = tables.device
        pos = torch.arange(tables.shape[1] * block_size, device=dev)
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, S]
        prefix = (seq - t)[:, None]
        q_pos = prefix + torch.arange(t, device=dev)[None, :]  # [B, t]
        mask = pos[None, None, :] <= q_pos[:, :, None]  # [B, t, S]
        if batch.custom_masks is not None:  # a static verify step gives every request a [t, t] mask
            custom = torch.stack([m.to(dev) for m in batch.custom_masks])
            rel = (pos[None, :] - prefix).clamp(0, t - 1)
            picked = torch.gather(custom, 2, rel[:, None, :].expand(-1, t, -1))
            new = (pos[None, :] >= prefix) & (pos[None, :] < seq[:, None])
            mask = torch.where(new[:, None, :], picked, mask)
        if self.sliding_window is not None:
            mask &= pos[None, None, :] > (q_pos[:, :, None] - self.sliding_window)
        slots = torch.where(mask.any(1), slots, torch.zeros_like(slots))
        return TorchAttentionMetadata(False, slots=slots, mask=mask[:, None], uniform=t)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, meta: TorchAttentionMetadata, kv: PagedKVCache) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, H * D]."""
        kv.write(layer, batch.out_cache_loc, k, v)
        k_cache, v_cache = kv.k_layers[layer], kv.v_layers[layer]
        if meta.uniform and meta.matmul:
            return self._uniform_matmul(q, _gather(k_cache, meta.slots), _gather(v_cache, meta.slots), meta)
        if meta.uniform:
            b, t = meta.slots.shape[0], meta.uniform
            keys = _gather(k_cache, meta.slots).transpose(1, 2)  # [B, Hkv, S, D]
            values = _gather(v_cache, meta.slots).transpose(1, 2)
            qb = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            out = sdpa(qb, keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=True)  # [B, H, t, D]
            return out.transpose(1, 2).reshape(b * t, -1)
        if meta.single:
            slots = meta.slots[0]
            return self._single_decode(q, _gather(k_cache, slots), _gather(v_cache, slots))
        if meta.decode:
            return self._batched_decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._batched_decode(q[meta.decode_rows], k_cache, v_cache,
                                                         meta).view(-1, *q.shape[1:])
        for offset, q_len, slots, mask in meta.per_request:
            qi = q[offset:offset + q_len].transpose(0, 1)[None]  # [1, H, q, D]
            keys = _gather(k_cache, slots).transpose(0, 1)[None]
            values = _gather(v_cache, slots).transpose(0, 1)[None]
            oi = sdpa(qi, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[offset:offset + q_len] = oi[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    def _batched_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: TorchAttentionMetadata) -> torch.Tensor:
        """One query per request: q [B, H, D] against meta.slots [B, S] under meta.mask. Returns [B, H * D]."""
        keys = _gather(k_cache, meta.slots).transpose(1, 2)  # [B, Hkv, S, D]
        values = _gather(v_cache, meta.slots).transpose(1, 2)
        out = sdpa(
            q[:, :, None, :], keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=True
        )  # [B, H, 1, D]
        return out.reshape(q.shape[0], -1)

    def _uniform_matmul(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        meta: TorchAttentionMetadata) -> torch.Tensor:
        """keys, values: [B, S, Hkv, D]; the query heads grouped per KV head, scores in fp32."""
        b, t, hkv = keys.shape[0], meta.uniform, self.num_kv_heads
        group = self.num_heads // hkv
        qg = q.view(b, t, hkv, group, self.head_dim).float()
        scores = torch.einsum("btkgd,bskd->bkgts", qg, keys.float()) * self.scale  # [B, Hkv, G, t, S]
        scores = scores.masked_fill(~meta.mask[:, :, None], float("-inf"))  # mask [B, 1, t, S]
        out = torch.einsum("bkgts,bskd->btkgd", scores.softmax(-1), values.float())
        return out.reshape(b * t, -1).to(q.dtype)

    def _single_decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One request, one query: two bmm calls with the query heads grouped per KV head (fewer,
        cheaper ops than SDPA's general path; this is the CPU latency case)."""
        group = self.num_heads // self.num_kv_heads
        dtype = q.dtype
        if dtype != torch.float32:  # CPU bmm is several times slower in bf16 than fp32 at these tiny sizes
            q, keys, values = q.float(), keys.float(), values.float()
        qg = q.view(self.num_kv_heads, group, self.head_dim)
        scores = torch.bmm(qg, keys.permute(1, 2, 0)).mul_(self.scale)  # [Hkv, G, S]
        out = torch.bmm(scores.softmax(-1), values.transpose(0, 1))  # [Hkv, G, D]
        return out.reshape(1, -1).to(dtype)
