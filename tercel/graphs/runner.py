"""One CUDA-graph runner for every step kind (docs/architecture.md, "CUDA graphs: one runner, many step kinds").

A step kind declares its static buffers (with padding policies), how many tokens each request
brings, and the forward to capture; the runner does the rest:

  capture   per batch-size bucket (largest first, one shared memory pool) and capture-hidden mode,
            on a side stream after eager warm-up runs, as one graph ("full") or as graph segments
            around @eager_break functions ("breakable"; "breakable-debug" runs it all eagerly)
  replay    picks the smallest bucket >= the live batch, copies the live inputs into the static
            buffers and pads the tail (grouped foreach copies, buffers.py), refreshes host-only
            fields, replays, and returns views of the static outputs for the live rows
  fallback  anything it cannot serve (shape, size, mode it may not capture) runs the step's eager
            forward instead, with the reason logged once and counted in `fallbacks`

Graph outputs live in the pool and stay valid until the next replay of this runner: consume them
(sample) before the next step, or clone what must survive.

Capture-hidden mode is part of the graph key and ordered: a FULL graph serves LAST and NULL. A
batch asking for more than a bucket was captured with is recaptured at that mode (or, with
recapture off, run eagerly). The aux-layer set the model captures is recorded at capture; if it
changes, graphs that return hidden states are dropped and recaptured.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from .breakable import BreakableGraph
from .buffers import DEFAULT_BIG_COPY_BYTES, BufferSpec, StaticBuffers
from .capture_guard import CaptureGuard

log = logging.getLogger(__name__)

GRAPH_BACKENDS = ("full", "breakable", "breakable-debug")


def default_batch_sizes(max_bs: int) -> list[int]:
    """1..8, then steps of 2 to 16, 4 to 32, 8 to 64, 16 beyond (SGLang-like), up to max_bs (included)."""
    sizes = (list(range(1, 9)) + list(range(10, 17, 2)) + list(range(20, 33, 4)) + list(range(40, 65, 8))
             + list(range(80, max(max_bs, 80) + 1, 16)))
    out = [s for s in sizes if s <= max_bs]
    if max_bs not in out:
        out.append(max_bs)
    return out


@dataclass(slots=True)
class GraphConfig:
    max_bs: int = 256  # --cuda-graph-max-bs
    batch_sizes: tuple[int, ...] | None = None  # --cuda-graph-bs (overrides the default list)
    backend: str = "full"  # --cuda-graph-backend: full | breakable | breakable-debug
    big_copy_bytes: int = DEFAULT_BIG_COPY_BYTES  # inputs this large get their own (DMA) copy
    use_foreach: bool = True  # False: one copy_ per tensor (benchmark baseline)
    recapture: bool = True  # a higher capture-hidden mode recaptures (False: eager fallback)
    warmup_runs: int = 2

    def buckets(self) -> list[int]:
        sizes = sorted(set(self.batch_sizes)) if self.batch_sizes else default_batch_sizes(self.max_bs)
        if not sizes or sizes[0] < 1:
            raise ValueError(f"CUDA-graph batch sizes must be positive, got {sizes}.")
        if self.backend not in GRAPH_BACKENDS:
            raise ValueError(f"cuda graph backend {self.backend!r}: use one of {', '.join(GRAPH_BACKENDS)}.")
        return sizes


class StepKind:
    """What one kind of step (decode, target verify, draft loop, draft_extend) gives the runner."""

    name: str = "step"
    tokens_per_request: int = 1

    def buffer_specs(self) -> list[BufferSpec]:
        raise NotImplementedError

    def unsupported(self, batch: ForwardBatch) -> str | None:
        """Why this batch cannot replay a graph of this kind (None: it can)."""
        raise NotImplementedError

    def live_inputs(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int, mode: CaptureHiddenMode) -> ForwardBatch:
        raise NotImplementedError

    def update_host_fields(self, static: ForwardBatch, batch: ForwardBatch, num_live: int, bucket: int) -> None:
        """Host-only values (not copied to the GPU): refreshed before replay for eager breaks."""

    def forward(self, static: ForwardBatch) -> ModelOutput:
        raise NotImplementedError

    def eager(self, batch: ForwardBatch) -> ModelOutput:
        raise NotImplementedError

    def capture_key(self) -> tuple:
        """Model state a graph bakes in beyond its inputs (e.g. the aux-layer set)."""
        return ()

    def prepare_replay(self, static: ForwardBatch, num_live: int) -> None:
        """Refresh static metadata outside the graph (attention backends with planners)."""

    def live_outputs(self, out: Any, num_live: int, mode: CaptureHiddenMode) -> Any:
        """The live requests' rows of a replay's static outputs (views, valid until the next replay).
        Model steps: logits (and hidden states) of num_live * tokens_per_request rows."""
        rows = num_live * self.tokens_per_request
        hidden = None
        if mode != CaptureHiddenMode.NULL and out.hidden_states is not None:
            hidden = out.hidden_states[:rows]
        return ModelOutput(logits=out.logits[:rows], hidden_states=hidden)


@dataclass(slots=True)
class CapturedGraph:
    graph: Any
    static: ForwardBatch
    outputs: ModelOutput
    mode: CaptureHiddenMode
    key: tuple


@dataclass(slots=True)
class RunnerStats:
    replays: int = 0
    eager: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    fallbacks: collections.Counter = field(default_factory=collections.Counter)


@contextlib.contextmanager
def collector_paused():
    """Collect garbage now, then pause Python's cyclic collector (as torch.cuda.graph does). A dead
    engine's graphs and buffers, freed by a collection that happens to run while a stream captures,
    would invalidate the capture: destroying a graph or freeing memory is not permitted then. Nested
    uses (capture_all -> capture) collect once."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class CudaGraphRunner:
    def __init__(self, step: StepKind, config: GraphConfig, device: torch.device | str,
                 graph_factory: Callable[[], Any] | None = None, pool: Any = None, stream: Any = None) -> None:
        """stream: the CUDA stream to warm up and capture on (the executor's one capture stream: every stream
        that runs a cuBLAS call keeps a workspace for the process's life; None: a stream of its own)."""
        self.step = step
        self.config = config
        self.device = torch.device(device)
        self.buckets = config.buckets()
        self.max_bs = self.buckets[-1]
        self.buffers = StaticBuffers(step.buffer_specs(), self.max_bs, step.tokens_per_request, self.device)
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self._pool = pool
        self.graphs: dict[int, CapturedGraph] = {}  # bucket -> graph (one mode per bucket: the highest asked)
        self.stats = RunnerStats()
        self._stream: Any = stream
        self._logged: set[str] = set()

    @property
    def pool(self) -> Any:
        """The graphs' memory pool (None until the first CUDA capture)."""
        return self._pool

    # ---- capture -------------------------------------------------------------------------
    def capture_all(self, mode: CaptureHiddenMode = CaptureHiddenMode.NULL) -> None:
        with collector_paused():
            for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
                self.capture(bs, mode)

    def _new_graph(self) -> Any:
        if self.config.backend == "full":
            return _FullGraph(self._pool, self.graph_factory)
        return BreakableGraph(self._pool, debug_eager=self.config.backend == "breakable-debug",
                              graph_factory=self.graph_factory)

    def capture(self, bucket: int, mode: CaptureHiddenMode) -> CapturedGraph:
        with collector_paused():
            return self._capture(bucket, mode)

    def _capture(self, bucket: int, mode: CaptureHiddenMode) -> CapturedGraph:
        start = time.perf_counter()
        views = {name: self.buffers.view(name, bucket) for name in self.buffers.specs}
        static = self.step.static_batch(views, bucket, mode)
        fn = lambda: self.step.forward(static)  # noqa: E731
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        if self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            torch.cuda.synchronize(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for _ in range(self.config.warmup_runs):  # JIT compiles, cuBLAS handles: not inside a graph
                    fn()
                graph = self._new_graph()
                outputs = graph.capture(fn)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            torch.cuda.synchronize(self.device)
        else:  # CPU tests drive the runner with a stand-in graph, guarded for what a real capture refuses
            graph = self._new_graph()
            with CaptureGuard():
                outputs = graph.capture(fn)
        captured = CapturedGraph(graph, static, outputs, mode, self.step.capture_key())
        self.graphs[bucket] = captured
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        return captured

    # ---- replay --------------------------------------------------------------------------
    def bucket_for(self, num_requests: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_requests)
        return self.buckets[i] if i < len(self.buckets) else None

    def serves(self, num_requests: int) -> bool:
        """Does a batch of num_requests replay a captured graph here (not run eagerly)?"""
        return self.bucket_for(num_requests) in self.graphs

    def _fallback(self, reason: str, batch: ForwardBatch, quiet: bool = False) -> ModelOutput:
        self.stats.eager += 1
        self.stats.fallbacks[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            (log.debug if quiet else log.info)("%s graph: running eagerly: %s", self.step.name, reason)
        return self.step.eager(batch)

    def run(self, batch: ForwardBatch) -> ModelOutput:
        """The step's forward for this batch: a graph replay when possible, else the eager forward."""
        n = batch.num_requests
        reason = self.step.unsupported(batch)
        if reason is not None:
            return self._fallback(reason, batch, quiet=True)
        bucket = self.bucket_for(n)
        if bucket is None:
            return self._fallback(f"batch of {n} requests is larger than the largest captured bucket "
                                  f"({self.max_bs}); raise --cuda-graph-max-bs", batch, quiet=True)
        captured = self.graphs.get(bucket)
        mode = batch.capture_hidden_mode
        key = self.step.capture_key()
        # the captured key (aux-layer set) only matters to batches that read hidden states
        stale = captured is not None and mode != CaptureHiddenMode.NULL and captured.key != key
        if captured is None or not captured.mode.covers(mode) or stale:
            if stale:
                self._drop_stale(key)
            why = ("not captured yet" if captured is None else
                   f"captured at {captured.mode.name}, asked {mode.name}" if not captured.mode.covers(mode) else
                   "the model's aux-layer set changed since capture")
            if not self.config.recapture:
                return self._fallback(f"bucket {bucket}: {why} and recapture is off", batch)
            log.info("%s graph: capturing bucket %d at %s (%s)", self.step.name, bucket,
                     max(mode, captured.mode if captured else mode).name, why)
            try:
                captured = self.capture(bucket, max(mode, captured.mode) if captured else mode)
            except Exception as e:  # never crash the step: a failed capture means eager
                self.graphs.pop(bucket, None)
                log.exception("capture failed")
                return self._fallback(f"capture of bucket {bucket} failed: {e!r}", batch)
        try:
            self.stage_inputs(batch, captured, bucket)
        except ValueError as e:
            return self._fallback(str(e), batch)
        captured.graph.replay()
        self.stats.replays += 1
        return self.step.live_outputs(captured.outputs, n, mode)

    def replay_unstaged(self, num_live: int) -> Any:
        """Replay the graph of num_live's bucket on whatever its static buffers hold now (a step kind that
        writes its next inputs back into them chains replays with nothing staged); None when that bucket
        has no graph."""
        bucket = self.bucket_for(num_live)
        captured = self.graphs.get(bucket) if bucket is not None else None
        if captured is None:
            return None
        captured.graph.replay()
        self.stats.replays += 1
        return self.step.live_outputs(captured.outputs, num_live, captured.mode)

    def stage_inputs(self, batch: ForwardBatch, captured: CapturedGraph, bucket: int) -> None:
        """Everything a replay does on the host before graph.replay(): copy the live inputs into the
        static buffers (grouped), pad to the bucket, refresh host-only fields and backend metadata."""
        n = batch.num_requests
        self.buffers.stage(self.step.live_inputs(batch), n, bucket, self.config.big_copy_bytes, self.config.use_foreach)
        self.step.update_host_fields(captured.static, batch, n, bucket)
        self.step.prepare_replay(captured.static, n)

    def _drop_stale(self, key: tuple) -> None:
        for b in [b for b, g in self.graphs.items() if g.key != key and g.mode != CaptureHiddenMode.NULL]:
            del self.graphs[b]


class _FullGraph:
    """The whole forward as one torch.cuda.CUDAGraph."""

    def __init__(self, pool: Any, graph_factory: Callable[[], Any]) -> None:
        self.pool = pool
        self.graph = graph_factory()

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            self.graph.capture_end()
        return out

    def replay(self) -> None:
        self.graph.replay()
