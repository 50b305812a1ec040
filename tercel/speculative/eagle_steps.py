"""EAGLE / EAGLE-3 steps with static shapes, as step kinds of the one graph runner (graphs/runner.py):

  draft        the whole greedy chain draft loop (num_steps - 1 draft forwards after the state's own
               top-1) for a batch, in one graph per batch bucket (SGLang's draft CUDA-graph runner)
  draft_extend the draft over a fixed num_draft_tokens rows per request (rejected and padded rows
               included: they write the dummy slot), then the row of the last accepted token

Both read and write the draft's paged cache through an attention backend (the target's kind: Triton on a
GPU, the PyTorch reference on a CPU) at the request's own positions, so nothing is gathered per step:
draft step s of a request whose root sits at position `base` writes its K/V at position base + s - 1 and
attends over [0, base + s). Those slots are the request's reserved verify slots; draft_extend rewrites the
accepted ones, and the rest are never read before a later draft loop writes them again.

Each step runs the same code eagerly (`eager`, host metadata) and under capture (`forward`, graph-safe
metadata from device tensors), so graph mode and eager mode compute the same function.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch
from ..graphs.buffers import BufferSpec, Pad, Per
from ..graphs.runner import StepKind
from ..kernels import use_triton
from ..kv import PagedKVCache
from ..models.eagle3 import EagleDraftModel
from ..sampling import greedy_tokens


@dataclass(slots=True)
class DraftLoopBatch:
    """Inputs of a greedy chain draft loop for B requests."""
    roots: torch.Tensor  # [B] the root (last sampled) token of each request
    first: torch.Tensor  # [B] target id of the state's top-1: the first draft
    hidden: torch.Tensor  # [B, H] the draft's pre-norm hidden state at position base - 1
    base: torch.Tensor  # [B] the root's position (num_computed_tokens)
    block_tables: torch.Tensor  # [B, width] zero-padded to cover base + num_steps
    base_cpu: list[int]
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.roots.shape[0]


@dataclass(slots=True)
class DraftExtendBatch:
    """Inputs of draft_extend: `width` rows per request starting at the root's position `start`."""
    ids: torch.Tensor  # [B * W] the token at position start + j + 1 (padding: any valid id)
    hidden: torch.Tensor  # [B * W, fc_in] the target's states at start + j
    positions: torch.Tensor  # [B * W] RoPE positions
    out_cache_loc: torch.Tensor  # [B * W] draft KV slots (padding rows: the dummy slot 0)
    seq_lens: torch.Tensor  # [B] start + W
    block_tables: torch.Tensor  # [B, width] zero-padded to cover start + W
    last: torch.Tensor  # [B] the row (within the request) of its last real token
    seq_lens_cpu: list[int]
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class ChainPositions:
    """The positions base + j (j < W) of a chain step's rows and their KV slots, laid out [W, B] so that row j
    (every request's j-th position) is a contiguous [B] tensor: draft step s reads row s - 1, verify and
    draft_extend read them all. Built once per step (one Triton launch on a GPU, kernels/chain_positions.py; each
    draft step used to compute its own)."""
    positions: torch.Tensor  # [W, B] base + j
    slots: torch.Tensor  # [W, B] the KV slot of each position
    seq_lens: torch.Tensor  # [W, B] positions + 1
    rope_positions: torch.Tensor  # [W, B] positions clamped to the draft's RoPE table

    @classmethod
    def of(cls, base: torch.Tensor, block_tables: torch.Tensor, block_size: int, width: int,
           max_position: int) -> "ChainPositions":
        if use_triton(base) and block_tables.stride(1) == 1:
            from ..kernels.chain_positions import chain_positions

            return cls(*chain_positions(base.contiguous(), block_tables, block_size, width, max_position))
        pos = base[None, :] + torch.arange(width, device=base.device)[:, None]
        # [MB, B].gather(0, [W, B]): entry (j, b) is request b's block of position j, contiguous in [W, B]
        slots = block_tables.t().gather(0, pos // block_size) * block_size + pos % block_size
        return cls(pos, slots, pos + 1, pos.clamp(max=max_position))

    def request_major(self, t: torch.Tensor) -> torch.Tensor:
        """[W, B] -> [B * W], request by request (the verify's and draft_extend's row order)."""
        return t.t().reshape(-1)


@dataclass(slots=True)
class DraftStateRows:
    """What draft_extend leaves per request: the state the next draft loop starts from."""
    hidden: torch.Tensor  # [B, H]
    logits: torch.Tensor  # [B, Vd] float32
    first: torch.Tensor  # [B] target id of the logits' top-1


def target_hidden_width(model: EagleDraftModel) -> int:
    """Width of the target states draft_extend reads: the aux layers concatenated (EAGLE-3 with aux
    states), else the target's final normed hidden (derived from the checkpoint, not guessed)."""
    cfg = model.config
    return cfg.fc_in if cfg.kind == "eagle3" and cfg.aux_layer_ids else cfg.target_hidden_size


class BackendAttend:
    """A draft layer's attention through the target's backend over the draft's KV: called with rotated q, k
    and v; `rope` (None unless the backend fuses RoPE) takes q / k unrotated and rotates and stores them in
    the backend's kernels (decode batches: inside the split-KV kernel), as the target's layers do."""

    __slots__ = ("backend", "batch", "meta", "kv", "rope")

    def __init__(self, backend, batch: ForwardBatch, meta: object, kv: PagedKVCache) -> None:
        self.backend, self.batch, self.meta, self.kv = backend, batch, meta, kv
        self.rope = self._rope if backend.fuses_rope else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.batch, self.meta, self.kv)

    def _rope(self, layer: int, qk: torch.Tensor, v: torch.Tensor, cos_sin) -> torch.Tensor:
        return self.backend.forward_rope(layer, qk, v, cos_sin, self.batch, self.meta, self.kv)


