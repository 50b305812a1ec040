"""The verify batch: trees / chains padded to a uniform width (the pieces it shares with the other step
batches are in tercel/batching.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..batching import RowSpan, Upload, blocks_covering, build_batch
from ..forward_batch import CaptureHiddenMode, ForwardBatch
from ..request import Request
from .tree import DraftTree, tree_masks


@dataclass(slots=True)
class VerifyLayout:
    """Device views of a uniform verify batch that acceptance reads (B requests x W rows)."""
    width: int
    tokens: torch.Tensor  # [B, W] the verified tokens (padding rows: the root again)
    lens: torch.Tensor  # [B] real nodes per request (rows past it are padding)
    parents: torch.Tensor | None  # [B, W] trees: parent node (-1: root or padding)
    depth: torch.Tensor | None  # [B, W] trees
    masks: torch.Tensor | None  # [B, W, W] trees: ancestor-or-self (the attention mask)


def verify_batch(reqs: Sequence[Request], trees: Sequence[DraftTree] | None, device_tokens: torch.Tensor | None,
                 width: int, block_size: int, mode: CaptureHiddenMode, with_masks: bool, upload: Upload,
                 device: torch.device) -> tuple[ForwardBatch, VerifyLayout]:
    """Every request gets `width` rows: node j of its tree at KV slot base + j (RoPE position base +
    depth[j]); rows past the tree are padding that writes the dummy slot. Token ids come from the trees
    (host) or, for device-drafted chains, from `device_tokens` [B, W]."""
    spans: list[RowSpan] = []
    tree_positions: list[int] = []  # trees: node j at RoPE position base + depth[j] (padding rows: the root's)
    lens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    for i, r in enumerate(reqs):
        base = r.num_computed_tokens
        n = len(trees[i]) if trees is not None else width
        pad = width - n
        lens.append(n)
        if trees is None:
            spans.append(RowSpan(r, base, n, width))
            continue
        t = trees[i]
        spans.append(RowSpan(r, base, n, width, t.tokens + [t.tokens[0]] * pad))
        tree_positions += [base + d for d in t.depth] + [base] * pad
        if with_masks:
            parents += t.parents + [-1] * pad
            depth += t.depth + [0] * pad
    cols = blocks_covering(max(r.num_computed_tokens for r in reqs) + width, block_size)
    rows = build_batch(spans, block_size, cols)
    lists = [tree_positions if trees is not None else rows.positions, rows.slots, rows.seq_lens, rows.tables, lens,
             rows.ids, parents, depth]
    t_pos, t_slots, t_lens, t_tables, t_n, t_ids, t_par, t_depth = upload(lists)
    b = len(reqs)
    if device_tokens is not None:
        t_ids = device_tokens.reshape(-1)
    masks = None
    if with_masks:  # padding rows (parent -1) see themselves only: never an empty row
        masks = tree_masks(torch.tensor(parents).view(b, width)).to(device, non_blocking=True)
    batch = ForwardBatch(
        input_ids=t_ids, positions=t_pos, out_cache_loc=t_slots, seq_lens=t_lens,
        block_tables=t_tables.view(b, cols), logits_indices=torch.arange(b * width, device=device),
        query_lens=[width] * b, seq_lens_cpu=rows.seq_lens,
        custom_masks=list(masks.unbind(0)) if masks is not None else None, capture_hidden_mode=mode)
    layout = VerifyLayout(width, t_ids.view(b, width), t_n, t_par.view(b, width) if with_masks else None,
                          t_depth.view(b, width) if with_masks else None, masks)
    return batch, layout
