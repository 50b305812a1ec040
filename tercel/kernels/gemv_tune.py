"""Choose, per linear-layer shape, between cuBLAS and the Triton GEMV for batch-1 decode.

The choice is measured on this GPU at engine start, the way the decode step runs: every weight of
that shape in the model (so the stream does not sit in L2), called back to back inside one CUDA
graph (no host launch gaps). A GEMV config is kept only when it beats cuBLAS by 3% and matches its
output; otherwise the layer stays on cuBLAS. Takes a few seconds (Triton compiles each candidate).

The fused batch-1 decode of models/llama.py folds small ops into four GEMV roles; each role is measured
the same way against what that decode runs without it, cuBLAS (or the plain GEMV, whichever won above)
plus the kernels it absorbs:
  qkv, gate_up  RMSNorm prologue        vs rms_norm + linear
  lm_head       final RMSNorm prologue  vs rms_norm + linear (fp32 logits stored by both)
  o             residual-add epilogue   vs linear + add
  down          SwiGLU prologue + add   vs silu_mul + linear + add
and kept where it wins by 1% (both sides run the same weights, so a smaller margin than the plain choice's).
The RMSNorm roles also try each unsplit config with norm_after (the rms applied after the product, one
pass over x instead of a pre-pass per program).

Small-M forwards (verify, drafts, small batches: 2..32 rows, kernels.gemm_small) get the same five roles
measured once per row bucket (2, 4, 8, 16, 32), at the bucket's full row count, against the unfused ops at
that many rows (cuBLAS GEMMs); a bucket whose role loses keeps the unfused ops. The tl.dot configs pad to
16 rows, so one compiled kernel serves buckets 2..16 (and one 32): the buckets cost timing, not compiles;
the broadcast-product configs (narrow programs, as batch 1 wins with) up to 4, 8 or 16 rows, as their register
tile allows; and the row-loop configs (kernels.gemm_small: batch 1's GEMV applied row after row to a weight tile
of the whole K), where K fits one tile.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .fused import rms_norm, silu_mul
from .gemv import GemvConfig, gemv

log = logging.getLogger(__name__)

CANDIDATES = (
    GemvConfig(block_n=4, block_k=1024, num_warps=8), GemvConfig(block_n=8, block_k=512),
    GemvConfig(block_n=16, block_k=512), GemvConfig(block_n=8, block_k=512, split_k=2),
    GemvConfig(block_n=8, block_k=512, split_k=4), GemvConfig(block_n=4, block_k=1024, split_k=4, num_warps=8),
    GemvConfig(block_n=8, block_k=1024, num_warps=8), GemvConfig(block_n=32, block_k=256, num_warps=8),
    # small programs in many waves: the hardware balances the SMs' shares of a small matrix (qkv, o) better
    GemvConfig(block_n=4, block_k=512), GemvConfig(block_n=2, block_k=1024),
    GemvConfig(block_n=2, block_k=2048, num_warps=8),
)
MIN_GAIN = 0.97  # keep a GEMV config only if it takes < 97% of cuBLAS's time
MIN_GAIN_FUSED = 0.99  # a fused role: < 99% of the unfused ops' time
SMALL_M_DOT = (  # every row bucket; wide programs re-read the rows of x (and their norm pre-pass) less often
    GemvConfig(block_n=16, block_k=256, dot=True), GemvConfig(block_n=32, block_k=128, dot=True),
    GemvConfig(block_n=64, block_k=128, num_warps=8, dot=True),
    GemvConfig(block_n=16, block_k=256, split_k=4, dot=True),
    # the product transposed (weight rows as the MMA's M, wgmma on sm_90), as cuBLAS's small-M tiles take it;
    # 64 weight rows a program leave few programs on a small matrix, so also split K in 4
    GemvConfig(block_n=64, block_k=64, dot=True, swap=True),
    GemvConfig(block_n=64, block_k=64, split_k=4, dot=True, swap=True),
    GemvConfig(block_n=128, block_k=64, num_warps=8, dot=True, swap=True),
)
# Broadcast-product configs: many narrow programs, as the batch-1 GEMV wins with on small matrices. The rows x
# block_n x block_k product tile is 8192 values (64 fp32 registers a thread at 4 warps) at most, past which it
# spills, so each serves up to the row bucket named beside it (each compile costs start-up time).
SMALL_M_BROADCAST = ((GemvConfig(block_n=8, block_k=256), 4), (GemvConfig(block_n=4, block_k=256), 8),
                     (GemvConfig(block_n=2, block_k=512), 8), (GemvConfig(block_n=2, block_k=256), 16))


@dataclass(frozen=True, slots=True)
class GemvChoice:
    shape: tuple[int, int]  # (N, K)
    layers: int  # weights of this shape in the model
    cublas_us: float
    gemv_us: float | None
    config: GemvConfig | None  # None: cuBLAS (fused roles: None keeps the unfused ops)
    role: str = "plain"  # plain, or the fused role: qkv, o, gate_up, down
    rows: int = 1  # 1: batch-1 decode; else the small-M row bucket measured


def _graph_time(fn, replays: int = 5) -> float:
    """Seconds per replay of `fn` captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / 1e3


def _fastest(run, want: torch.Tensor, weights: list[torch.Tensor], candidates,
             what: str) -> tuple[float, GemvConfig] | None:
    """(seconds per graph of `weights`, config) of the fastest candidate whose run(weights[0], c) is
    within 1e-2 of `want` (relative norm), or None when none compiles and agrees."""
    best: tuple[float, GemvConfig] | None = None
    for c in candidates:
        try:
            err = float((run(weights[0], c).float() - want).norm() / want.norm().clamp_min(1e-6))
            if err > 1e-2:
                log.debug("%s %s: error %.2e", what, c, err)
                continue
            t = _graph_time(lambda: [run(w, c) for w in weights])
        except Exception as e:  # a config this GPU cannot compile or fit
            log.debug("%s config %s failed: %s", what, c, e)
            continue
        if best is None or t < best[0]:
            best = (t, c)
    return best


