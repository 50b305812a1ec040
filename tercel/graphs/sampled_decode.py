"""Plain decode with the sampler inside the graph: one replay runs the target's forward and draws each row's token
(temperature, top-k / top-p / min-p and the race with the row's stream key, tercel.sampling.sample_rows).

A decode window's sampled rows used to replay the decode graph, copy its logits into a second graph
(graphs/sampler.py), replay that and clone its tokens: two graph launches, four copies and a gap on the GPU
between them, every token. Here the draw is part of the decode step, so a sampled token costs what a greedy one
does plus the sampler's own kernels. The stream keys are hashed inside the graph from each row's seed and draw
index, so a row draws exactly the token the eager path draws.

One graph serves every mix of settings (an off filter filters nothing): the variants only skip work a batch
does not need, the sort when no row uses top-k or top-p and the argmax when no row is greedy (a greedy row of a
mixed batch takes the argmax, its draw unused).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..kv import PagedKVCache
from ..sampling import SamplingTensors, greedy_tokens, sample_rows, stream_keys
from ..speculative.chain import ChainSampling, sampling_buffers
from .buffers import BufferSpec
from .steps import ModelStep


@dataclass(frozen=True, slots=True)
class SampledVariant:
    """What a sampled decode graph computes beyond the forward."""
    filtered: bool  # some row uses top-k or top-p: the sort runs
    mixed: bool  # some row is greedy: the argmax runs too and those rows take it


@dataclass(slots=True)
class SampledDecodeBatch:
    """A decode batch and its rows' sampling state (draws: this step's draw index per row)."""
    batch: ForwardBatch
    sampling: ChainSampling

    @property
    def num_requests(self) -> int:
        return self.batch.num_requests

    @property
    def capture_hidden_mode(self) -> CaptureHiddenMode:
        return self.batch.capture_hidden_mode


@dataclass(slots=True)
class SampledDecodeOutput:
    tokens: torch.Tensor  # [B] each row's token (on the device)
    logits: torch.Tensor  # [B, V]
    hidden_states: torch.Tensor | None = None  # [B, H] at a hidden-capture mode (a drafter's plain window)


class SampledDecodeStep(ModelStep):
    """ModelStep (decode, one token per request) whose forward ends with each row's draw."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache, max_blocks_per_request: int,
                 variant: SampledVariant, name: str = "decode_sampled") -> None:
        super().__init__(model, kv, max_blocks_per_request, name=name)
        self.variant = variant

    def buffer_specs(self) -> list[BufferSpec]:
        return super().buffer_specs() + sampling_buffers()

    def unsupported(self, batch: SampledDecodeBatch) -> str | None:  # type: ignore[override]
        return super().unsupported(batch.batch)

    def live_inputs(self, batch: SampledDecodeBatch) -> dict[str, torch.Tensor]:  # type: ignore[override]
        live = super().live_inputs(batch.batch)
        live.update({f: getattr(batch.sampling, f) for f in ChainSampling.FIELDS})
        return live

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,  # type: ignore[override]
                     mode: CaptureHiddenMode) -> SampledDecodeBatch:
        return SampledDecodeBatch(super().static_batch(views, num_requests, mode),
                                  ChainSampling(*(views[f] for f in ChainSampling.FIELDS)))

    def update_host_fields(self, static: SampledDecodeBatch, batch: SampledDecodeBatch,  # type: ignore[override]
                           num_live: int, bucket: int) -> None:
        super().update_host_fields(static.batch, batch.batch, num_live, bucket)

    def prepare_replay(self, static: SampledDecodeBatch, num_live: int) -> None:  # type: ignore[override]
        super().prepare_replay(static.batch, num_live)

    def forward(self, static: SampledDecodeBatch) -> SampledDecodeOutput:  # type: ignore[override]
        return self._draw(super().forward(static.batch), static.sampling)

    def eager(self, batch: SampledDecodeBatch) -> SampledDecodeOutput:  # type: ignore[override]
        return self._draw(super().eager(batch.batch), batch.sampling)

    def live_outputs(self, out: SampledDecodeOutput, num_live: int,  # type: ignore[override]
                     mode: CaptureHiddenMode) -> SampledDecodeOutput:
        rows = super().live_outputs(out, num_live, mode)  # logits and, at a capture mode, hidden states
        return SampledDecodeOutput(out.tokens[:num_live], rows.logits, rows.hidden_states)

    def _draw(self, out: ModelOutput, sp: ChainSampling) -> SampledDecodeOutput:
        """Each row's token: the race over its filtered distribution (padding rows: temperature 0 divides by 1);
        greedy rows of a mixed batch the argmax."""
        logits, v = out.logits, self.variant
        temperature = torch.where(sp.temperature > 0, sp.temperature, torch.ones_like(sp.temperature))
        st = SamplingTensors(temperature, sp.top_k.clamp(1, logits.shape[-1]), sp.top_p, sp.min_p, v.filtered,
                             v.filtered, True)
        tokens = sample_rows(logits, st, stream_keys(sp.seeds, sp.draws), exact=self.model.logits_exact_dtype)
        if v.mixed:
            tokens = torch.where(sp.sampled.bool(), tokens, greedy_tokens(logits))
        return SampledDecodeOutput(tokens, logits, out.hidden_states)
