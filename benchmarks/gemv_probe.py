"""Batch-1 linear layers at Llama-3.1-8B shapes: cuBLAS (F.linear) vs the Triton GEMV, achieved
bandwidth (weight bytes / time) against the measured copy bandwidth, timed both launch by launch
and inside one CUDA graph (the decode step's case: no host launch overhead between kernels). Decides whether the model
routes M == 1 linears through tercel.kernels.gemv. Usage: PYTHONPATH=. python benchmarks/gemv_probe.py"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from tercel.kernels.gemv import gemv
from tercel.kernels.gemv_tune import CANDIDATES

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "smol_qkv": (960, 576), "smol_gate_up": (3072, 576), "smol_down": (576, 1536)}
CONFIGS = CANDIDATES


def bench(fn, reps=50, rotate=None):
    for _ in range(5):
        fn(0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        fn(i % rotate)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def bench_graph(fn, reps=50, rotate=1):
    """Kernel time without host launch overhead: `reps` calls captured in one CUDA graph, replayed
    (as the decode step runs them)."""
    for i in range(3):
        fn(i % rotate)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % rotate)
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (5 * reps) / 1e3


def main():
    out = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, (1 << 30) // (n * k * 2))  # rotate over > L2 worth of weights
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 8))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])
        nbytes = n * k * 2
        t_cublas = bench(lambda i: F.linear(x, ws[i]), rotate=len(ws))
        g_cublas = bench_graph(lambda i: F.linear(x, ws[i]), rotate=len(ws))
        row = {"cublas_us": round(t_cublas * 1e6, 2), "cublas_graph_us": round(g_cublas * 1e6, 2),
               "cublas_graph_TBps": round(nbytes / g_cublas / 1e12, 3)}
        best = None
        for cfg in CONFIGS:  # chosen by the in-graph time, as the engine's tuner does
            try:
                err = float((gemv(x, ws[0], cfg).float() - ref.float()).norm() / ref.float().norm())
                if err > 1e-2:
                    continue
                t = bench_graph(lambda i: gemv(x, ws[i], cfg), rotate=len(ws))
            except Exception:  # a config that does not compile or fit
                continue
            if best is None or t < best[0]:
                best = (t, cfg, err)
        if best:
            t_launch = bench(lambda i: gemv(x, ws[i], best[1]), rotate=len(ws))
            row.update(triton_us=round(t_launch * 1e6, 2), triton_graph_us=round(best[0] * 1e6, 2),
                       triton_graph_TBps=round(nbytes / best[0] / 1e12, 3), triton_cfg=str(best[1]),
                       triton_rel_err=best[2])
        out[name] = row
        print(name, row, flush=True)
        ws = []  # free the copies before the next shape
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