def _top1(model: EagleDraftModel, logits: torch.Tensor) -> torch.Tensor:
    """The draft logits' top-1 as target ids (the mapping rides in the argmax's launch)."""
    return greedy_tokens(logits, model.draft_to_target if model.maps_vocab else None)


class _DraftStep(StepKind):
    def __init__(self, model: EagleDraftModel, kv: PagedKVCache, backend, max_blocks: int,
                 max_position: int) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.max_blocks = max_blocks
        self.max_position = max_position

    def _width_reason(self, tables: torch.Tensor) -> str | None:
        if tables.shape[1] > self.max_blocks:
            return f"block table of width {tables.shape[1]} exceeds the captured {self.max_blocks}"
        return None

    def capture_key(self) -> tuple:
        # the graphs bind the head's weights: a token map (restrict_vocab) or quantize_head must come before
        # capture
        return (id(self.model.hot_head), id(self.model.head_q))


class EagleDraftLoopStep(_DraftStep):
    name = "draft"
    tokens_per_request = 1

    def __init__(self, model: EagleDraftModel, kv: PagedKVCache, backend, max_blocks: int, max_position: int,
                 num_steps: int) -> None:
        super().__init__(model, kv, backend, max_blocks, max_position)
        self.num_steps = num_steps

    def buffer_specs(self) -> list[BufferSpec]:
        return [
            BufferSpec("roots", Per.REQUEST, torch.long, Pad.HEAD_ONLY),
            BufferSpec("first", Per.REQUEST, torch.long, Pad.HEAD_ONLY),
            BufferSpec("hidden", Per.REQUEST, self.model.fc.weight.dtype, Pad.ZERO, shape=(self.model.hidden_size,)),
            BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),  # a padded request drafts in the dummy block
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
        ]

    def unsupported(self, batch: DraftLoopBatch) -> str | None:
        return self._width_reason(batch.block_tables)

    def live_inputs(self, batch: DraftLoopBatch) -> dict[str, torch.Tensor]:
        return {"roots": batch.roots, "first": batch.first, "hidden": batch.hidden, "base": batch.base,
                "block_tables": batch.block_tables}

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,
                     mode: CaptureHiddenMode) -> DraftLoopBatch:
        return DraftLoopBatch(views["roots"], views["first"], views["hidden"], views["base"], views["block_tables"],
                              [0] * num_requests)

    def forward(self, static: DraftLoopBatch) -> torch.Tensor:
        return self.body(static, graph=True)

    def eager(self, batch: DraftLoopBatch) -> torch.Tensor:
        return self.body(batch, graph=False)

    def live_outputs(self, out: torch.Tensor, num_live: int, mode: CaptureHiddenMode) -> torch.Tensor:
        return out[:num_live]

    def body(self, b: DraftLoopBatch, graph: bool,
             pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
             at: ChainPositions | None = None) -> torch.Tensor:
        """[B, num_steps + 1] target ids: the root, then the greedy chain. pick(s, logits): the target ids of
        chain position s + 1 from the draft logits [B, Vd] (default: the top-1; a sampled chain draws).
        at: the step's positions when the caller has them (the chained step), else built here."""
        model, bs = self.model, self.kv.block_size
        n = b.roots.shape[0]
        rows = torch.arange(n, device=b.roots.device)
        if at is None:
            # the rows the loop reads (base .. base + num_steps - 2): no position past what the table covers
            at = ChainPositions.of(b.base, b.block_tables, bs, self.num_steps - 1, self.max_position)
        tokens, ids, h = [b.roots, b.first], b.first, b.hidden
        for s in range(1, self.num_steps):
            fb = ForwardBatch(input_ids=ids, positions=at.positions[s - 1], out_cache_loc=at.slots[s - 1],
                              seq_lens=at.seq_lens[s - 1], block_tables=b.block_tables, logits_indices=rows,
                              query_lens=[1] * n, seq_lens_cpu=[p + s for p in b.base_cpu])
            meta = (self.backend.capture_metadata(fb, bs, 1) if graph else self.backend.prepare(fb, bs))
            h = model(ids, h, at.rope_positions[s - 1], BackendAttend(self.backend, fb, meta, self.kv),
                      from_target=False)
            logits = model.compute_logits(h)
            ids = _top1(model, logits) if pick is None else pick(s, logits)
            tokens.append(ids)
        return torch.stack(tokens, dim=1)


