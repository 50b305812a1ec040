"""DFlash's block forward as a step kind of the one graph runner: the draft over each request's block
[root, mask, ..., mask] at base .. base + S - 1, attending to its context cache, in one replay; the drafts'
logits [B, S - 1, V] stay on the device for DDTREE's tree building (or an unchained DFLASH step's chain).
Near a request's end its block is shorter (block_lens: the rows past it are no keys), as the reference
drafts, through a mask, so the shape stays static.

On a GPU the context is read from the paged cache by the split-KV kernel (attention/paged_merge.py), so one
graph serves every context length at the cost of the real context. Elsewhere it is gathered: under capture every
position the block table can hold (masked past base), eagerly what the batch's tables hold; the draft's attention
puts the block's keys before the context's (models/dflash.py), so the padding is a masked tail either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.paged_merge import draft_context
from ..forward_batch import CaptureHiddenMode
from ..graphs.buffers import BufferSpec, Pad, Per
from ..graphs.runner import StepKind
from ..kv import PagedKVCache
from ..models.dflash import DFlashDraftModel


@dataclass(slots=True)
class BlockBatch:
    """Inputs of a block forward for B requests."""
    roots: torch.Tensor  # [B] the last sampled token (block position 0)
    base: torch.Tensor  # [B] the root's position: the context cache covers [0, base)
    block_tables: torch.Tensor  # [B, width] zero-padded
    block_lens: torch.Tensor  # [B] the block's length, <= S: shorter near a request's end, as the reference's
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.roots.shape[0]


class DFlashBlockStep(StepKind):
    name = "draft_block"
    tokens_per_request = 1

    def __init__(self, target: torch.nn.Module, draft: DFlashDraftModel, cache: PagedKVCache, block: int,
                 max_blocks: int) -> None:
        self.target, self.draft, self.cache = target, draft, cache
        self.width = block  # S: root + S - 1 drafts
        self.max_blocks = max_blocks

    def buffer_specs(self) -> list[BufferSpec]:
        return [BufferSpec("roots", Per.REQUEST, torch.long, Pad.ZERO),
                BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),  # a padded request has no context
                BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
                BufferSpec("block_lens", Per.REQUEST, torch.long, Pad.SENTINEL, sentinel=self.width)]

    def unsupported(self, batch: BlockBatch) -> str | None:
        if batch.block_tables.shape[1] > self.max_blocks:
            return f"block table of width {batch.block_tables.shape[1]} exceeds the captured {self.max_blocks}"
        return None

    def live_inputs(self, batch: BlockBatch) -> dict[str, torch.Tensor]:
        return {"roots": batch.roots, "base": batch.base, "block_tables": batch.block_tables,
                "block_lens": batch.block_lens}

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int, mode: CaptureHiddenMode) -> BlockBatch:
        return BlockBatch(views["roots"], views["base"], views["block_tables"], views["block_lens"])

    def forward(self, static: BlockBatch) -> torch.Tensor:
        return self.body(static)

    def eager(self, batch: BlockBatch) -> torch.Tensor:
        return self.body(batch)

    def live_outputs(self, out: torch.Tensor, num_live: int, mode: CaptureHiddenMode) -> torch.Tensor:
        return out[:num_live]

    def body(self, b: BlockBatch) -> torch.Tensor:
        """The drafts' logits [B, S - 1, V] (the draft's output multiplier applied)."""
        cfg, bs = self.draft.config, self.cache.block_size
        j = torch.arange(self.width, device=b.roots.device)
        pos = b.base[:, None] + j  # [B, S]
        ids = torch.where(j == 0, b.roots[:, None], torch.full_like(pos, cfg.mask_token_id))
        embeds = self.target.embed_tokens(ids) * cfg.input_embedding_scale
        ctx_slots, ctx_mask, paged = draft_context(b.block_tables, b.base, b.block_tables.shape[1] * bs, self.width,
                                                   self.cache, embeds)
        hidden = self.draft(embeds, pos, ctx_slots, ctx_mask, self.cache, b.block_lens, paged=paged)
        return self.target.compute_logits(hidden[:, 1:]) * cfg.output_multiplier
