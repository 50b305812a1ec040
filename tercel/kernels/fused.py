"""Fused elementwise kernels for the decoder layer (Triton):

  add_rms_norm  residual + x and RMSNorm of the sum, one pass (2 launches -> 1, plus 6 for bf16 norm)
  rms_norm      RMSNorm alone (the first layer's input)
  silu_mul      SwiGLU: silu(gate) * up from the fused gate_up projection
  rope_store    RoPE on q and k, k and v written straight into the paged cache, rotated q returned
  embed_norms   an EAGLE-3 draft layer's input: embedding lookup, its norm and the hidden state's, concatenated
silu_mul and rope_store can also finish an RMSNorm folded into the weight before them (norm_of): the GEMM
multiplied the raw residual by weight * norm weight, and each row is scaled by its residual's 1/rms here.

Each matches the PyTorch formula of models/llama.py and models/rope.py in fp32 arithmetic, rounding
where PyTorch rounds (the normalised value to the model dtype before the weight multiply, silu(gate)
before the product), so the GPU path stays close to the CPU reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl_small


@triton.jit
def _rms_norm_kernel(X, R, W, Y, ROUT, stride_x, stride_r, stride_y, stride_ro, n_cols, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    w = tl.load(W + offs, mask=m, other=0.0)  # the weight never depends on the previous kernel
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ROUT + row * stride_ro + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    if PDL:  # the inputs are read: the next kernel (a GEMV) may start streaming its weights
        tl.extra.cuda.gdc_launch_dependents()
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(x.dtype), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    y = torch.empty_like(x2)
    n = x2.shape[-1]
    if x2.shape[0]:
        pdl = pdl_small(x2, norm=True)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, x2.stride(0), x2.stride(0), y.stride(0), y.stride(0),
                                         n, eps, HAS_RES=False, BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=4,
                                         **(dict(launch_pdl=True) if pdl else {}))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); neither input is modified."""
    x2, r2 = _rows(x), _rows(residual)
    y = torch.empty_like(x2)
    r_out = torch.empty_like(x2)
    n = x2.shape[-1]
    if x2.shape[0]:
        pdl = pdl_small(x2, norm=True)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, r_out, x2.stride(0), r2.stride(0), y.stride(0),
                                         r_out.stride(0), n, eps, HAS_RES=True, BLOCK=triton.next_power_of_2(n),
                                         PDL=pdl, num_warps=4, **(dict(launch_pdl=True) if pdl else {}))
    return y.view(x.shape), r_out.view(x.shape)


@triton.jit
def _row_rstd(R, row, stride_r, hidden, eps, BLOCK_R: tl.constexpr):
    """1 / rms of a residual row, as _rms_norm_kernel computes it (the norm folded into the weights, fold_norms)."""
    offs = tl.arange(0, BLOCK_R)
    r = tl.load(R + row * stride_r + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(r * r, axis=0) / hidden + eps)