class EagleExtendStep(_DraftStep):
    name = "draft_extend"

    def __init__(self, model: EagleDraftModel, kv: PagedKVCache, backend, max_blocks: int, max_position: int,
                 width: int) -> None:
        super().__init__(model, kv, backend, max_blocks, max_position)
        self.tokens_per_request = width

    def buffer_specs(self) -> list[BufferSpec]:
        w = self.tokens_per_request
        return [
            BufferSpec("ids", Per.TOKEN, torch.long, Pad.HEAD_ONLY),
            BufferSpec("hidden", Per.TOKEN, self.model.fc.weight.dtype, Pad.ZERO,
                       shape=(target_hidden_width(self.model),)),
            BufferSpec("positions", Per.TOKEN, torch.long, Pad.ZERO),
            BufferSpec("out_cache_loc", Per.TOKEN, torch.long, Pad.ZERO),
            BufferSpec("seq_lens", Per.REQUEST, torch.long, Pad.SENTINEL, sentinel=w),
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
            BufferSpec("last", Per.REQUEST, torch.long, Pad.ZERO),
        ]

    def unsupported(self, batch: DraftExtendBatch) -> str | None:
        return self._width_reason(batch.block_tables)

    def live_inputs(self, batch: DraftExtendBatch) -> dict[str, torch.Tensor]:
        return {"ids": batch.ids, "hidden": batch.hidden, "positions": batch.positions,
                "out_cache_loc": batch.out_cache_loc, "seq_lens": batch.seq_lens, "block_tables": batch.block_tables,
                "last": batch.last}

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,
                     mode: CaptureHiddenMode) -> DraftExtendBatch:
        return DraftExtendBatch(views["ids"], views["hidden"], views["positions"], views["out_cache_loc"],
                                views["seq_lens"], views["block_tables"], views["last"],
                                [self.tokens_per_request] * num_requests)

    def update_host_fields(self, static: DraftExtendBatch, batch: DraftExtendBatch, num_live: int,
                           bucket: int) -> None:
        static.seq_lens_cpu[:num_live] = batch.seq_lens_cpu
        static.seq_lens_cpu[num_live:] = [self.tokens_per_request] * (bucket - num_live)

    def forward(self, static: DraftExtendBatch) -> DraftStateRows:
        return self.body(static, graph=True)

    def eager(self, batch: DraftExtendBatch) -> DraftStateRows:
        return self.body(batch, graph=False)

    def live_outputs(self, out: DraftStateRows, num_live: int, mode: CaptureHiddenMode) -> DraftStateRows:
        return DraftStateRows(out.hidden[:num_live], out.logits[:num_live], out.first[:num_live])

    def body(self, b: DraftExtendBatch, graph: bool) -> DraftStateRows:
        w, bs = self.tokens_per_request, self.kv.block_size
        n = b.seq_lens.shape[0]
        fb = ForwardBatch(input_ids=b.ids, positions=b.positions, out_cache_loc=b.out_cache_loc, seq_lens=b.seq_lens,
                          block_tables=b.block_tables, logits_indices=b.last, query_lens=[w] * n,
                          seq_lens_cpu=b.seq_lens_cpu)
        meta = self.backend.capture_metadata(fb, bs, w) if graph else self.backend.prepare(fb, bs)
        h = self.model(b.ids, b.hidden, b.positions.clamp(max=self.max_position),
                       BackendAttend(self.backend, fb, meta, self.kv), from_target=True)
        # each request's last real row: one gather launch (an index built from arange took four)
        h_last = h.reshape(n, w, -1).gather(1, b.last.reshape(n, 1, 1).expand(n, 1, h.shape[-1])).view(n, -1)
        logits = self.model.compute_logits(h_last)
        return DraftStateRows(h_last, logits, _top1(self.model, logits))
