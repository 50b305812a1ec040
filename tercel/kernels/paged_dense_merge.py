"""The dense half of a draft's paged attention and the merge, in one launch (Triton): attention/paged_merge.py's
~30 torch launches per draft layer (the dense keys' scores, mask, softmax and values in fp32, then the log-sum-exp
merge with the split-KV kernel's partials) become one program per (query row, head).

Per program: the row's scores over its request's C dense keys (its KV head's), in base 2 (scale * log2(e)),
masked; their softmax-normalised output and log-sum-exp; then the weighted sum of that part and the S prefix
partials, each weighted by 2^(lse - the largest lse). A part that sees no key has lse -inf and weight 0; a row
that sees nothing at all gets zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_dense_merge_kernel(Q, PART_O, PART_L, DK, DV, MASK, OUT, W, C, S, qk_scale,
                              stride_qr, stride_qh, stride_kb, stride_kc, stride_kh, stride_vb, stride_vc, stride_vh,
                              stride_mb, stride_mw, GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                              CP: tl.constexpr, SP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    b = r // W
    w = r % W
    kh = h // GROUP
    d = tl.arange(0, DP)
    dm = d < D
    q = tl.load(Q + r * stride_qr + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
    c = tl.arange(0, CP)
    cm = c < C
    seen = tl.load(MASK + b * stride_mb + w * stride_mw + c, mask=cm, other=0) != 0
    tile = cm[:, None] & dm[None, :]
    k = tl.load(DK + b * stride_kb + c[:, None] * stride_kc + kh * stride_kh + d[None, :], mask=tile,
                other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], 1) * qk_scale
    s = tl.where(seen & cm, s, float("-inf"))
    m = tl.max(s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no dense key visible: every weight 0 below, not NaN
    e = tl.exp2(s - m)
    den = tl.sum(e, 0)
    v = tl.load(DV + b * stride_vb + c[:, None] * stride_vc + kh * stride_vh + d[None, :], mask=tile,
                other=0.0).to(tl.float32)
    o_dense = tl.sum(e[:, None] * v, 0) / tl.maximum(den, 1e-30)
    lse_dense = tl.where(den > 0, m + tl.log2(tl.maximum(den, 1e-30)), float("-inf"))
    sp = tl.arange(0, SP)
    sm = sp < S
    part = (r * heads + h) * S + sp
    lse = tl.load(PART_L + part, mask=sm, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), lse_dense)
    top = tl.where(top == float("-inf"), 0.0, top)
    wp = tl.exp2(lse - top)
    wd = tl.exp2(lse_dense - top)
    po = tl.load(PART_O + part[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    num = tl.sum(tl.where(wp[:, None] > 0, wp[:, None] * po, 0.0), 0) + tl.where(wd > 0, wd * o_dense, 0.0)
    out = num / tl.maximum(tl.sum(wp, 0) + wd, 1e-30)
    tl.store(OUT + (r * heads + h) * D + d, out.to(OUT.dtype.element_ty), mask=dm)


def paged_dense_merge(q: torch.Tensor, part_o: torch.Tensor, part_l: torch.Tensor, dense_k: torch.Tensor,
                      dense_v: torch.Tensor, dense_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D] (R = B x W rows, request-major); part_o [R, H, S, D], part_l [R, H, S] fp32 contiguous (the split
    kernel's partials); dense_k / dense_v [B, C, Hkv, D]; dense_mask [B, W, C] bool (every last dimension of unit
    stride) -> [R, H, D] in q's dtype."""
    from .attention import LOG2E

    rows, heads, dim = q.shape
    b, c, kv_heads, _ = dense_k.shape
    s = part_l.shape[2]
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    cp, dp = max(2, triton.next_power_of_2(c)), max(2, triton.next_power_of_2(dim))  # the K / V tiles: [cp, dp]
    if rows:
        _paged_dense_merge_kernel[(rows, heads)](
            q, part_o, part_l, dense_k, dense_v, dense_mask, out, rows // b, c, s, scale * LOG2E,
            q.stride(0), q.stride(1), dense_k.stride(0), dense_k.stride(1), dense_k.stride(2), dense_v.stride(0),
            dense_v.stride(1), dense_v.stride(2), dense_mask.stride(0), dense_mask.stride(1),
            GROUP=heads // kv_heads, D=dim, DP=dp, CP=cp, SP=max(2, triton.next_power_of_2(s)),
            num_warps=1 if cp * dp <= 1024 else 4 if cp * dp <= 4096 else 8)
    return out
