"""Matrix-vector product for batch-1 decode (Triton): y[1, N] = x[1, K] @ W[N, K]^T.

At batch 1 every linear layer is a pure weight stream, so the only goal is bandwidth: each
program reads BLOCK_N full rows of W with wide loads, in BLOCK_K chunks, and reduces in fp32.
Not wired into the model: benchmarks/gemv_probe.py measures it against cuBLAS (F.linear) at the
Llama-8B and SmolLM2 shapes; route M == 1 linears through it only where that measurement wins.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, Y, K, stride_w, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_ptr = W + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(X + k0 + cols)
            w = tl.load(w_ptr + k0, mask=rm[:, None], other=0.0)
        else:
            km = k0 + cols < K
            x = tl.load(X + k0 + cols, mask=km, other=0.0)
            w = tl.load(w_ptr + k0, mask=rm[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rm)


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3) -> torch.Tensor:
    """x: [1, K] contiguous, weight: [N, K] row-major -> [1, N] in x's dtype."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, y, k, weight.stride(0), n, BLOCK_N=block_n, BLOCK_K=block_k,
                                              EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    return y
