"""The chained EAGLE step's acceptance and next state in one launch (Triton): one program per request.

Per request b with W rows (root + W - 1 drafts), from the target's token at each row and the drafted tokens:
  k          the run of leading drafts equal to the target's token before them (accept_greedy_batched)
  bonus      the target's token at row k
  ext_ids    draft_extend's inputs: row j < k reads the accepted draft j + 1, row k the bonus, the rest 0
  ext_slots  row j <= k keeps its KV slot, the rest write the dummy slot 0
  ext_seq    base + W, draft_extend's sequence length
and, for a live request, the next step's root (the bonus) and base (base + k + 1) in place; a padding request
keeps its root and goes back to base 0. The same in torch is ~30 launches (speculative/chain_accept.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chain_accept_kernel(TARGETS, TOKENS, SLOTS, BASE, LIVE, ROOTS, K_OUT, BONUS, EXT_IDS, EXT_SLOTS, EXT_SEQ,
                         slot_stride_j, slot_stride_b, W: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WP)
    inw = j < W
    tgt = tl.load(TARGETS + b * W + j, mask=inw, other=0)
    nxt = tl.load(TOKENS + b * W + j + 1, mask=j + 1 < W, other=0)  # draft j + 1, judged by the target at j
    match = (nxt == tgt) & (j + 1 < W)
    k = tl.min(tl.where(match, W - 1, j), 0)  # the first mismatch (W - 1: every draft kept)
    bonus = tl.sum(tl.where(j == k, tgt, 0), 0)
    ids = tl.where(j < k, nxt, tl.where(j == k, bonus, 0))
    slots = tl.load(SLOTS + j * slot_stride_j + b * slot_stride_b, mask=inw, other=0)
    tl.store(EXT_IDS + b * W + j, ids, mask=inw)
    tl.store(EXT_SLOTS + b * W + j, tl.where(j <= k, slots, 0), mask=inw)
    base = tl.load(BASE + b)
    live = tl.load(LIVE + b) != 0
    tl.store(EXT_SEQ + b, base + W)
    tl.store(K_OUT + b, k.to(tl.int64))
    tl.store(BONUS + b, bonus)
    tl.store(ROOTS + b, tl.where(live, bonus, tl.load(ROOTS + b)))
    tl.store(BASE + b, tl.where(live, base + k + 1, 0))


def chain_accept_rows(targets: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, base: torch.Tensor,
                      live: torch.Tensor, roots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """targets, tokens: [B, W] int64 contiguous; slots [W, B] int64 (any strides); base, live, roots [B] int64
    contiguous (base and roots updated in place). Returns (k, bonus, ext_ids [B * W], ext_slots [B * W],
    ext_seq)."""
    n, w = tokens.shape
    dev = tokens.device
    k, bonus, ext_seq = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(3))
    ext_ids, ext_slots = (torch.empty(n * w, dtype=torch.long, device=dev) for _ in range(2))
    if n:
        _chain_accept_kernel[(n,)](targets, tokens, slots, base, live, roots, k, bonus, ext_ids, ext_slots, ext_seq,
                                   slots.stride(0), slots.stride(1), W=w, WP=max(2, triton.next_power_of_2(w)),
                                   num_warps=1)
    return k, bonus, ext_ids, ext_slots, ext_seq
