"""`sdpa`: torch's scaled_dot_product_attention without the cuDNN backend, for the eager attention paths.

On Hopper torch picks cuDNN's fused attention for masked calls, and cuDNN builds an execution plan for every
new shape: 40-60 ms each (sometimes 0.5 s), measured on the H200. Our eager attention (EAGLE's draft_extend
over deferred rows, DFlash's block forward, the torch reference backend) sees a new context length on
nearly every call, so each call paid that plan. The memory-efficient and flash kernels (or the math path)
need no plan and cost ~0.25 ms at these sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=enable_gqa), cuDNN left out."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
    with sdpa_kernel(_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
