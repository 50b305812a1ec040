"""DDTREE's beams in one launch (Triton), one program per request: ~7 torch launches per depth (speculative/
ddtree_chain.py: ddtree_nodes) become one for the whole block.

Depth 1 is the root's children: the first min(budget, K) candidates of block position 1. Each further depth
scores every child of the previous beam (its parent's score plus the candidate's log-probability at that
position), ranks the children by pairwise comparison (a higher score first; at equal scores the lower
parent-major index) and keeps the `budget` best, written at their rank: every beam lands best first, after the
previous one, as the torch path's topk lays them out. The scores, parents (candidate indices, -1: the root)
and tokens of all beams go to [B, C] outputs for the re-ranking into the tree.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rank import rank_tile


@triton.jit
def _ddtree_beams_kernel(LP, TK, SCORES, PARENTS, TOKENS, D: tl.constexpr, K: tl.constexpr, BUDGET: tl.constexpr,
                         C: tl.constexpr, W1: tl.constexpr, KP: tl.constexpr, F: tl.constexpr, FJ: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lp_row = LP + b * D * K
    tk_row = TK + b * D * K
    out = b * C
    c = tl.arange(0, KP)
    first = c < W1
    tl.store(SCORES + out + c, tl.load(lp_row + c, mask=first, other=0.0), mask=first)
    tl.store(TOKENS + out + c, tl.load(tk_row + c, mask=first, other=0), mask=first)
    tl.store(PARENTS + out + c, tl.full([KP], -1, tl.int64), mask=first)
    f = tl.arange(0, F)  # a child, parent-major: beam node f // KP, candidate f % KP
    p = f // KP
    k = f % KP
    width = b * 0 + W1  # int64 scalars from the start: their type stays fixed through the loop
    offset = b * 0
    for depth in range(1, D):
        tl.debug_barrier()  # the previous beam's scores are stored
        valid = (p < width) & (k < K)
        s = tl.load(SCORES + out + offset + p, mask=valid, other=0.0) + \
            tl.load(lp_row + depth * K + k, mask=valid, other=0.0)
        rank = tl.zeros([F], tl.int32)
        for j0 in tl.static_range(0, F, FJ):  # the comparisons FJ columns at a time: a small register tile
            fj = j0 + tl.arange(0, FJ)
            pj = fj // KP
            kj = fj % KP
            vj = (pj < width) & (kj < K)
            sj = tl.load(SCORES + out + offset + pj, mask=vj, other=0.0) + \
                tl.load(lp_row + depth * K + kj, mask=vj, other=0.0)
            rank += rank_tile(s, f, sj, fj, vj)
        new_width = tl.minimum(width * K, BUDGET)
        keep = valid & (rank < new_width)
        at = out + offset + width + rank
        tl.store(SCORES + at, s, mask=keep)
        tl.store(PARENTS + at, (offset + p).to(tl.int64), mask=keep)
        tl.store(TOKENS + at, tl.load(tk_row + depth * K + k, mask=keep, other=0), mask=keep)
        offset += width
        width = new_width


def ddtree_beams(logprobs: torch.Tensor, tokens: torch.Tensor, budget: int,
                 sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [B, D, K] float32, tokens [B, D, K] int64 (contiguous; position d + 1's top-K, best first);
    sizes: every depth's beam width (ddtree_chain.beam_sizes) -> (scores, parents, tokens) [B, sum(sizes)]."""
    b, d, k = logprobs.shape
    c = sum(sizes)
    dev = logprobs.device
    scores = torch.empty(b, c, dtype=torch.float32, device=dev)
    parents, toks = (torch.empty(b, c, dtype=torch.long, device=dev) for _ in range(2))
    if b:
        kp = max(2, triton.next_power_of_2(k))
        f = max(2, triton.next_power_of_2(max(sizes[:-1], default=1))) * kp
        _ddtree_beams_kernel[(b,)](logprobs, tokens, scores, parents, toks, D=d, K=k, BUDGET=budget, C=c,
                                   W1=sizes[0], KP=kp, F=f, FJ=min(f, 64), num_warps=4 if f <= 64 else 8)
    return scores, parents, toks
