"""Choose, per linear-layer shape, between cuBLAS and the Triton GEMV for batch-1 decode.

The choice is measured on this GPU at engine start, the way the decode step runs: every weight of
that shape in the model (so the stream does not sit in L2), called back to back inside one CUDA
graph (no host launch gaps). A GEMV config is kept only when it beats cuBLAS by 3% and matches its
output; otherwise the layer stays on cuBLAS. Takes a few seconds (Triton compiles each candidate).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .gemv import GemvConfig, gemv

log = logging.getLogger(__name__)

CANDIDATES = (
    GemvConfig(block_n=4, block_k=1024, num_warps=8), GemvConfig(block_n=8, block_k=512),
    GemvConfig(block_n=16, block_k=512), GemvConfig(block_n=8, block_k=512, split_k=2),
    GemvConfig(block_n=8, block_k=512, split_k=4), GemvConfig(block_n=4, block_k=1024, split_k=4, num_warps=8),
)
MIN_GAIN = 0.97  # keep a GEMV config only if it takes < 97% of cuBLAS's time


@dataclass(frozen=True, slots=True)
class GemvChoice:
    shape: tuple[int, int]  # (N, K)
    layers: int  # weights of this shape in the model
    cublas_us: float
    gemv_us: float | None
    config: GemvConfig | None  # None: cuBLAS


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


def tune_shape(weights: list[torch.Tensor], candidates=CANDIDATES) -> GemvChoice:
    n, k = weights[0].shape
    x = torch.randn(1, k, device=weights[0].device, dtype=weights[0].dtype)
    t_cublas = _graph_time(lambda: [F.linear(x, w) for w in weights])
    ref = F.linear(x, weights[0]).float()
    best: tuple[float, GemvConfig] | None = None
    for c in candidates:
        try:
            err = float((gemv(x, weights[0], c).float() - ref).norm() / ref.norm().clamp_min(1e-6))
            if err > 1e-2:
                continue
            t = _graph_time(lambda: [gemv(x, w, c) for w in weights])
        except Exception as e:  # a config this GPU cannot compile or fit
            log.debug("gemv config %s failed for %s: %s", c, (n, k), e)
            continue
        if best is None or t < best[0]:
            best = (t, c)
    per = 1e6 / len(weights)
    keep = best is not None and best[0] < MIN_GAIN * t_cublas
    return GemvChoice((n, k), len(weights), round(t_cublas * per, 2), round(best[0] * per, 2) if best else None,
                      best[1] if keep else None)


@torch.inference_mode()
def tune_model(model: torch.nn.Module) -> list[GemvChoice]:
    """Measure every bias-free Linear shape of `model` (and its tied lm_head) and set each layer's
    `gemv` config. Returns the measurements (also logged)."""
    from ..models.linear import Linear

    groups: dict[tuple[int, int], list[Linear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, Linear) and m.bias is None and m.weight.is_cuda:
            groups[tuple(m.weight.shape)].append(m)
    # measure everything first, then set: a failure part-way leaves every layer on cuBLAS
    measured = [(mods, tune_shape([m.weight for m in mods])) for mods in groups.values()]
    tied = getattr(model, "lm_head", 0) is None and model.lm_head_weight.is_cuda  # the embedding is the head
    head_choice = tune_shape([model.lm_head_weight]) if tied else None
    for mods, choice in measured:
        for m in mods:
            m.gemv = choice.config
    if head_choice is not None:
        model.lm_head_gemv = head_choice.config
    choices = [c for _, c in measured] + ([head_choice] if head_choice is not None else [])
    for c in choices:
        log.info("batch-1 linear %s x%d: cuBLAS %.1f us, GEMV %s us -> %s", c.shape, c.layers, c.cublas_us,
                 c.gemv_us, c.config or "cuBLAS")
    return choices