@triton.jit
def _silu_mul_kernel(GU, OUT, R, stride_gu, stride_o, stride_r, n_cols, hidden, eps, BLOCK: tl.constexpr,
                     NORM: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    if PDL:  # nothing read or written before the previous kernel is done
        tl.extra.cuda.gdc_wait()
    g = tl.load(GU + row * stride_gu + offs, mask=m, other=0.0)
    u = tl.load(GU + row * stride_gu + n_cols + offs, mask=m, other=0.0)
    gf, uf = g.to(tl.float32), u.to(tl.float32)
    if NORM:  # gate_up came from the norm-folded weight: scale by the residual row's 1/rms, rounded as a GEMM's out
        rstd = _row_rstd(R, row, stride_r, hidden, eps, BLOCK_R)
        gf = (gf * rstd).to(g.dtype).to(tl.float32)
        uf = (uf * rstd).to(g.dtype).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(OUT + row * stride_o + offs, (s.to(tl.float32) * uf).to(g.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor, norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """gate_up: [..., 2I] (gate first) -> [..., I]. norm_of: (residual [rows, H], eps) when gate_up is the
    product of the un-normed residual with the norm-folded weight (LlamaForCausalLM.fold_norms): each row is
    first scaled by its residual row's 1/rms, which completes the RMSNorm."""
    x2 = _rows(gate_up)
    n = x2.shape[-1] // 2
    out = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)
    block = min(1024, triton.next_power_of_2(n))
    r = x2 if norm_of is None else _rows(norm_of[0])
    hidden = r.shape[-1]
    if x2.shape[0]:
        pdl = pdl_small(x2)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, r, x2.stride(0), out.stride(0), r.stride(0), n, hidden, 0.0 if norm_of is None else norm_of[1],
            BLOCK=block, NORM=norm_of is not None, BLOCK_R=triton.next_power_of_2(hidden), PDL=pdl, num_warps=4,
            **(dict(launch_pdl=True) if pdl else {}))
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _norm_rope_kernel(X, W, COS, SIN, Y, stride_xn, stride_xh, stride_cn, stride_sn, stride_yn, stride_yh, n_heads,
                      eps, D: tl.constexpr, HP: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    partner = tl.where(d < D // 2, d + D // 2, d - D // 2)  # rotate-half's source column
    m = (h < n_heads) & (d < D)
    row = X + n * stride_xn + h * stride_xh
    x = tl.load(row + d, mask=m, other=0.0)
    xp = tl.load(row + partner, mask=m, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
    # each op rounds to the model dtype where torch's RMSNorm and apply_rope do
    y = ((xf * rstd).to(x.dtype).to(tl.float32) * tl.load(W + d).to(tl.float32)).to(x.dtype).to(tl.float32)
    yp = ((xp.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * tl.load(W + partner).to(tl.float32))
    yp = yp.to(x.dtype).to(tl.float32)
    rot = tl.where(d < D // 2, -yp, yp)
    c = tl.load(COS + n * stride_cn + d).to(tl.float32)
    s = tl.load(SIN + n * stride_sn + d).to(tl.float32)
    out = (y * c).to(x.dtype).to(tl.float32) + (rot * s).to(x.dtype).to(tl.float32)
    tl.store(Y + n * stride_yn + h * stride_yh + d, out.to(x.dtype), mask=m)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x), cos, sin) per head in one launch (a DFlash draft's q / k norms): x [N, H, D] (last
    dim contiguous, D a power of two), weight [D], cos / sin [N, 1, D] (rows strided, last dim contiguous) ->
    a new [N, H, D] tensor."""
    n, heads, d = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"rms_norm_rope needs contiguous last dims and a power-of-two head dim, got x "
                         f"{tuple(x.shape)} (strides {x.stride()}).")
    y = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n:
        _norm_rope_kernel[(n,)](x, weight, cos, sin, y, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                y.stride(0), y.stride(1), heads, eps, D=d, HP=triton.next_power_of_2(heads),
                                num_warps=4)
    return y


@triton.jit
def _rope_store_kernel(QK, V, COS, SIN, LOC, QOUT, KC, VC, R,
                       stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st,
                       stride_qot, stride_qoh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_r, hidden, eps,
                       NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HV: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr,
                       PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hm = h < NQ + NKV
    if PDL:  # nothing read or written before the previous kernel is done
        tl.extra.cuda.gdc_wait()
    base = QK + t * stride_qkt + h[:, None] * stride_qkh + d[None, :]
    x1 = tl.load(base, mask=hm[:, None], other=0.0)
    x2 = tl.load(base + HALF, mask=hm[:, None], other=0.0)
    c1 = tl.load(COS + t * stride_ct + d).to(tl.float32)[None, :]
    c2 = tl.load(COS + t * stride_ct + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(SIN + t * stride_st + d).to(tl.float32)[None, :]
    s2 = tl.load(SIN + t * stride_st + HALF + d).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0
    if NORM:  # qkv came from the norm-folded weight: scale by the residual row's 1/rms, rounded as a GEMM's out
        rstd = _row_rstd(R, t, stride_r, hidden, eps, BLOCK_R)
        x1f = (x1f * rstd).to(x1.dtype).to(tl.float32)
        x2f = (x2f * rstd).to(x1.dtype).to(tl.float32)
    o1 = (x1f * c1 - x2f * s1).to(x1.dtype)
    o2 = (x2f * c2 + x1f * s2).to(x1.dtype)
    is_q = h < NQ
    qo = QOUT + t * stride_qot + h[:, None] * stride_qoh + d[None, :]
    tl.store(qo, o1, mask=is_q[:, None])
    tl.store(qo + HALF, o2, mask=is_q[:, None])
    loc = tl.load(LOC + t).to(tl.int64)
    is_k = (h >= NQ) & hm
    kh = tl.where(is_k, h - NQ, 0)
    ko = KC + loc * stride_kcs + kh[:, None] * stride_kch + d[None, :]
    tl.store(ko, o1, mask=is_k[:, None])
    tl.store(ko + HALF, o2, mask=is_k[:, None])
    hv = tl.arange(0, BLOCK_HV)
    vm = hv < NKV
    dv = tl.arange(0, 2 * HALF)
    vals = tl.load(V + t * stride_vt + hv[:, None] * stride_vh + dv[None, :], mask=vm[:, None], other=0.0)
    if NORM:
        vals = (vals.to(tl.float32) * rstd).to(x1.dtype)
    if PDL:  # every input is read
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(VC + loc * stride_vcs + hv[:, None] * stride_vch + dv[None, :], vals, mask=vm[:, None])


def rope_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_cache_loc: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
               norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """qk: [T, H + Hkv, D] (views into the fused qkv output), v: [T, Hkv, D]; cos/sin: [T, 1, D] or [T, D];
    k_cache/v_cache: [slots, Hkv, D] of one layer. Writes rotated k and v at out_cache_loc, returns
    rotated q [T, H, D]. norm_of: (residual [T, hidden], eps) when qkv is the product of the un-normed residual
    with the norm-folded weight (LlamaForCausalLM.fold_norms): q, k and v are first scaled by each row's 1/rms."""
    t, heads, dim = qk.shape
    nkv = heads - num_heads
    if qk.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rope_store needs the head dimension contiguous.")
    if dim & (dim - 1):
        raise ValueError(f"rope_store needs a power-of-two head_dim, got {dim}.")
    cos2, sin2 = cos.reshape(t, -1), sin.reshape(t, -1)
    q_out = torch.empty((t, num_heads, dim), dtype=qk.dtype, device=qk.device)
    r = qk if norm_of is None else _rows(norm_of[0])
    hidden = r.shape[-1] if norm_of is not None else 1
    if t:
        pdl = pdl_small(qk)
        _rope_store_kernel[(t,)](
            qk, v, cos2, sin2, out_cache_loc, q_out, k_cache, v_cache, r,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos2.stride(0), sin2.stride(0),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), r.stride(0), hidden, 0.0 if norm_of is None else norm_of[1],
            NQ=num_heads, NKV=nkv, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_HV=triton.next_power_of_2(nkv), NORM=norm_of is not None, BLOCK_R=triton.next_power_of_2(hidden),
            PDL=pdl, num_warps=4, **(dict(launch_pdl=True) if pdl else {}))
    return q_out


@triton.jit
def _embed_norms_kernel(IDS, E, H, WE, WH, Y, stride_e, stride_h, stride_y, n_cols, eps,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    we = tl.load(WE + offs, mask=m, other=0.0).to(tl.float32)  # the weights never depend on the previous kernel
    wh = tl.load(WH + offs, mask=m, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    tok = tl.load(IDS + row).to(tl.int64)
    e = tl.load(E + tok * stride_e + offs, mask=m, other=0.0)
    h = tl.load(H + row * stride_h + offs, mask=m, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ef, hf = e.to(tl.float32), h.to(tl.float32)
    re = tl.rsqrt(tl.sum(ef * ef, axis=0) / n_cols + eps)
    rh = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    # rounded as _rms_norm_kernel rounds: the normalised value, then its product with the weight
    ye = (ef * re).to(e.dtype).to(tl.float32) * we
    yh = (hf * rh).to(e.dtype).to(tl.float32) * wh
    tl.store(Y + row * stride_y + offs, ye.to(e.dtype), mask=m)
    tl.store(Y + row * stride_y + n_cols + offs, yh.to(e.dtype), mask=m)


def embed_norms(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """cat([rms_norm(table[ids]) * w_embed, rms_norm(hidden) * w_hidden], -1) in one launch (an EAGLE-3 draft
    layer's input: the embedding lookup, its two norms and the concatenation were four): ids [N], table [V, H],
    hidden [N, H] (all one dtype, last dims contiguous), both norms with one eps -> [N, 2H]."""
    n, cols = hidden.shape
    if table.stride(-1) != 1 or hidden.stride(-1) != 1 or table.dtype != hidden.dtype:
        raise ValueError(f"embed_norms needs contiguous last dims and one dtype, got table {table.dtype} "
                         f"{tuple(table.stride())}, hidden {hidden.dtype} {tuple(hidden.stride())}.")
    y = torch.empty((n, 2 * cols), dtype=hidden.dtype, device=hidden.device)
    if n:
        pdl = pdl_small(hidden, norm=True)
        _embed_norms_kernel[(n,)](ids, table, hidden, w_embed, w_hidden, y, table.stride(0), hidden.stride(0),
                                  y.stride(0), cols, eps, BLOCK=triton.next_power_of_2(cols), PDL=pdl, num_warps=4,
                                  **(dict(launch_pdl=True) if pdl else {}))
    return y
