"""A draft head's product over int8 weights with one fp32 scale per row (Triton): logits[m, n] = scale[n] *
sum_k x[m, k] * q[n, k], in fp32.

A draft's head is its largest read per draft step (SmolLM2's EAGLE-3 draft uses the target's 49152 x 576 lm_head:
57 MB in bf16, more than the GPU's L2). In int8 it is half the bytes and fits the L2, so the draft steps after the
first of a chained step read it from there. Only the draft's proposals can change (the target verifies them);
tercel.speculative.eagle applies it under TERCEL_DRAFT_HEAD=int8 (developer switch until measured).
Each program reduces BLOCK_N weight rows against one row of x, as the batch-1 GEMV does; several rows of x
(tree drafts, batches) take one program column each and re-read the weights, from the L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_q8_kernel(X, Q, S, Y, K, N, stride_x, stride_q, stride_y, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    cols = tl.arange(0, BLOCK_K)
    q_ptr = Q + rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = k0 + cols < K
        q = tl.load(q_ptr + k0, mask=rm[:, None] & km[None, :], other=0)
        x = tl.load(X + m * stride_x + k0 + cols, mask=km, other=0.0).to(tl.float32)
        acc += q.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1) * tl.load(S + rows, mask=rm, other=0.0)
    tl.store(Y + m * stride_y + rows, y, mask=rm)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q [N, K] int8, scale [N] fp32) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = wf.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def gemv_q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product in torch (CPU, or checks): fp32 [M, N]."""
    return torch.nn.functional.linear(x.float(), q.float()) * scale


def gemv_q8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_n: int = 32, block_k: int = 256,
            num_warps: int = 8) -> torch.Tensor:
    """x [M, K] (any float dtype, unit column stride), q [N, K] int8 row-major, scale [N] fp32 -> fp32 [M, N].
    The default tile is the one the GEMV tuner kept for SmolLM2's bf16 lm_head on an H100 (32 x 256, 8 warps)."""
    n, k = q.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gemv_q8: x of shape {tuple(x.shape)} does not fit an int8 [{n}, {k}] head.")
    if q.dtype != torch.int8 or q.stride(1) != 1 or scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"gemv_q8: q must be int8 [N, K] row-major and scale fp32 [N]; got {q.dtype} "
                         f"{tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}.")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m:
        _gemv_q8_kernel[(triton.cdiv(n, block_n), m)](x, q, scale, y, k, n, x.stride(0), q.stride(0), y.stride(0),
                                                       BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
