"""Row-wise argmax of logits (Triton), the greedy token of every decode step.

torch's argmax over one 128k-vocabulary row runs as a single-block reduction, a visible share of a
batch-1 step at 8B scale (docs/gpu.md, "Where the 8B step goes"). Here each program
takes a BLOCK-wide slice of a row (max and its first index), and a second launch picks, per row, the
slice with the largest max, the first such slice on ties: the first index of the maximum, as torch
returns. NaN counts as the largest value, as in torch. With `ids` the pick maps the winning column through it (a draft's
vocabulary to the target's) in the same launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _argmax_slices_kernel(X, PV, PI, stride_x, n_cols, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN wins, as in torch.argmax
    m = tl.max(x, 0)
    i = tl.argmax(x, 0, tie_break_left=True)
    tl.store(PV + row * num_slices + s, m)
    tl.store(PI + row * num_slices + s, s * BLOCK + i)


@triton.jit
def _argmax_pick_kernel(PV, PI, IDS, OUT, num_slices, SLICES_PAD: tl.constexpr, HAS_IDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SLICES_PAD)
    v = tl.load(PV + row * num_slices + s, mask=s < num_slices, other=float("-inf"))
    j = tl.argmax(v, 0, tie_break_left=True)
    col = tl.load(PI + row * num_slices + j).to(tl.int64)
    if HAS_IDS:
        col = tl.load(IDS + col).to(tl.int64)
    tl.store(OUT + row, col)


def argmax_rows(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, V] (any float dtype, last dim contiguous) -> int64 [B]: torch.argmax(x, -1), or ids[argmax] with
    ids [V] (contiguous)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax_rows needs a [B, V] tensor with a contiguous last dim, got {tuple(x.shape)}.")
    b, v = x.shape
    out = torch.empty(b, dtype=torch.long, device=x.device)
    if b == 0:
        return out
    n = triton.cdiv(v, BLOCK)
    pv = torch.empty((b, n), dtype=torch.float32, device=x.device)
    pi = torch.empty((b, n), dtype=torch.int32, device=x.device)
    _argmax_slices_kernel[(b, n)](x, pv, pi, x.stride(0), v, n, BLOCK=BLOCK, num_warps=4)
    if ids is not None and (ids.shape != (v,) or ids.stride(0) != 1):
        raise ValueError(f"argmax_rows: ids of shape {tuple(ids.shape)} do not map a {v}-column row.")
    _argmax_pick_kernel[(b,)](pv, pi, ids if ids is not None else out, out, n,
                              SLICES_PAD=max(2, triton.next_power_of_2(n)), HAS_IDS=ids is not None, num_warps=1)
    return out
