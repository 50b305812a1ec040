"""Compiled CPU steps: the decode and verify forwards without per-op Python (torch.compile, Inductor's C++).

The CPU counterpart of the CUDA-graph runner. A uniform step (every request brings t tokens and wants logits
for all of them: plain decode t = 1, a speculative verify t = the draft width, optionally with tree masks)
runs one compiled function per (t, tree masks, capture-hidden mode, batch-size bucket). The batch is padded
to its bucket like a graph's static buffers (padding rows write the dummy KV slot); the block-table width
is symbolic, so a growing context recompiles nothing. The 4-bit matmuls stay torch's int4 kernel (an
extern call inside the compiled code); the norms, RoPE, residual adds, SwiGLU and the attention around
them become a few fused C++ loops. Prefill chunks and mixed steps run eagerly.

Compiled code is cached on disk by Inductor (its FX-graph and AOT caches, under Tercel's cache folder),
so only the first run on a machine pays the C++ compile; later starts pay tracing and a cache lookup.
"""
from __future__ import annotations

import bisect
import collections
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..kv import PagedKVCache

log = logging.getLogger(__name__)

# compiled functions per step kind are keyed by batch-size bucket: Dynamo keeps one entry per bucket
RECOMPILE_LIMIT = 64
MIN_TABLE_WIDTH = 2  # a width of 1 would be specialised (Dynamo treats sizes 0 and 1 as constants)


def batch_buckets(max_bs: int) -> list[int]:
    """Powers of two up to max_bs (included): at most twice the rows of the live batch, few compiles."""
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b *= 2
    return out + [max_bs]


@dataclass(slots=True)
class CompileStats:
    compiled_steps: int = 0
    steps_by_tokens: collections.Counter = field(default_factory=collections.Counter)  # tokens/request -> steps
    compiles: int = 0  # (step kind, bucket) pairs traced so far, each once
    compile_seconds: float = 0.0  # wall time of the steps that traced (compile or cache load included)
    fallbacks: collections.Counter = field(default_factory=collections.Counter)  # reason -> eager steps


@dataclass(frozen=True, slots=True)
class StepKey:
    tokens_per_request: int
    tree_masks: bool
    mode: CaptureHiddenMode
    bucket: int


class CompiledSteps:
    """Serves uniform steps with compiled forwards; `run` returns None for a batch it does not take."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache, max_bs: int, cache_dir: str | None = None) -> None:
        self.model = model
        self.kv = kv
        self.buckets = batch_buckets(max_bs)
        self.stats = CompileStats()
        self._seen: set[StepKey] = set()
        if cache_dir is not None:  # Inductor reads its cache location from the environment only
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        # size asserts re-check every input's shape on every call (hundreds per step): the buckets fix them
        self._forward = torch.compile(self._uniform_forward, options={"size_asserts": False})

    def unsupported(self, batch: ForwardBatch) -> str | None:
        t = batch.query_lens[0]
        if any(q != t for q in batch.query_lens):
            return "not a uniform batch (prefill or mixed step)"
        if batch.logits_indices.shape[0] != batch.input_ids.shape[0]:
            return "logits wanted for only some tokens"
        if batch.num_requests > self.buckets[-1]:
            return f"batch of {batch.num_requests} above the largest compiled bucket {self.buckets[-1]}"
        return None

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ModelOutput | None:
        reason = self.unsupported(batch)
        if reason is not None:
            self.stats.fallbacks[reason] += 1
            return None
        b, t = batch.num_requests, batch.query_lens[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, b)]
        key = StepKey(t, batch.custom_masks is not None, batch.capture_hidden_mode, bucket)
        inputs = self._padded(batch, bucket, t)
        torch._dynamo.mark_dynamic(inputs[4], 1)  # the block-table width: any context length, one compile
        first = key not in self._seen
        start = time.perf_counter()
        logits, hidden = self._forward(*inputs, t, key.mode)
        if first:
            self._seen.add(key)
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            log.info("compiled the CPU step (%d token(s)/request%s, batch bucket %d) in %.1f s", t,
                     ", tree masks" if key.tree_masks else "", bucket, time.perf_counter() - start)
        self.stats.compiled_steps += 1
        self.stats.steps_by_tokens[t] += 1
        rows = b * t
        return ModelOutput(logits=logits[:rows], hidden_states=None if hidden is None else hidden[:rows])

    def _padded(self, batch: ForwardBatch, bucket: int, t: int) -> tuple:
        """The live batch padded to `bucket` requests: padding requests hold t tokens at positions 0..t-1
        that write the dummy slot 0 and see only themselves (causal), as a graph's padding rows do."""
        b = batch.num_requests
        pad = bucket - b
        tables = batch.block_tables
        width = max(tables.shape[1], MIN_TABLE_WIDTH)
        masks = None
        if batch.custom_masks is not None:
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            masks = torch.stack([causal if m is None else m.cpu() for m in batch.custom_masks]
                                + [causal] * pad)
        if pad == 0 and width == tables.shape[1]:
            return batch.input_ids, batch.positions, batch.out_cache_loc, batch.seq_lens, tables, masks
        zeros = batch.input_ids.new_zeros(pad * t)
        padded_tables = tables.new_zeros(bucket, width)
        padded_tables[:b, :tables.shape[1]] = tables
        seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_full((pad,), t)])
        return (torch.cat([batch.input_ids, zeros]), torch.cat([batch.positions, torch.arange(t).repeat(pad)]),
                torch.cat([batch.out_cache_loc, zeros]), seq_lens, padded_tables, masks)

    def _uniform_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, masks: torch.Tensor | None, t: int,
                         mode: CaptureHiddenMode) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What gets traced: the model over a uniform batch, attention metadata built from device values
        only (the graph-safe path), attention written as matmuls (fused by Inductor)."""
        b = seq_lens.shape[0]
        batch = ForwardBatch(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                             seq_lens=seq_lens, block_tables=block_tables,
                             logits_indices=torch.arange(b * t), query_lens=[t] * b, seq_lens_cpu=[t] * b,
                             custom_masks=None if masks is None else list(masks.unbind(0)), capture_hidden_mode=mode)
        meta = self.model.attn_backend.capture_metadata(batch, self.kv.block_size, t)
        meta.matmul = True
        out = self.model(batch, self.kv, attn_meta=meta)
        return out.logits, out.hidden_states
