"""The top k of a row's softmax (or log-softmax) in two Triton launches: the EAGLE tree draft's expansion and
DDTREE's per-position candidates.

torch spends a softmax over the vocabulary and a multi-block radix select (four launches) per call; a chained
tree step makes five such calls, ~60 launches and ~200 µs of an H100 step at SmolLM2's size
(docs/speculative_graphs.md). Here each program of the first launch takes a BLOCK-wide slice of a row and
writes its maximum, its sum of exp(x - max) and its k largest values with their columns (extracted largest
first, the lowest column first on ties); the second launch, one program per row, joins the slices' sums into
the row's normaliser and takes the k largest of the slices' candidates. The values come back as
probabilities (or log-probabilities), largest first, like `x.softmax(-1).topk(k)`; ties keep the lower column
first (torch leaves their order unspecified).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import TOPK_ROWS_MAX_K as MAX_K

BLOCK = 4096


@triton.jit
def _topk_slices_kernel(X, PM, PS, PV, PI, stride_x, n_cols, num_slices, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf slice adds nothing to the normaliser
    tl.store(PM + row * num_slices + s, m)
    tl.store(PS + row * num_slices + s, tl.sum(tl.exp(x - safe), 0))
    lane = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    cols = tl.full([KP], -1, tl.int32)
    here = tl.arange(0, BLOCK)
    left = offs < n_cols  # not yet taken (a taken or padded column never comes back, even among -inf)
    for j in tl.static_range(K):  # the largest left, the lowest column on ties
        v = tl.max(tl.where(left, x, float("-inf")), 0)
        i = tl.min(tl.where(left & (x == v), here, BLOCK), 0)
        got = i < BLOCK  # a slice of fewer than K columns runs out
        vals = tl.where((lane == j) & got, v, vals)
        cols = tl.where((lane == j) & got, s * BLOCK + i, cols)
        left = left & (here != i)
    base = (row * num_slices + s) * KP
    tl.store(PV + base + lane, vals)
    tl.store(PI + base + lane, cols)


@triton.jit
def _topk_pick_kernel(PM, PS, PV, PI, OV, OI, num_slices, K: tl.constexpr, KP: tl.constexpr,
                      SLICES_PAD: tl.constexpr, LOG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sl = tl.arange(0, SLICES_PAD)
    pm = tl.load(PM + row * num_slices + sl, mask=sl < num_slices, other=float("-inf"))
    ps = tl.load(PS + row * num_slices + sl, mask=sl < num_slices, other=0.0)
    m = tl.max(pm, 0)
    z = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - m)), 0)
    # the candidates slice after slice, each slice's largest first: a tie goes to the lower column
    c = tl.arange(0, SLICES_PAD * KP)
    ok = c < num_slices * KP
    vals = tl.load(PV + row * num_slices * KP + c, mask=ok, other=float("-inf"))
    cols = tl.load(PI + row * num_slices * KP + c, mask=ok, other=0)
    # a slice shorter than k pads with taken entries (column -1)
    left = ok & (cols >= 0)
    for j in tl.static_range(K):
        v = tl.max(tl.where(left, vals, float("-inf")), 0)
        i = tl.min(tl.where(left & (vals == v), c, SLICES_PAD * KP), 0)
        col = tl.sum(tl.where(c == i, cols, 0), 0)
        if LOG:
            out = v - m - tl.log(z)
        else:
            out = tl.exp(v - m) / z
        tl.store(OV + row * K + j, out)
        tl.store(OI + row * K + j, col.to(tl.int64))
        left = left & (c != i)


def softmax_topk_rows(x: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] logits (any float dtype, last dim contiguous) -> (values float32 [R, k], columns int64 [R, k]):
    `x.float().softmax(-1).topk(k)` (log: `log_softmax`), largest first."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"softmax_topk_rows needs a [R, V] tensor with a contiguous last dim, got {tuple(x.shape)}.")
    r, v = x.shape
    if not 1 <= k <= min(MAX_K, v):
        raise ValueError(f"softmax_topk_rows: k={k} for rows of {v}; it serves 1..{min(MAX_K, v)} (use torch.topk).")
    ov = torch.empty((r, k), dtype=torch.float32, device=x.device)
    oi = torch.empty((r, k), dtype=torch.long, device=x.device)
    if r == 0:
        return ov, oi
    n = triton.cdiv(v, BLOCK)
    kp = max(2, triton.next_power_of_2(k))
    pm = torch.empty((r, n), dtype=torch.float32, device=x.device)
    ps = torch.empty_like(pm)
    pv = torch.empty((r, n, kp), dtype=torch.float32, device=x.device)
    pi = torch.empty((r, n, kp), dtype=torch.int32, device=x.device)
    _topk_slices_kernel[(r, n)](x, pm, ps, pv, pi, x.stride(0), v, n, K=k, KP=kp, BLOCK=BLOCK, num_warps=8)
    _topk_pick_kernel[(r,)](pm, ps, pv, pi, ov, oi, n, K=k, KP=kp, SLICES_PAD=max(2, triton.next_power_of_2(n)),
                            LOG=log, num_warps=1)
    return ov, oi
