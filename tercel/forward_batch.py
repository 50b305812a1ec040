"""The flat batch one model forward consumes, and capture-hidden mode.

Tokens of all requests are packed into one [T] dimension (prefill chunks, decodes and verify
blocks alike); per-request metadata says where each request's queries and KV live.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class CaptureHiddenMode(enum.IntEnum):
    """Which hidden states a forward returns. Ordered: a FULL capture also serves LAST and NULL."""

    NULL = 0  # plain decode: none
    LAST = 1  # draft worker: the rows whose logits are computed
    FULL = 2  # target verify feeding a draft: every token

    def covers(self, other: "CaptureHiddenMode") -> bool:
        return self >= other


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot each token's K/V is written to
    seq_lens: torch.Tensor  # [B] int64: KV length of each request after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64
    logits_indices: torch.Tensor  # [L] int64: rows of T whose logits are wanted, sorted and distinct
    query_lens: list[int]  # host copy: tokens per request this step
    seq_lens_cpu: list[int]  # host copy of seq_lens
    # Tree verify: per request a [q, q] bool mask among its new tokens (None: causal).
    custom_masks: list[torch.Tensor | None] | None = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return self.custom_masks is None and all(q == 1 for q in self.query_lens)


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor  # [L, V] float32
    # Hidden states for drafts, per capture-hidden mode: rows are logits rows (LAST) or all tokens (FULL).
    # With aux layers configured: the concatenated outputs of those layers; else the final normed hidden.
    hidden_states: torch.Tensor | None = None
