"""A chained tree step's bookkeeping in two launches (Triton), one program per request: the tree's layout before
verify and the acceptance after it. The torch code they replace (speculative/tree_chain.py: tree_layout,
tree_accept) is ~15 and ~35 launches.

layout  node 0 is the root, node i >= 1 tree node i - 1; each node walks its parent chain (at most max_depth
        steps, reading the parents from global memory) marking its ancestors-or-self mask row and counting its
        depth.
accept  node j is correct when its token is the target's token at its parent; a node is reachable when no node
        among its ancestors-or-self is wrong; the deepest reachable node (the first of equal depth, as
        torch.argmax) ends the path. Then, per depth d: the path's node, its token, the KV move of a live
        request's accepted node d from slot base + path[d] to base + d, draft_extend's row d (the token after it,
        the verify row it reads, its slot), and the next root and base in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(nodes: int) -> int:
    """Warps for a program's [N, N] tiles (the masks): about 64 values a thread."""
    return 1 if nodes <= 16 else 4 if nodes <= 64 else 8


@triton.jit
def _tree_layout_kernel(ROOTS, TREE_TOKENS, TREE_PARENTS, TOKENS, PARENTS, DEPTH, MASKS, max_depth,
                        N: tl.constexpr, NP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    inn = i < N
    node = (i >= 1) & inn
    tree_row = TREE_PARENTS + b * (N - 1)
    tok = tl.load(TREE_TOKENS + b * (N - 1) + i - 1, mask=node, other=0)
    tok = tl.where(i == 0, tl.load(ROOTS + b), tok)
    par = tl.where(node, tl.load(tree_row + i - 1, mask=node, other=-1), -1)
    tl.store(TOKENS + b * N + i, tok, mask=inn)
    tl.store(PARENTS + b * N + i, par, mask=inn)
    mask = i[:, None] == i[None, :]
    depth = tl.zeros([NP], tl.int64)
    anc = par
    for _ in range(max_depth):
        up = anc >= 0
        mask = mask | ((anc[:, None] == i[None, :]) & up[:, None])
        depth += up.to(tl.int64)
        above = tl.load(tree_row + anc - 1, mask=anc >= 1, other=-1)  # node anc's parent (the root has none)
        anc = tl.where(anc >= 1, above, -1)
    tl.store(DEPTH + b * N + i, depth, mask=inn)
    tl.store(MASKS + b * N * N + i[:, None] * N + i[None, :], mask, mask=inn[:, None] & inn[None, :])


def tree_layout_rows(roots: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                     max_depth: int) -> tuple[torch.Tensor, ...]:
    """roots [B]; tree_tokens, tree_parents [B, N - 1] int64 contiguous (parents as node ids, 0 = the root) ->
    (tokens, parents, depth [B, N] int64, masks [B, N, N] bool)."""
    n, m = tree_tokens.shape
    w, dev = m + 1, roots.device
    tokens, parents, depth = (torch.empty(n, w, dtype=torch.long, device=dev) for _ in range(3))
    masks = torch.empty(n, w, w, dtype=torch.bool, device=dev)
    if n:
        _tree_layout_kernel[(n,)](roots, tree_tokens, tree_parents, tokens, parents, depth, masks, max_depth, N=w,
                                  NP=max(2, triton.next_power_of_2(w)), num_warps=_warps(w))
    return tokens, parents, depth, masks


@triton.jit
def _tree_accept_kernel(TARGETS, TOKENS, PARENTS, DEPTH, MASKS, SLOTS, slot_stride_j, slot_stride_b, BASE, LIVE,
                        ROOTS, PATH_TOKENS, K_OUT, BONUS, SRC, DST, EXT_IDS, EXT_ROWS, EXT_SLOTS, EXT_SEQ,
                        N: tl.constexpr, NP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    inn = i < N
    row = b * N
    tok = tl.load(TOKENS + row + i, mask=inn, other=0)
    par = tl.load(PARENTS + row + i, mask=inn, other=-1)
    dep = tl.load(DEPTH + row + i, mask=inn, other=0)
    at_parent = tl.load(TARGETS + row + tl.maximum(par, 0), mask=inn, other=-1)
    wrong = inn & (i > 0) & ((par < 0) | (tok != at_parent))
    m = tl.load(MASKS + b * N * N + i[:, None] * N + i[None, :], mask=inn[:, None] & inn[None, :], other=0) != 0
    bad = tl.sum(tl.where(m & wrong[None, :], 1, 0), 1)
    score = tl.where((bad == 0) & inn, dep, -1)
    k = tl.max(score, 0)
    best = tl.argmax(score, 0, tie_break_left=True)
    bonus = tl.load(TARGETS + row + best)
    on_path = tl.load(MASKS + b * N * N + best * N + i, mask=inn, other=0) != 0
    # the path's node at depth d (the root past k), and at depth d + 1 (draft_extend's next token)
    d = i
    path = tl.sum(tl.where(on_path[None, :] & (dep[None, :] == d[:, None]), i[None, :], 0), 1)
    after = tl.sum(tl.where(on_path[None, :] & (dep[None, :] == d[:, None] + 1), i[None, :], 0), 1)
    path_tok = tl.load(TOKENS + row + path, mask=inn, other=0)
    tl.store(PATH_TOKENS + row + d, path_tok, mask=inn)
    here = tl.load(SLOTS + d * slot_stride_j + b * slot_stride_b, mask=inn, other=0)
    src = tl.load(SLOTS + path * slot_stride_j + b * slot_stride_b, mask=inn, other=0)
    live = tl.load(LIVE + b) != 0
    move = (d <= k) & live & (path != d)
    moved = inn & (d >= 1)
    tl.store(SRC + b * (N - 1) + d - 1, tl.where(move, src, 0), mask=moved)
    tl.store(DST + b * (N - 1) + d - 1, tl.where(move, here, 0), mask=moved)
    nxt = tl.load(TOKENS + row + after, mask=inn, other=0)
    tl.store(EXT_IDS + row + d, tl.where(d < k, nxt, tl.where(d == k, bonus, 0)), mask=inn)
    tl.store(EXT_ROWS + row + d, row + tl.where(d <= k, path, 0), mask=inn)
    tl.store(EXT_SLOTS + row + d, tl.where(d <= k, here, 0), mask=inn)
    base = tl.load(BASE + b)
    tl.store(EXT_SEQ + b, base + N)
    tl.store(K_OUT + b, k.to(tl.int64))
    tl.store(BONUS + b, bonus)
    tl.store(ROOTS + b, tl.where(live, bonus, tl.load(ROOTS + b)))
    tl.store(BASE + b, tl.where(live, base + k + 1, 0))


def tree_accept_rows(targets: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                     masks: torch.Tensor, slots: torch.Tensor, base: torch.Tensor, live: torch.Tensor,
                     roots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """targets, tokens, parents, depth [B, N] int64 contiguous; masks [B, N, N] bool contiguous; slots [N, B] int64
    (any strides); base, live, roots [B] int64 contiguous (base and roots updated in place). Returns (path_tokens
    [B, N], k, bonus, src, dst [B * (N - 1)], ext_ids, ext_rows, ext_slots [B * N], ext_seq [B])."""
    n, w = tokens.shape
    dev = tokens.device
    path_tokens = torch.empty(n, w, dtype=torch.long, device=dev)
    k, bonus, ext_seq = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(3))
    src, dst = (torch.empty(n * (w - 1), dtype=torch.long, device=dev) for _ in range(2))
    ext_ids, ext_rows, ext_slots = (torch.empty(n * w, dtype=torch.long, device=dev) for _ in range(3))
    if n:
        _tree_accept_kernel[(n,)](targets, tokens, parents, depth, masks, slots, slots.stride(0), slots.stride(1),
                                  base, live, roots, path_tokens, k, bonus, src, dst, ext_ids, ext_rows, ext_slots,
                                  ext_seq, N=w, NP=max(2, triton.next_power_of_2(w)), num_warps=_warps(w))
    return path_tokens, k, bonus, src, dst, ext_ids, ext_rows, ext_slots, ext_seq
