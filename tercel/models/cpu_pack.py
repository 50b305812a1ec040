"""Which CPU kernel a linear gets at load time (bf16 on the CPU): the one choice over cpu_linear and cpu_q8."""
from __future__ import annotations

import torch

from .cpu_linear import CpuPackedLinear, PackedInt4, Q4Blocks, Q8Blocks, pack_dense
from .cpu_q8 import PackedQ4Q8, PackedQ8, q8_available


def pack_linear(weight: torch.Tensor, blocks: Q4Blocks | None) -> CpuPackedLinear:
    """4-bit when the weight came as 4-bit blocks: the Q4 x Q8 kernel where it built (cpu_q8; TERCEL_CPU_Q8=0
    turns it off), else torch's int4 kernel for shapes it takes; else dense bf16."""
    if blocks is not None and PackedQ4Q8.supports(*blocks.q.shape) and q8_available():
        return PackedQ4Q8(blocks)
    if blocks is not None and PackedInt4.supports(*blocks.q.shape):
        return PackedInt4(blocks)
    return pack_dense(weight)


def pack_head(weight: torch.Tensor, blocks: Q8Blocks | Q4Blocks | None) -> CpuPackedLinear:
    """The lm_head (or the tied embedding as the head): GGUF Q8_0 blocks on the kernel's 8-bit variant where it
    built (fp32 logits from int8 weights, half the bytes of bf16), 4-bit blocks as pack_linear, else dense bf16."""
    if isinstance(blocks, Q8Blocks):
        if PackedQ4Q8.supports(*blocks.q.shape) and q8_available():
            return PackedQ8(blocks)
        return pack_dense(weight)
    return pack_linear(weight, blocks)
