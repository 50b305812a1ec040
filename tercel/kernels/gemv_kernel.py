"""The batch-1 GEMV kernel and its launcher (Triton), shared by kernels.gemv (one row) and kernels.gemm_small's
rowgrid configs (the same kernel once per row); kernels.gemv's docstring describes what it computes."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl_mode
from .split_sum import sum_splits_kernel


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    norm_after: bool = False  # RMSNorm prologue only: scale the dot product by 1/rms (one pass; split_k 1)
    dot: bool = False  # small-M only (kernels.gemm_small): tensor-core tl.dot, rows padded to 16
    rowloop: bool = False  # small-M only: the batch-1 GEMV of each row against one weight tile (K <= block_k)
    swap: bool = False  # small-M tl.dot only: weight rows as the MMA's M, tokens as its N (wgmma at block_n 64)
    rowgrid: bool = False  # small-M only: this batch-1 kernel once per row (the rows' programs side by side)


@triton.jit
def weight_tile_start(W, pid, split, K, K_PER_SPLIT, stride_w, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """A weight-streaming program's start (this GEMV and kernels.gemm_small): its BLOCK_N weight rows, its split's
    K range and the first chunk's load, issued before the PDL wait (weights never depend on the previous kernel).
    Returns (rows, row mask, chunk columns, k_start, k_end, chunk pointers, first chunk)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    cols = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_ptr = W + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    w = tl.load(w_ptr + k_start, mask=rm[:, None] & (k_start + cols < k_end)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    return rows, rm, cols, k_start, k_end, w_ptr, w


@triton.jit
def _gemv_kernel(X, W, Y, R, NW, K, K_PER_SPLIT, stride_w, N, eps, stride_x, M, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                 NORM_AFTER: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr,
                 ROW_GRID: tl.constexpr):
    if ROW_GRID:  # row m of M on axis 0, so the programs of one weight block run together (L2 serves the rest)
        m = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        split = tl.program_id(2)
        X += m * stride_x
        Y += m * N  # [M, N] out, or fp32 partials [SPLIT, M, N]
        R += m * N
        split_stride = M * N
    else:
        pid = tl.program_id(0)
        split = tl.program_id(1)
        split_stride = N
    rows, rm, cols, k_start, k_end, w_ptr, w = weight_tile_start(W, pid, split, K, K_PER_SPLIT, stride_w, N, BLOCK_N,
                                                                 BLOCK_K, PDL)
    rstd = 0.0
    ss = tl.zeros([BLOCK_K], tl.float32)
    if NORM and not NORM_AFTER:  # the rms of the whole row, in one read when K fits NORM_BLOCK
        nc = tl.arange(0, NORM_BLOCK)
        ssn = tl.zeros([NORM_BLOCK], tl.float32)
        for n0 in range(0, K, NORM_BLOCK):
            xv = tl.load(X + n0 + nc, mask=n0 + nc < K, other=0.0).to(tl.float32)
            ssn += xv * xv
        rstd = tl.rsqrt(tl.sum(ssn, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        km = k0 + cols < k_end
        if SILU:  # as fused.silu_mul: silu(gate) rounded, then the product rounded
            g = tl.load(X + k0 + cols, mask=km, other=0.0)
            u = tl.load(X + K + k0 + cols, mask=km, other=0.0)
            gf = g.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        elif NORM_AFTER:  # x * w exact in fp32; 1/rms after the loop
            xv = tl.load(X + k0 + cols, mask=km, other=0.0).to(tl.float32)
            ss += xv * xv
            x = xv * tl.load(NW + k0 + cols, mask=km, other=0.0).to(tl.float32)
        elif NORM:  # as fused.rms_norm: normalised value rounded, times the weight, rounded
            xv = tl.load(X + k0 + cols, mask=km, other=0.0)
            nw = tl.load(NW + k0 + cols, mask=km, other=0.0)
            xn = (xv.to(tl.float32) * rstd).to(xv.dtype).to(tl.float32) * nw.to(tl.float32)
            x = xn.to(xv.dtype).to(tl.float32)
        else:
            x = tl.load(X + k0 + cols, mask=km, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        nxt = k0 + BLOCK_K  # the next chunk's load overlaps this chunk's arithmetic
        w = tl.load(w_ptr + nxt, mask=rm[:, None] & (nxt + cols < k_end)[None, :], other=0.0)
    if PDL >= 2:  # the weights are all read: the next kernel may take the SMs this one leaves
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, 1)
    if NORM_AFTER:
        y = y * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if SPLIT == 1:
        y = y.to(X.dtype.element_ty).to(tl.float32)  # rounded as an op in x's dtype (also for fp32 logits)
        if ADD:
            r = tl.load(R + rows, mask=rm, other=0.0)
            y = (y + r.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rm)
    else:  # fp32 partials [SPLIT, N] ([SPLIT, M, N] over a row grid)
        tl.store(Y + split * split_stride + rows, y, mask=rm)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, c: GemvConfig, norm_weight: torch.Tensor | None, eps: float,
                silu: bool, residual: torch.Tensor | None, out_dtype: torch.dtype | None,
                row_grid: bool) -> torch.Tensor:
    """The batch-1 kernel on x's rows ([M, K], checked by the caller; M > 1 needs row_grid: one program row per
    row of x, each the batch-1 GEMV of that row, so a row's result is bit-equal to gemv() on it alone)."""
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    # each split covers whole BLOCK_K chunks, so only the last chunk of K can be ragged
    per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    splits = triton.cdiv(k, per_split)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    pdl = pdl_mode(x)
    res = residual if residual is not None else y
    launch = dict(launch_pdl=True) if pdl else {}
    blocks = triton.cdiv(n, c.block_n)
    _gemv_kernel[(m, blocks, splits) if row_grid else (blocks, splits)](
        x, weight, out, res, norm_weight if norm_weight is not None else x, k, per_split, weight.stride(0), n, eps,
        x.stride(0), m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=splits, NORM=norm_weight is not None,
        NORM_BLOCK=min(8192, triton.next_power_of_2(k)), NORM_AFTER=c.norm_after, SILU=silu, ADD=residual is not None,
        PDL=pdl, ROW_GRID=row_grid, num_warps=c.num_warps, **launch)
    if splits > 1:  # the [SPLIT, M * N] partials: the sum kernel reads them flat
        sum_splits_kernel[(triton.cdiv(m * n, 1024),)](out, y, res, x, m * n, SPLIT=splits, BLOCK=1024,
                                                        ADD=residual is not None, PDL=pdl, **launch)
    return y
