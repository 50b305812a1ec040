"""Matrix-vector product for batch-1 decode (Triton): y[1, N] = x[1, K] @ W[N, K]^T.

At batch 1 every linear layer is a pure weight stream, so the only goal is bandwidth: each
program reads BLOCK_N full rows of W with wide loads, in BLOCK_K chunks, and reduces in fp32.
Shapes with few output rows (Llama-8B o_proj / down_proj: N = 4096) give too few programs to keep
every SM streaming, so SPLIT_K > 1 also splits K: each program writes an fp32 partial sum and one
small kernel adds the SPLIT_K partials in a fixed order (deterministic, unlike atomics).
The model routes an M == 1 linear here only where tercel.kernels.gemv_tune measured it faster
than cuBLAS inside a CUDA graph (benchmarks/results/gemv_probe_h200.json has one such comparison).

Batch-1 decode also folds the small ops around each linear into it (one launch instead of two),
with the rounding of the unfused kernels in fused.py:
  norm_weight  prologue RMSNorm: x is the residual row; every program recomputes its rms over K
               (K reads from L2, cheap beside its BLOCK_N x K weights) and normalises each chunk.
               With config.norm_after the pre-pass goes: the sum of squares is gathered in the main
               loop and the fp32 dot product W (x * w) is scaled by 1/rms at the end (one pass over x;
               not the unfused rounding, but closer to exact: no bf16 rounding of the normed row)
  silu         prologue SwiGLU: x is the gate_up row [2K], the input is silu(gate) * up
  residual     epilogue: returns residual + x @ W^T (the product rounded first, as an add after it)
out_dtype=torch.float32 stores the product rounded to x's dtype and widened (the lm_head's logits:
the values of `linear(x, W).float()` without the extra copy kernel).
With PDL (kernels.pdl_mode) the first weight chunk is read before griddepcontrol.wait, so it streams while
the previous kernel drains; nothing the previous kernel writes is read, and nothing is written, before the wait.
"""
from __future__ import annotations

import torch

from .gemv_kernel import GemvConfig, launch_gemv

__all__ = ["GemvConfig", "gemv"]


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig = GemvConfig(), *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu: bool = False,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [1, K] contiguous (silu: [1, 2K], gate first), weight: [N, K] row-major -> [1, N] in x's dtype
    (or out_dtype, holding the x-dtype values). norm_weight: multiply by rms_norm(x) instead of x;
    residual [1, N]: return residual + product. x of 2..32 rows goes to kernels.gemm_small."""
    if x.dim() == 2 and x.shape[0] > 1:
        from .gemm_small import gemm_small

        return gemm_small(x, weight, config, norm_weight=norm_weight, eps=eps, silu=silu, residual=residual,
                          out_dtype=out_dtype)
    n, k = weight.shape
    if norm_weight is not None and silu:
        raise ValueError("gemv: a prologue is either the RMSNorm or the SwiGLU, not both.")
    if config.norm_after and (norm_weight is None or config.split_k != 1):
        raise ValueError(f"gemv: {config} scales by the rms after the product; it needs norm_weight and split_k=1.")
    if x.shape[-1] != (2 * k if silu else k) or not x.is_contiguous():
        raise ValueError(f"gemv: x of shape {tuple(x.shape)} does not fit a [{n}, {k}] weight (silu={silu}).")
    if residual is not None and (residual.numel() != n or not residual.is_contiguous()):
        raise ValueError(f"gemv: residual of shape {tuple(residual.shape)} does not fit {n} output rows.")
    return launch_gemv(x.reshape(1, -1), weight, config, norm_weight, eps, silu, residual, out_dtype, row_grid=False)
