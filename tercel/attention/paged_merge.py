"""Draft attention over a paged prefix and a few dense keys beside it, without gathering the prefix.

The draft steps captured as graphs (EAGLE's tree loop, DFlash's block) attend over each request's paged draft
KV (its prefix) and over keys that are not in the paged cache (the tree's earlier leaves, the block's own rows).
Gathered, the prefix has to be every slot the block table can hold (a graph's static shape: max_model_len) and
the masked attention over it runs on SDPA's math path. Here the split-KV decode kernel reads each row's own
prefix and leaves its partial results unmerged (`decode_attention_partials`); the dense keys are attended in
fp32 in the same base-2 units, and the log-sum-exp merge of both is the softmax over their union: one Triton
launch (kernels/paged_dense_merge.py) for what the torch code here does in ~30, which stays as its reference.
GPU only (Triton); the gathered path stays for the CPU and as the reference.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedPrefix:
    """Where each of R = B x W query rows finds its prefix in the paged cache."""
    block_tables: torch.Tensor  # [R, width] the row's request's table
    seq_lens: torch.Tensor  # [R] the prefix length (0: none, e.g. a padding request)
    page_size: int
    num_splits: int  # split-KV programs per (row, KV head)
    num_requests: int  # B

    @classmethod
    def of(cls, block_tables: torch.Tensor, lengths: torch.Tensor, rows_per_request: int, page_size: int,
           num_kv_heads: int) -> "PagedPrefix":
        """Rows request-major (request i's rows are i * W .. i * W + W - 1); static shapes (graph-safe)."""
        from ..kernels.attention import decode_splits

        rows = lengths.shape[0] * rows_per_request
        return cls(block_tables.repeat_interleave(rows_per_request, dim=0),
                   lengths.repeat_interleave(rows_per_request), page_size,
                   decode_splits(rows, num_kv_heads, _num_sms(lengths.device)), lengths.shape[0])


def draft_context(block_tables: torch.Tensor, lengths: torch.Tensor, prefix_len: int, rows_per_request: int,
                  cache, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, PagedPrefix | None]:
    """How a captured draft step reads each request's prefix (positions < lengths) from the paged cache:
    (None, None, PagedPrefix) where Triton runs on `like`'s device (TERCEL_DRAFT_PAGED_PREFIX=0: never), else
    the gathered path's (slots, valid) over prefix_len positions and None."""
    from ..batching import device_context_slots
    from ..dev_overrides import env
    from ..kernels import use_triton

    if use_triton(like) and env("TERCEL_DRAFT_PAGED_PREFIX") != "0":
        return None, None, PagedPrefix.of(block_tables, lengths, rows_per_request, cache.block_size,
                                          cache.k[0].shape[1])
    slots, valid = device_context_slots(block_tables, lengths, prefix_len, cache.block_size)
    return slots, valid, None


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def attend_paged_and_dense(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, paged: PagedPrefix,
                           dense_k: torch.Tensor, dense_v: torch.Tensor, dense_mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Softmax attention of q [R, H, D] (R = B x W, request-major) over each row's paged prefix and the dense keys
    dense_k / dense_v [B, C, Hkv, D] its request holds, of which row j sees dense_mask [B, W, C]. Returns
    [R, H, D] in q's dtype; a row that sees no key at all gets zeros."""
    from ..kernels import use_triton
    from ..kernels.attention import decode_attention_partials

    part_o, part_l = decode_attention_partials(q, cache_k, cache_v, paged.block_tables, paged.seq_lens,
                                               paged.page_size, scale, paged.num_splits)
    unit = all(t.stride(-1) == 1 for t in (q, dense_k, dense_v, dense_mask))
    if use_triton(q) and unit and dense_mask.dtype == torch.bool:
        from ..kernels.paged_dense_merge import paged_dense_merge

        return paged_dense_merge(q, part_o, part_l, dense_k, dense_v, dense_mask, scale)
    return merge_dense_torch(q, part_o, part_l, dense_k, dense_v, dense_mask, scale)


def merge_dense_torch(q: torch.Tensor, part_o: torch.Tensor, part_l: torch.Tensor, dense_k: torch.Tensor,
                      dense_v: torch.Tensor, dense_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels/paged_dense_merge.py in torch ops (its reference): the dense keys' attention in fp32, base 2, and
    the log-sum-exp merge with the prefix partials part_o [R, H, S, D] / part_l [R, H, S]."""
    from ..kernels.attention import LOG2E

    rows, heads, dim = q.shape
    b, kv_heads = dense_k.shape[0], dense_k.shape[2]
    w = rows // b
    qg = q.float().view(b, w, kv_heads, heads // kv_heads, dim)
    s2 = torch.einsum("bwkgd,bckd->bwkgc", qg, dense_k.float()) * (scale * LOG2E)
    s2 = s2.masked_fill(~dense_mask[:, :, None, None, :], float("-inf"))
    m = s2.amax(-1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # no dense key visible: weight 0 below, not NaN
    e = torch.exp2(s2 - m[..., None])
    den = e.sum(-1)
    o_d = torch.einsum("bwkgc,bckd->bwkgd", e, dense_v.float()) / den.clamp_min(1e-30)[..., None]
    lse_d = torch.where(den > 0, m + torch.log2(den.clamp_min(1e-30)), torch.full_like(m, float("-inf")))
    lse = torch.cat([part_l, lse_d.reshape(rows, heads, 1)], dim=2)  # [R, H, S + 1]
    top = lse.amax(-1, keepdim=True)
    wts = torch.exp2(lse - torch.where(torch.isinf(top), torch.zeros_like(top), top))  # -inf parts weigh 0
    outs = torch.cat([part_o, o_d.reshape(rows, heads, 1, dim)], dim=2)  # [R, H, S + 1, D]
    out = (wts[..., None] * outs).sum(2) / wts.sum(-1).clamp_min(1e-30)[..., None]
    return out.to(q.dtype)