def tune_shape(weights: list[torch.Tensor], candidates=CANDIDATES, out_dtype: torch.dtype | None = None) -> GemvChoice:
    """out_dtype: what the caller widens the product to (the lm_head's fp32 logits): cuBLAS is timed
    with its widening copy, the GEMV storing it directly, as the decode runs them."""
    n, k = weights[0].shape
    x = torch.randn(1, k, device=weights[0].device, dtype=weights[0].dtype)
    lin = _linear_fn(None, out_dtype)
    t_cublas = _graph_time(lambda: [lin(x, w) for w in weights])
    ref = F.linear(x, weights[0]).float()
    best = _fastest(lambda w, c: gemv(x, w, c, out_dtype=out_dtype), ref, weights, candidates, f"gemv {(n, k)}")
    per = 1e6 / len(weights)
    keep = best is not None and best[0] < MIN_GAIN * t_cublas
    return GemvChoice((n, k), len(weights), round(t_cublas * per, 2), round(best[0] * per, 2) if best else None,
                      best[1] if keep else None)


ROLES = {"qkv": "norm", "gate_up": "norm", "lm_head": "norm", "o": "add", "down": "silu_add"}


def _linear_fn(config: GemvConfig | None, out_dtype: torch.dtype | None = None):
    if config is None:
        return (lambda x, w: F.linear(x, w)) if out_dtype is None else (lambda x, w: F.linear(x, w).to(out_dtype))
    return lambda x, w: gemv(x, w, config, out_dtype=out_dtype)


# Row-loop configs (block_n, num_warps): the batch-1 GEMV's narrow programs, each holding its whole K as one tile
# (block_k = K rounded up to a power of two), at most 64 fp32 weight values a thread
# (up to 16 rows, compiled for 8 and 16: each compile costs start-up time)
SMALL_M_ROWLOOP = ((2, 4), (4, 4), (4, 8))
# the batch-1 GEMV once per row (rowgrid): the block shapes the batch-1 tuner keeps for small matrices
SMALL_M_ROWGRID = (GemvConfig(block_n=2, block_k=1024, rowgrid=True), GemvConfig(block_n=4, block_k=512, rowgrid=True),
                   GemvConfig(block_n=8, block_k=1024, num_warps=8, rowgrid=True))


def small_m_candidates(rows: int, k: int | None = None) -> list[GemvConfig]:
    """What tune_role tries for a small-M row bucket of a [N, k] weight (before tune_role's own split and
    norm_after rules); without k, no row-loop configs."""
    out = list(SMALL_M_DOT) + [c for c, most in SMALL_M_BROADCAST if rows <= most]
    if rows <= 16:
        out += SMALL_M_ROWGRID
    if k is not None and rows <= 16:
        tile = 1 << max(4, (k - 1).bit_length())
        out += [GemvConfig(block_n=bn, block_k=tile, num_warps=nw, rowloop=True) for bn, nw in SMALL_M_ROWLOOP
                if bn * tile <= 64 * 32 * nw]
    return out


def tune_role(role: str, weights: list[torch.Tensor], plain: GemvConfig | None,
              candidates=CANDIDATES, rows: int = 1) -> GemvChoice:
    """The fused GEMV of one role against its unfused ops (plain: the linear's own choice, batch 1 only:
    more rows run cuBLAS), with `rows` rows of input (> 1: the small-M GEMM)."""
    n, k = weights[0].shape
    dev, dt = weights[0].device, weights[0].dtype
    kind = ROLES[role]
    plain = plain if rows == 1 else None
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, 2 * k if kind == "silu_add" else k, device=dev, dtype=dt, generator=g)
    r = torch.randn(rows, n, device=dev, dtype=dt, generator=g)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
    out_dtype = torch.float32 if role == "lm_head" else None  # the logits are fp32
    lin = _linear_fn(plain, out_dtype)
    if kind == "norm":
        ref = lambda w: lin(rms_norm(x, nw, 1e-5), w)  # noqa: E731
        fused = lambda w, c: gemv(x, w, c, norm_weight=nw, eps=1e-5, out_dtype=out_dtype)  # noqa: E731
        want = F.linear(rms_norm(x, nw, 1e-5), weights[0]).float()
    elif kind == "add":
        ref = lambda w: r + lin(x, w)  # noqa: E731
        fused = lambda w, c: gemv(x, w, c, residual=r)  # noqa: E731
        want = (r.float() + F.linear(x, weights[0]).float())
    else:
        ref = lambda w: r + lin(silu_mul(x), w)  # noqa: E731
        fused = lambda w, c: gemv(x, w, c, silu=True, residual=r)  # noqa: E731
        want = (r.float() + F.linear(silu_mul(x), weights[0]).float())
    t_ref = _graph_time(lambda: [ref(w) for w in weights])
    # with 16384+ rows there are plenty of row programs already: no split-K
    fit = [c for c in candidates if not (c.split_k > 1 and n >= 16384)]
    if kind == "norm":
        fit += [replace(c, norm_after=True) for c in fit if c.split_k == 1 and not c.norm_after]
    best = _fastest(fused, want, weights, fit, f"fused gemv {role} x{rows}")
    per = 1e6 / len(weights)
    keep = best is not None and best[0] < MIN_GAIN_FUSED * t_ref
    return GemvChoice((n, k), len(weights), round(t_ref * per, 2), round(best[0] * per, 2) if best else None,
                      best[1] if keep else None, role, rows)
