"""Step kinds over a Llama-family model: plain decode (1 token/request) and target verify
(k tokens/request, optionally with a per-request [k, k] tree mask). Draft loops and draft_extend
add their own StepKind next to these and reuse the runner unchanged.
"""
from __future__ import annotations

import logging

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..kv import PagedKVCache
from .buffers import BufferSpec, Pad, Per
from .runner import CudaGraphRunner, GraphConfig, StepKind

log = logging.getLogger(__name__)


class ModelStep(StepKind):
    """model(batch, kv) for uniform batches: every request brings tokens_per_request tokens and wants
    logits for all of them (decode: 1; verify: the draft width)."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache, max_blocks_per_request: int,
                 tokens_per_request: int = 1, custom_mask: bool = False, name: str | None = None) -> None:
        self.model = model
        self.kv = kv
        self.tokens_per_request = tokens_per_request
        self.max_blocks = max_blocks_per_request
        self.custom_mask = custom_mask
        self.name = name or ("decode" if tokens_per_request == 1 and not custom_mask else "verify")
        self._rows: torch.Tensor | None = None
        self._causal: torch.Tensor | None = None

    def buffer_specs(self) -> list[BufferSpec]:
        t = self.tokens_per_request
        specs = [
            BufferSpec("input_ids", Per.TOKEN, torch.long, Pad.HEAD_ONLY),
            BufferSpec("positions", Per.TOKEN, torch.long, Pad.ZERO),
            BufferSpec("out_cache_loc", Per.TOKEN, torch.long, Pad.ZERO),  # padded tokens write the dummy slot
            BufferSpec("seq_lens", Per.REQUEST, torch.long, Pad.SENTINEL, sentinel=t),
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
        ]
        if self.custom_mask:  # a padded request sees all of its (dummy) tokens: never an empty row
            specs.append(BufferSpec("custom_mask", Per.REQUEST, torch.bool, Pad.SENTINEL, shape=(t, t), sentinel=1))
        return specs

    def unsupported(self, batch: ForwardBatch) -> str | None:
        t = self.tokens_per_request
        if any(q != t for q in batch.query_lens):
            return f"not a uniform batch of {t} token(s) per request (prefill or mixed step)"
        if batch.logits_indices.shape[0] != batch.input_ids.shape[0]:
            return "logits wanted for only some tokens"
        if batch.custom_masks is not None and not self.custom_mask:
            return "custom attention masks, but this graph was built without them"
        if batch.block_tables.shape[1] > self.max_blocks:
            return f"block table of width {batch.block_tables.shape[1]} exceeds the captured {self.max_blocks}"
        return None

    def live_inputs(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        live = {"input_ids": batch.input_ids, "positions": batch.positions, "out_cache_loc": batch.out_cache_loc,
                "seq_lens": batch.seq_lens, "block_tables": batch.block_tables}
        if self.custom_mask:
            t = self.tokens_per_request
            if self._causal is None or self._causal.device != batch.input_ids.device:
                self._causal = torch.ones(t, t, dtype=torch.bool, device=batch.input_ids.device).tril()
            masks = batch.custom_masks or [None] * batch.num_requests
            live["custom_mask"] = torch.stack([self._causal if m is None else m.to(self._causal.device)
                                               for m in masks])
        return live

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int, mode: CaptureHiddenMode) -> ForwardBatch:
        t = self.tokens_per_request
        rows = num_requests * t
        if self._rows is None or self._rows.shape[0] < rows:
            self._rows = torch.arange(max(rows, 1), device=views["input_ids"].device)
        masks = list(views["custom_mask"]) if self.custom_mask else None
        return ForwardBatch(
            input_ids=views["input_ids"], positions=views["positions"], out_cache_loc=views["out_cache_loc"],
            seq_lens=views["seq_lens"], block_tables=views["block_tables"], logits_indices=self._rows[:rows],
            query_lens=[t] * num_requests, seq_lens_cpu=[t] * num_requests, custom_masks=masks,
            capture_hidden_mode=mode)

    def update_host_fields(self, static: ForwardBatch, batch: ForwardBatch, num_live: int, bucket: int) -> None:
        static.seq_lens_cpu[:num_live] = batch.seq_lens_cpu
        static.seq_lens_cpu[num_live:] = [self.tokens_per_request] * (bucket - num_live)

    def forward(self, static: ForwardBatch) -> ModelOutput:
        meta = self.model.attn_backend.capture_metadata(static, self.kv.block_size, self.tokens_per_request)
        return self.model(static, self.kv, attn_meta=meta)

    def eager(self, batch: ForwardBatch) -> ModelOutput:
        return self.model(batch, self.kv)

    def capture_key(self) -> tuple:
        return tuple(getattr(self.model, "aux_layer_ids", ()))

    def prepare_replay(self, static: ForwardBatch, num_live: int) -> None:
        self.model.attn_backend.prepare_replay(static, num_live)


def decode_graph_runner(model: torch.nn.Module, kv: PagedKVCache, max_model_len: int, config: GraphConfig,
                        extra_tokens: int = 0) -> CudaGraphRunner:
    """A runner for plain decode over this model, every bucket captured now (NULL hidden mode)."""
    max_blocks = -(-(max_model_len + extra_tokens) // kv.block_size) + 1
    runner = CudaGraphRunner(ModelStep(model, kv, max_blocks), config, kv.k.device)
    with torch.inference_mode():
        runner.capture_all()
    log.info("captured %d decode graphs (batch sizes %s) in %.1f s",
                                     len(runner.graphs), runner.buckets, runner.stats.capture_seconds)
    return runner
