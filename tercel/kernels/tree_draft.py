"""An EAGLE tree draft loop's bookkeeping in one launch per draft step, and the EAGLE-2 re-ranking in one launch
(Triton), one program per request. The torch code they replace (speculative/eagle_tree_step.py: the body's loop;
speculative/tree.py: select_tree_nodes_batched) is ~14 launches per draft step and ~12 for the re-ranking.

expand  a draft step's picks (each of P leaves' top K children, probabilities) become candidates: score = the
        leaf's cumulative score times the child's (the first step: the child's own), token = the child's target
        id (through the draft vocabulary's map), parent = the leaf's candidate index; they are written into the
        candidate slabs at their offset. The K best (a higher score first; at equal scores the lower index, as a
        stable descending sort) become the next leaves at their rank: their tokens, scores, candidate indices,
        hidden states (the parent leaf's output row) and ancestor rows of the loop's scratch (the parent's row
        and the new entry itself).
select  every candidate's rank by pairwise comparison (the same order); the first M ranks are kept, numbered
        1..M in candidate order (parents come before children), each with its token and its parent's node id
        (0: the root).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rank import rank_tile


@triton.jit
def _tree_expand_kernel(CHILD_SCORES, CHILD_IDS, LEAF_SCORES, LEAF_CAND, MAP, HID_IN, HID_OUT, ANC,
                        CAND_TOKENS, CAND_SCORES, CAND_PARENTS, OUT_TOKENS, OUT_SCORES, OUT_CAND,
                        cand_off, cand_stride, e_prev, e_next, cap, hidden,
                        P: tl.constexpr, K: tl.constexpr, PKP: tl.constexpr, KP: tl.constexpr, CAPP: tl.constexpr,
                        BLOCK_H: tl.constexpr, FIRST: tl.constexpr, HAS_MAP: tl.constexpr,
                        GATHER_HIDDEN: tl.constexpr, WRITE_ANC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, PKP)
    valid = i < P * K
    p = i // K
    child = tl.load(CHILD_SCORES + b * (P * K) + i, mask=valid, other=0.0)
    ids = tl.load(CHILD_IDS + b * (P * K) + i, mask=valid, other=0)
    if FIRST:  # the root's children: their own probabilities, no parent
        cum = child
        parent = tl.full([PKP], -1, tl.int64)
    else:
        cum = tl.load(LEAF_SCORES + b * P + p, mask=valid, other=0.0) * child
        parent = tl.load(LEAF_CAND + b * P + p, mask=valid, other=0)
    if HAS_MAP:
        tok = tl.load(MAP + ids, mask=valid, other=0)
    else:
        tok = ids
    row = CAND_TOKENS + b * cand_stride + cand_off
    tl.store(row + i, tok, mask=valid)
    tl.store(CAND_SCORES + b * cand_stride + cand_off + i, cum, mask=valid)
    tl.store(CAND_PARENTS + b * cand_stride + cand_off + i, parent, mask=valid)
    rank = rank_tile(cum, i, cum, i, valid)
    keep = valid & (rank < K)
    tl.store(OUT_TOKENS + b * K + rank, tok, mask=keep)
    tl.store(OUT_SCORES + b * K + rank, cum, mask=keep)
    tl.store(OUT_CAND + b * K + rank, (cand_off + i).to(tl.int64), mask=keep)
    r = tl.arange(0, KP)
    live_r = r < K
    # the leaf each new leaf (by rank) grew from
    par = tl.sum(tl.where((rank[None, :] == r[:, None]) & keep[None, :], p[None, :], 0), 1)
    if GATHER_HIDDEN:
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m = live_r[:, None] & (h[None, :] < hidden)
            x = tl.load(HID_IN + (b * P + par)[:, None] * hidden + h[None, :], mask=m, other=0.0)
            tl.store(HID_OUT + (b * K + r)[:, None] * hidden + h[None, :], x, mask=m)
    if WRITE_ANC:
        c = tl.arange(0, CAPP)
        m = live_r[:, None] & (c[None, :] < cap)
        anc = ANC + b * cap * cap
        if FIRST:
            seen = c[None, :] < 0
        else:
            seen = tl.load(anc + (e_prev + par)[:, None] * cap + c[None, :], mask=m, other=0) != 0
        seen = seen | (c[None, :] == (e_next + r)[:, None])
        tl.store(anc + (e_next + r)[:, None] * cap + c[None, :], seen, mask=m)


def tree_expand(child_scores: torch.Tensor, child_ids: torch.Tensor, leaf_scores: torch.Tensor | None,
                leaf_cand: torch.Tensor | None, vocab_map: torch.Tensor | None, hidden: torch.Tensor | None,
                ancestors: torch.Tensor | None, cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cand_off: int,
                e_prev: int, e_next: int) -> tuple[torch.Tensor, ...]:
    """child_scores, child_ids [B, P, K] (float32, int64; each leaf's top K children); leaf_scores [B, P] float32
    and leaf_cand [B, P] int64, or None for the root's children (P = 1); vocab_map: the draft -> target id map or
    None; hidden [B, P, H]: the leaves' draft outputs (None: no next leaves' hidden states); ancestors [B, cap, cap]
    bool: rows e_next.. are written from rows e_prev + parent (None: not written); cand: the (tokens, scores,
    parents) [B, C] slabs, written at columns cand_off..cand_off + P * K. All contiguous. Returns the next leaves
    (tokens, scores, candidate indices [B, K], hidden states [B, K, H] or None)."""
    n, p, k = child_scores.shape
    dev = child_scores.device
    tokens, scores, cand_idx = (torch.empty(n, k, dtype=t, device=dev)
                                for t in (torch.long, torch.float32, torch.long))
    hid_out = None if hidden is None else hidden.new_empty(n, k, hidden.shape[-1])
    first = leaf_scores is None
    cap = 0 if ancestors is None else ancestors.shape[-1]
    if n:
        h = 0 if hidden is None else hidden.shape[-1]
        _tree_expand_kernel[(n,)](
            child_scores, child_ids, child_scores if first else leaf_scores, child_ids if first else leaf_cand,
            child_ids if vocab_map is None else vocab_map, child_scores if hidden is None else hidden,
            child_scores if hid_out is None else hid_out, child_scores if ancestors is None else ancestors,
            *cand, tokens, scores, cand_idx, cand_off, cand[0].shape[1], e_prev, e_next, cap, h,
            P=p, K=k, PKP=max(2, triton.next_power_of_2(p * k)), KP=max(2, triton.next_power_of_2(k)),
            CAPP=max(2, triton.next_power_of_2(max(cap, 1))), BLOCK_H=min(256, max(2, triton.next_power_of_2(h))),
            FIRST=first, HAS_MAP=vocab_map is not None, GATHER_HIDDEN=hidden is not None,
            WRITE_ANC=ancestors is not None, num_warps=1 if p * k <= 16 else 4)
    return tokens, scores, cand_idx, hid_out


@triton.jit
def _tree_select_kernel(SCORES, PARENTS, TOKENS, NODE_OF, TREE_TOKENS, TREE_PARENTS, C, M,
                        CP: tl.constexpr, BJ: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CP)
    valid = i < C
    s = tl.load(SCORES + b * C + i, mask=valid, other=0.0)
    rank = tl.zeros([CP], tl.int32)
    for j0 in range(0, C, BJ):  # BJ columns at a time: a small register tile
        j = j0 + tl.arange(0, BJ)
        vj = j < C
        sj = tl.load(SCORES + b * C + j, mask=vj, other=0.0)
        rank += rank_tile(s, i, sj, j, vj)
    keep = valid & (rank < M)
    node = tl.cumsum(keep.to(tl.int32), 0)  # a kept candidate's node id, 1..M in candidate order
    tl.store(NODE_OF + b * C + i, node, mask=valid)
    tl.debug_barrier()  # every candidate's node id is stored before the parents' are read back
    par = tl.load(PARENTS + b * C + i, mask=keep, other=-1)
    par_node = tl.load(NODE_OF + b * C + par, mask=keep & (par >= 0), other=0)
    tl.store(TREE_TOKENS + b * M + node - 1, tl.load(TOKENS + b * C + i, mask=keep, other=0), mask=keep)
    tl.store(TREE_PARENTS + b * M + node - 1, par_node.to(tl.int64), mask=keep)


# beyond this many candidates a program's rank tile grows past what its registers hold: the torch path instead
TREE_SELECT_MAX_CANDIDATES = 1024


def tree_select(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, C] float32, parents [B, C] int64 (candidate indices, -1: the root; parents before children and
    never scored above them), tokens [B, C] int64, all contiguous; num_nodes <= C -> (tree tokens, tree parents)
    [B, num_nodes]: the kept candidates' tokens in candidate order and their parents as node ids (0: the root)."""
    n, c = scores.shape
    dev = scores.device
    tree_tokens, tree_parents = (torch.empty(n, num_nodes, dtype=torch.long, device=dev) for _ in range(2))
    node_of = torch.empty(n, c, dtype=torch.int32, device=dev)
    if n and num_nodes:
        cp = max(2, triton.next_power_of_2(c))
        _tree_select_kernel[(n,)](scores, parents, tokens, node_of, tree_tokens, tree_parents, c, num_nodes, CP=cp,
                                  BJ=min(cp, 32), num_warps=1 if cp <= 64 else 4 if cp <= 256 else 8)
    return tree_tokens, tree_parents
