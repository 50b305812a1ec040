"""Sampled decode rows at graph speed: `sample_rows` (temperature, top-k / top-p / min-p, the race with each
row's stream key) captured as one CUDA graph per (batch bucket, filters in use).

Eagerly, a sampled step launches ~45 small kernels (the stream keys' hash, the sort, softmaxes, cumsum,
masks, the race) and at batch 1 their launches, not the GPU, set the pace. Replayed, the same work is the
graph launch plus a few input copies. The keys are hashed inside the graph from each row's seed and draw
index, so a row's draw is the same as the eager path's (sampling.stream_keys, sampling.sample_rows).

Plain decode windows draw inside the decode graph instead (graphs/sampled_decode.py); these graphs serve the
plain windows adaptive speculation grants, whose forward is the drafter's (it keeps hidden rows too).

Graphs are captured on first use (a bucket and a filter set that a batch needs), share one memory pool and
never run concurrently (one stream). Batches above `max_bs` run eagerly: there the GPU, not the launches,
sets the pace.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch

from ..sampling import SamplingTensors, sample_rows, stream_keys
from .runner import collector_paused

log = logging.getLogger(__name__)

SAMPLER_GRAPH_MAX_BS = 64


@dataclass(slots=True)
class _SamplerGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, V] static inputs ...
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    draws: torch.Tensor
    out: torch.Tensor  # [bucket] token ids
    bound: SamplingTensors | None = None  # the settings last copied in (a window's steps share them)


class SamplerGraphs:
    def __init__(self, vocab: int, device: torch.device, max_bs: int = SAMPLER_GRAPH_MAX_BS,
                 stream: torch.cuda.Stream | None = None, exact: torch.dtype | None = None):
        self.vocab, self.device, self.max_bs = vocab, device, max_bs
        self.exact = exact  # the target's logits_exact_dtype (sample_rows)
        self.graphs: dict[tuple[int, torch.dtype, bool, bool, bool], _SamplerGraph] = {}
        self.pool = None
        self.stream = stream  # the executor's capture stream (None: one of its own, made at the first capture)
        self.stats = collections.Counter()  # replays, eager, captures

    @staticmethod
    def bucket(b: int) -> int:
        return 1 << (b - 1).bit_length()

    def sample(self, logits: torch.Tensor, st: SamplingTensors, seeds: torch.Tensor,
               draws: torch.Tensor) -> torch.Tensor:
        """sample_rows(logits, st, stream_keys(seeds, draws)) for logits [b, V]: token ids [b] on the device (a
        fresh tensor), no host sync. A replay when b <= max_bs, else eager."""
        b = logits.shape[0]
        if b > self.max_bs or logits.shape[-1] != self.vocab or logits.device.type != "cuda":
            self.stats["eager"] += 1
            return sample_rows(logits, st, stream_keys(seeds, draws), exact=self.exact)
        key = (self.bucket(b), logits.dtype, st.any_top_k, st.any_top_p, st.any_min_p)
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._capture(*key)
            except Exception as e:  # never fatal: this and later batches sample eagerly
                log.warning("sampler graph capture failed (%s); sampled decode rows run eagerly", e)
                self.max_bs = 0
                self.stats["eager"] += 1
                return sample_rows(logits, st, stream_keys(seeds, draws), exact=self.exact)
        g.logits[:b].copy_(logits)
        g.seeds[:b].copy_(seeds)
        g.draws[:b].copy_(draws)
        if g.bound is not st:
            for name in ("temperature", "top_k", "top_p", "min_p"):
                getattr(g, name)[:b].copy_(getattr(st, name))
            g.bound = st
        g.graph.replay()
        self.stats["replays"] += 1
        return g.out[:b].clone()

    def _capture(self, bucket: int, dtype: torch.dtype, any_top_k: bool, any_top_p: bool,
                 any_min_p: bool) -> _SamplerGraph:
        dev = self.device
        f32 = dict(dtype=torch.float32, device=dev)
        # padding rows sample too (T = 1, no filters, zero logits): their ids are never read
        g = _SamplerGraph(torch.cuda.CUDAGraph(), torch.zeros(bucket, self.vocab, dtype=dtype, device=dev),
                          torch.ones(bucket, **f32), torch.full((bucket,), self.vocab, dtype=torch.long, device=dev),
                          torch.ones(bucket, **f32), torch.zeros(bucket, **f32),
                          torch.zeros(bucket, dtype=torch.long, device=dev),
                          torch.zeros(bucket, dtype=torch.long, device=dev),
                          torch.zeros(bucket, dtype=torch.long, device=dev))
        st = SamplingTensors(g.temperature, g.top_k, g.top_p, g.min_p, any_top_k, any_top_p, any_min_p)

        def body() -> None:
            g.out.copy_(sample_rows(g.logits, st, stream_keys(g.seeds, g.draws), exact=self.exact))

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream(dev)
        with collector_paused():
            self.stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self.stream):
                body()  # warm-up: Triton compiles, sort workspaces, outside the graph
                with torch.cuda.graph(g.graph, pool=self.pool, stream=self.stream):
                    body()
            torch.cuda.current_stream(dev).wait_stream(self.stream)
        self.stats["captures"] += 1
        return g
