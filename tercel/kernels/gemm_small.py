"""Small-M GEMM for verify / draft / small-batch steps (Triton): y[M, N] = x[M, K] @ W[N, K]^T, M <= 32.

At a few rows a linear layer is still a weight stream: each program reads its BLOCK_N weight rows
once, in BLOCK_K chunks, and applies every chunk to all M rows of x (padded to BLOCK_M, the next
power of two), so the weight traffic is that of batch-1 decode. Two inner products:
  dot=False  broadcast multiply and a reduction over the chunk, in fp32 (the tuner: 2 and 4 rows)
  dot=True   tl.dot on the tensor cores, M padded to at least 16 (the fp32 model dtype uses the exact
             "ieee" precision, so fp32 stays fp32 arithmetic); swap=True: the product transposed, w @ x^T, so the
             weight rows are the MMA's M and the few tokens its N (cuBLAS's nvjet 64x8 tiles here; on sm_90
             a 64-row weight tile compiles to wgmma, the rows-as-M product to mma.sync)
  rowloop    the batch-1 GEMV's own pattern, row after row: each program holds its BLOCK_N x K weight tile (one
             chunk: K <= BLOCK_K, read before the PDL wait) and reduces it against each row of x in turn: no 3D
             product tile, and every row and result stays in the tile's 2D layout (no trip through shared
             memory per row); the rows' loads are independent and issue together
  rowgrid    the batch-1 GEMV kernel itself (tercel.kernels.gemv), one program row per row of x: each row's
             programs stream the weight block as at decode (the rows' programs of one block run side by side, so
             the block comes from HBM once and from L2 for the other rows); a row's result is bit-equal to its
             batch-1 GEMV, and the decode path's tuned configs serve it without a small-M tuning pass
Every fusion of tercel.kernels.gemv comes along, per row and with the same rounding: the RMSNorm
prologue (the normalised value rounded to the model dtype, times the weight, rounded again; or
norm_after: no pre-pass over x, the rms applied to the fp32 product), the SwiGLU prologue, the residual
epilogue, fp32 out for the logits, split-K with the deterministic sum kernel, and PDL (the first weight
chunk is read before the wait). The prologues round their outputs to the model dtype, so the
tensor-core operands lose nothing; except norm_after with dot, whose x * w is rounded once to the model
dtype for the tensor cores (the unfused norm rounds twice; dot=False keeps it exact in fp32).
(The Triton interpreter multiplies bf16 dot operands wrongly, so there the dot takes them rounded to the
model dtype and widened to fp32: products of bf16 values are exact in fp32, so the same sums as the
tensor cores' up to order.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _INTERPRET, ROW_BUCKETS, pdl_mode, row_bucket  # noqa: F401  (ROW_BUCKETS: the BLOCK_M values)
from .gemv_kernel import launch_gemv, weight_tile_start
from .split_sum import sum_splits_kernel


@triton.jit
def _prologue(X, NW, x_rows, mm, k0, cols, K, k_end, rstd,
              NORM: tl.constexpr, NORM_AFTER: tl.constexpr, SILU: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input chunk at k0 in fp32, rounded as tercel.kernels.gemv rounds it;
    also its raw fp32 values (the norm_after sum of squares)."""
    km = mm[:, None] & (k0 + cols < k_end)[None, :]
    ptr = x_rows + k0 + cols[None, :]
    xv = tl.load(ptr, mask=km, other=0.0)
    raw = xv.to(tl.float32)
    if SILU:  # as fused.silu_mul: silu(gate) rounded, then the product rounded
        u = tl.load(ptr + K, mask=km, other=0.0)
        s = (raw / (1.0 + tl.exp(-raw))).to(xv.dtype)
        x = (s.to(tl.float32) * u.to(tl.float32)).to(xv.dtype).to(tl.float32)
    elif NORM_AFTER:  # x * w exact in fp32; 1/rms after the loop
        x = raw * tl.load(NW + k0 + cols, mask=k0 + cols < k_end, other=0.0).to(tl.float32)[None, :]
    elif NORM:  # as fused.rms_norm: normalised value rounded, times the weight, rounded
        nw = tl.load(NW + k0 + cols, mask=k0 + cols < k_end, other=0.0).to(tl.float32)
        xn = (raw * rstd[:, None]).to(xv.dtype).to(tl.float32) * nw[None, :]
        x = xn.to(xv.dtype).to(tl.float32)
    else:
        x = raw
    return x, raw


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per row bucket, whatever M within it
def _gemm_small_kernel(X, W, Y, R, NW, M, K, K_PER_SPLIT, stride_x, stride_w, N, eps,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_AFTER: tl.constexpr, SILU: tl.constexpr,
                       ADD: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr,
                       PDL: tl.constexpr):
    # output columns (weight rows), the split's K range, the first weight chunk in flight before the PDL wait
    split = tl.program_id(1)
    rows, rm, cols, k_start, k_end, w_ptr, w = weight_tile_start(W, tl.program_id(0), split, K, K_PER_SPLIT,
                                                                 stride_w, N, BLOCK_N, BLOCK_K, PDL)
    ms = tl.arange(0, BLOCK_M)  # x rows
    mm = ms < M
    x_rows = X + ms.to(tl.int64)[:, None] * stride_x
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM and not NORM_AFTER:  # each row's rms over the whole of K
        nc = tl.arange(0, NORM_BLOCK)
        ssn = tl.zeros([BLOCK_M, NORM_BLOCK], tl.float32)
        for n0 in range(0, K, NORM_BLOCK):
            xv = tl.load(x_rows + n0 + nc[None, :], mask=mm[:, None] & (n0 + nc < K)[None, :], other=0.0)
            xv = xv.to(tl.float32)
            ssn += xv * xv
        rstd = tl.rsqrt(tl.sum(ssn, 1) / K + eps)
    ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWAP: the product transposed
    for k0 in range(k_start, k_end, BLOCK_K):
        x, raw = _prologue(X, NW, x_rows, mm, k0, cols, K, k_end, rstd, NORM, NORM_AFTER, SILU)
        if NORM_AFTER:
            ss += raw * raw
        if DOT and SWAP:
            if IEEE:
                acc_t = tl.dot(w.to(tl.float32), tl.trans(x.to(w.dtype).to(tl.float32)), acc_t, input_precision="ieee")
            else:
                acc_t = tl.dot(w, tl.trans(x.to(w.dtype)), acc_t)
        elif DOT:
            if IEEE:  # x as the tensor cores would take it (a no-op for fp32 weights), in fp32 arithmetic
                xw = x.to(w.dtype).to(tl.float32)
                acc = tl.dot(xw, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:  # x holds values of the weight's dtype already (norm_after: rounded here)
                acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        nxt = k0 + BLOCK_K  # the next chunk's load overlaps this chunk's arithmetic
        w = tl.load(w_ptr + nxt, mask=rm[:, None] & (nxt + cols < k_end)[None, :], other=0.0)
    if PDL >= 2:  # the weights are all read: the next kernel may take the SMs this one leaves
        tl.extra.cuda.gdc_launch_dependents()
    if SWAP:
        y = tl.trans(acc_t)
    else:
        y = acc
    if NORM_AFTER:
        y = y * tl.rsqrt(tl.sum(ss, 1) / K + eps)[:, None]
    out = ms[:, None] * N + rows[None, :]
    om = mm[:, None] & rm[None, :]
    if SPLIT == 1:
        y = y.to(X.dtype.element_ty).to(tl.float32)  # rounded as an op in x's dtype (also for fp32 logits)
        if ADD:
            r = tl.load(R + out, mask=om, other=0.0)
            y = (y + r.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + out, y.to(Y.dtype.element_ty), mask=om)
    else:  # fp32 partials [SPLIT, M, N]
        tl.store(Y + split * M * N + out, y, mask=om)


@triton.jit(do_not_specialize=["M"])
def _gemm_rows_kernel(X, W, Y, R, NW, M, K, stride_x, stride_w, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NORM: tl.constexpr, NORM_AFTER: tl.constexpr, SILU: tl.constexpr,
                      ADD: tl.constexpr, PDL: tl.constexpr):
    # every tensor is 2D in the weight tile's layout ([1, BLOCK_K] rows of x, [BLOCK_N, 1] results gathered into
    # one [BLOCK_N, BLOCK_M] tile stored at the end), so no row of x nor any result changes layout per row (each
    # change is a trip through shared memory and a barrier)
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]  # output columns: weight rows
    rm = rows < N
    cols = tl.arange(0, BLOCK_K)[None, :]
    km = cols < K
    # the whole tile, before the wait: weights never depend on the previous kernel
    w = tl.load(W + rows.to(tl.int64) * stride_w + cols, mask=rm & km, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    nw = tl.zeros([1, BLOCK_K], tl.float32)
    if NORM:
        nw = tl.load(NW + cols, mask=km, other=0.0).to(tl.float32)
    if PDL >= 2:  # the weights are all read: the next kernel may take the SMs this one leaves
        tl.extra.cuda.gdc_launch_dependents()
    ms = tl.arange(0, BLOCK_M)[None, :]
    out_mask = rm & (ms < M)
    out = Y + ms * N + rows  # [BLOCK_N, BLOCK_M]: every row's results, stored once at the end
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if ADD:
        res = tl.load(R + ms * N + rows, mask=out_mask, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_M):  # masked, not branched: the rows' loads are independent
        xm = km & (cols * 0 + m < M)  # as tensors: M is a runtime value
        xp = X + m * stride_x + cols
        xv = tl.load(xp, mask=xm, other=0.0)
        raw = xv.to(tl.float32)
        if SILU:  # as fused.silu_mul: silu(gate) rounded, then the product rounded
            u = tl.load(xp + K, mask=xm, other=0.0)
            s = (raw / (1.0 + tl.exp(-raw))).to(xv.dtype)
            x = (s.to(tl.float32) * u.to(tl.float32)).to(xv.dtype).to(tl.float32)
        elif NORM_AFTER:  # x * w exact in fp32; 1/rms after the product
            x = raw * nw
        elif NORM:  # as fused.rms_norm: normalised value rounded, times the weight, rounded
            rstd = tl.rsqrt(tl.sum(tl.sum(raw * raw, 1), 0) / K + eps)
            x = ((raw * rstd).to(xv.dtype).to(tl.float32) * nw).to(xv.dtype).to(tl.float32)
        else:
            x = raw
        y = tl.sum(w * x, 1, keep_dims=True)  # [BLOCK_N, 1]
        if NORM_AFTER:
            y = y * tl.rsqrt(tl.sum(tl.sum(raw * raw, 1), 0) / K + eps)
        acc = tl.where(ms == m, y, acc)
    y = acc.to(X.dtype.element_ty).to(tl.float32)  # rounded as an op in x's dtype (also for fp32 logits)
    if ADD:
        y = (y + res).to(X.dtype.element_ty).to(tl.float32)
    tl.store(out, y.to(Y.dtype.element_ty), mask=out_mask)


def check_config(config, m: int, k: int, silu: bool, norm: bool) -> None:
    """Refuse what the small-M kernel cannot run, naming the bad value."""
    if config.rowgrid and (config.dot or config.rowloop):
        raise ValueError(f"gemm_small: {config} runs the batch-1 GEMV once per row: it needs dot=False and "
                         f"rowloop=False.")
    if config.rowloop and (config.dot or config.split_k != 1 or config.block_k < k):
        raise ValueError(f"gemm_small: {config} loops over rows against one weight tile: it needs dot=False, "
                         f"split_k=1 and block_k >= K ({k}).")
    if config.dot and (config.block_n < 16 or config.block_k < 16):
        raise ValueError(f"gemm_small: {config} uses tl.dot, which needs block_n and block_k >= 16.")
    if config.swap and not config.dot:
        raise ValueError(f"gemm_small: {config}: swap transposes the tl.dot product; it needs dot=True.")
    if config.norm_after and (not norm or config.split_k != 1):
        raise ValueError(f"gemm_small: {config}: norm_after needs norm_weight and split_k=1.")
    if norm and silu:
        raise ValueError("gemm_small: a prologue is either the RMSNorm or the SwiGLU, not both.")
    row_bucket(m)


def gemm_small(x: torch.Tensor, weight: torch.Tensor, config, *, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, silu: bool = False, residual: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] rows with unit column stride (silu: [M, 2K], gate first), 1 < M <= 32; weight: [N, K]
    row-major -> [M, N] in x's dtype (or out_dtype). config: a tercel.kernels.gemv.GemvConfig.
    The keywords are gemv's, applied per row (residual: [M, N] contiguous)."""
    n, k = weight.shape
    m = x.shape[0]
    c = config
    check_config(c, m, k, silu, norm_weight is not None)
    if x.dim() != 2 or x.shape[1] != (2 * k if silu else k) or x.stride(1) != 1:
        raise ValueError(f"gemm_small: x of shape {tuple(x.shape)} does not fit a [{n}, {k}] weight (silu={silu}).")
    if residual is not None and (tuple(residual.shape) != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"gemm_small: residual of shape {tuple(residual.shape)} does not fit [{m}, {n}].")
    if c.rowgrid:
        return launch_gemv(x, weight, c, norm_weight, eps, silu, residual, out_dtype, row_grid=True)
    block_m = max(row_bucket(m), 16 if c.dot else 1)
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if c.rowloop:  # compiled for 8 and 16 rows (the masked rows past m cost their reductions only)
        pdl = pdl_mode(x)
        _gemm_rows_kernel[(triton.cdiv(n, c.block_n),)](
            x, weight, y, residual if residual is not None else y, norm_weight if norm_weight is not None else x, m,
            k, x.stride(0), weight.stride(0), n, eps, BLOCK_M=max(8, block_m), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            NORM=norm_weight is not None, NORM_AFTER=c.norm_after, SILU=silu, ADD=residual is not None, PDL=pdl,
            num_warps=c.num_warps, **(dict(launch_pdl=True) if pdl else {}))
        return y
    per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k  # whole chunks per split
    splits = triton.cdiv(k, per_split)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    pdl = pdl_mode(x)
    res = residual if residual is not None else y
    launch = dict(launch_pdl=True) if pdl else {}
    norm_block = min(triton.next_power_of_2(k), max(16, 8192 // block_m))  # the pre-pass tile stays small
    _gemm_small_kernel[(triton.cdiv(n, c.block_n), splits)](
        x, weight, out, res, norm_weight if norm_weight is not None else x, m, k, per_split, x.stride(0),
        weight.stride(0), n, eps, BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=splits,
        NORM=norm_weight is not None, NORM_BLOCK=norm_block, NORM_AFTER=c.norm_after, SILU=silu,
        ADD=residual is not None, DOT=c.dot, SWAP=c.swap, IEEE=x.dtype == torch.float32 or _INTERPRET, PDL=pdl,
        num_warps=c.num_warps, **launch)
    if splits > 1:  # the [SPLIT, M * N] partials summed as gemv sums its [SPLIT, N]
        sum_splits_kernel[(triton.cdiv(m * n, 1024),)](out, y, res, x, m * n, SPLIT=splits, BLOCK=1024,
                                                        ADD=residual is not None, PDL=pdl, **launch)
    return y
