"""Which CPU kernel a linear gets at load time (bf16 on the CPU): the one choice over cpu_linear and cpu_q8."""
from __future__ import annotations

import torch

from .cpu_linear import CpuPackedLinear, PackedInt4, Q4Blocks, pack_dense
from .cpu_q8 import PackedQ4Q8, q8_available


def pack_linear(weight: torch.Tensor, blocks: Q4Blocks | None) -> CpuPackedLinear:
    """4-bit when the weight came as 4-bit blocks: the Q4 x Q8 kernel where it built (cpu_q8; TERCEL_CPU_Q8=0
    turns it off), else torch's int4 kernel for shapes it takes; else dense bf16."""
    if blocks is not None and PackedQ4Q8.supports(*blocks.q.shape) and q8_available():
        return PackedQ4Q8(blocks)
    if blocks is not None and PackedInt4.supports(*blocks.q.shape):
        return PackedInt4(blocks)
    return pack_dense(weight)
