"""A chained step's positions and KV slots in one launch (Triton), one program per request: the ~9 torch launches of
speculative/eagle_steps.py ChainPositions.of (arange, add, floor-divide, gather, multiply, remainder, add, add,
clamp) become one. Row j of request b: position base + j, its slot through the request's block table, the
attention length position + 1, and the position clamped to the draft's RoPE table; each output is [W, B]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chain_positions_kernel(BASE, TABLES, table_stride, table_width, POS, SLOTS, SEQ, ROPE, n, block_size,
                            max_position, W: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WP)
    m = j < W
    pos = tl.load(BASE + b) + j
    blk = pos // block_size
    # a position past the table reads block 0 (the dummy block), where the torch path's gather would fail
    page = tl.load(TABLES + b * table_stride + blk, mask=m & (blk < table_width), other=0)
    out = j * n + b
    tl.store(POS + out, pos, mask=m)
    tl.store(SLOTS + out, page * block_size + pos % block_size, mask=m)
    tl.store(SEQ + out, pos + 1, mask=m)
    tl.store(ROPE + out, tl.minimum(pos, max_position), mask=m)


def chain_positions(base: torch.Tensor, block_tables: torch.Tensor, block_size: int, width: int,
                    max_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """base [B] int64; block_tables [B, MB] int64 (unit stride along a row) -> (positions, slots, seq_lens,
    rope_positions), each [width, B] int64."""
    n = base.shape[0]
    outs = tuple(torch.empty(width, n, dtype=torch.long, device=base.device) for _ in range(4))
    if n and width:
        _chain_positions_kernel[(n,)](base, block_tables, block_tables.stride(0), block_tables.shape[1], *outs, n,
                                      block_size, max_position, W=width, WP=max(2, triton.next_power_of_2(width)),
                                      num_warps=1)
    return outs
