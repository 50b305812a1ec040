"""Matrix-vector product for batch-1 decode (Triton): y[1, N] = x[1, K] @ W[N, K]^T.

At batch 1 every linear layer is a pure weight stream, so the only goal is bandwidth: each
program reads BLOCK_N full rows of W with wide loads, in BLOCK_K chunks, and reduces in fp32.
Shapes with few output rows (Llama-8B o_proj / down_proj: N = 4096) give too few programs to keep
every SM streaming, so SPLIT_K > 1 also splits K: each program writes an fp32 partial sum and one
small kernel adds the SPLIT_K partials in a fixed order (deterministic, unlike atomics).
The model routes an M == 1 linear here only where tercel.kernels.gemv_tune measured it faster
than cuBLAS inside a CUDA graph; benchmarks/gemv_probe.py shows the same comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4


@triton.jit
def _gemv_kernel(X, W, Y, K, K_PER_SPLIT, stride_w, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_ptr = W + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        km = k0 + cols < k_end
        x = tl.load(X + k0 + cols, mask=km, other=0.0)
        w = tl.load(w_ptr + k0, mask=rm[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if SPLIT == 1:
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rm)
    else:  # fp32 partials [SPLIT, N]
        tl.store(Y + split * N + rows, y, mask=rm)


@triton.jit
def _sum_splits_kernel(P, Y, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * N + offs, mask=m, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=m)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x: [1, K] contiguous, weight: [N, K] row-major -> [1, N] in x's dtype."""
    n, k = weight.shape
    c = config
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # each split covers whole BLOCK_K chunks, so only the last chunk of K can be ragged
    per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    splits = triton.cdiv(k, per_split)
    out = y if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, c.block_n), splits)](x, weight, out, k, per_split, weight.stride(0), n,
                                                       BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=splits,
                                                       num_warps=c.num_warps)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](out, y, n, SPLIT=splits, BLOCK=1024)
    return y
