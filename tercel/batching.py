"""Building a step's ForwardBatch from scheduled requests: KV slots, positions, padded block tables.

The plain step, the speculative worker's normal path (prefill chunks, undrafted decodes) and the drafters'
batches use these; `Upload` moves the integer lists to the device (one pinned copy on a GPU).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .forward_batch import ForwardBatch
from .kv import slot_of
from .request import Request
from .scheduler import ScheduledRequest

Upload = Callable[[Sequence[Sequence[int]]], list[torch.Tensor]]


def blocks_covering(end: int, block_size: int) -> int:
    """Block-table width that covers positions [0, end)."""
    return -(-end // block_size)


def padded_tables(reqs: Sequence[Request], width: int) -> list[int]:
    """The requests' block tables cut or zero-padded to `width` (0 = the dummy block, so a read past a
    request's blocks lands there), flattened row by row."""
    out: list[int] = []
    for r in reqs:
        t = r.block_table[:width]
        out += t + [0] * (width - len(t))
    return out


def step_batch(scheduled: Sequence[ScheduledRequest], block_size: int,
               upload: Upload) -> tuple[ForwardBatch, list[ScheduledRequest]]:
    """One forward over each request's next `num_tokens` (a prefill chunk or a decode token): the batch,
    and the scheduled requests whose last row is sampled (their chunk completes the sequence)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    logits_idx: list[int] = []
    sampled: list[ScheduledRequest] = []
    for s in scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
        ids.extend(r.token_slice(start, end))
        positions.extend(range(start, end))
        slots.extend(slot_of(r.block_table, p, block_size) for p in range(start, end))
        seq_lens.append(end)
        if s.completes_sequence:
            logits_idx.append(len(ids) - 1)
            sampled.append(s)
    reqs = [s.request for s in scheduled]
    width = max(len(r.block_table) for r in reqs)
    t_ids, t_pos, t_slots, t_lens, t_tables, t_logits = upload(
        [ids, positions, slots, seq_lens, padded_tables(reqs, width), logits_idx])
    batch = ForwardBatch(
        input_ids=t_ids, positions=t_pos, out_cache_loc=t_slots, seq_lens=t_lens,
        block_tables=t_tables.view(len(reqs), width), logits_indices=t_logits,
        query_lens=[s.num_tokens for s in scheduled], seq_lens_cpu=seq_lens,
    )
    return batch, sampled
