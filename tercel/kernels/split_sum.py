"""The deterministic split-K reduction shared by kernels.gemv and kernels.gemm_small (Triton).

A split-K product writes SPLIT fp32 partial sums [SPLIT, N]; this kernel adds them in a fixed order
(deterministic, unlike atomics), rounds to X's dtype (the one every op rounds to) and, with ADD, adds
the residual R rounded the same way. PDL: waits for the product kernel before reading its partials.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_splits_kernel(P, Y, R, X, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * N + offs, mask=m, other=0.0)
    acc = acc.to(X.dtype.element_ty).to(tl.float32)  # X: only its dtype, the one every op rounds to
    if ADD:
        r = tl.load(R + offs, mask=m, other=0.0)
        acc = (acc + r.to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=m)
