"""Building a step's rows: KV slots, positions, seq lens, padded block tables.

`build_batch` is the one place that turns each request's (start, count, width, ids) into those rows; the plain
step (`step_batch`), the speculative worker's normal path and verify batch, the decode windows and the drafters'
batches all build with it. `Upload` moves the integer lists to the device (one pinned copy on a GPU).
"""
from __future__ import annotations

import itertools
import operator
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .forward_batch import ForwardBatch
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


@dataclass(slots=True)
class RowSpan:
    """One request's rows in a batch: `count` real rows at positions start, start + 1, ..., then padding
    rows up to `width` (None: no padding) that write the dummy slot 0."""
    request: Request
    start: int
    count: int
    width: int | None = None
    ids: Sequence[int] | None = None  # the rows' token ids; padded with 0 up to the width

    @property
    def rows(self) -> int:
        return self.count if self.width is None else self.width


@dataclass(slots=True)
class BatchRows:
    """The rows of a batch on the host, request by request (each request's rows, then the next one's)."""
    positions: list[int]  # start + j (padding rows go on counting)
    slots: list[int]  # the KV slot of each real row; 0 (the dummy slot) for padding rows
    seq_lens: list[int]  # start + width
    tables: Sequence[int]  # block tables, flat, padded or cut to `cols` (a list, or TableRows' packed array)
    cols: int
    ids: list[int]  # every row's token id (empty when the spans carry none)


def span_slots(block_table: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """KV slots of positions [start, start + count): `table[pos // bs] * bs + pos % bs`, expanded one
    block at a time (a range per block touched, no per-position Python work)."""
    block, off = divmod(start, block_size)
    if off + count <= block_size:  # one block (every decode row)
        first = block_table[block] * block_size + off
        return list(range(first, first + count))
    out: list[int] = []
    pos, end = start, start + count
    while pos < end:
        block, off = divmod(pos, block_size)
        n = min(block_size - off, end - pos)
        first = block_table[block] * block_size + off
        out += range(first, first + n)
        pos += n
    return out


def build_batch(spans: Sequence[RowSpan], block_size: int, cols: int | None = None) -> BatchRows:
    """Every batch builder's rows: positions, KV slots, seq lens, the padded block tables (cols: their
    width; None: the longest table) and the token ids, from each request's (start, count, width, ids)."""
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    ids: list[int] = []
    for s in spans:
        n = s.count if s.width is None else s.width
        positions += range(s.start, s.start + n)
        slots += span_slots(s.request.block_table, s.start, s.count, block_size)
        seq_lens.append(s.start + n)
        if n != s.count:
            slots += [0] * (n - s.count)
        if s.ids is not None:
            ids += s.ids
            if len(s.ids) != n:
                ids += [0] * (n - len(s.ids))
    reqs = [s.request for s in spans]
    cols = max(len(r.block_table) for r in reqs) if cols is None else cols
    return BatchRows(positions, slots, seq_lens, padded_tables(reqs, cols), cols, ids)


def same_batch(a: Sequence[Request], b: Sequence[Request]) -> bool:
    """The same requests in the same order (identity): a batch that decodes on unchanged, checked once per window."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass(slots=True)
class TableRows:
    """A decode batch's padded block tables (padded_tables), kept packed from one window to the next: while the
    same requests decode with the same table lists, only the rows of tables that grew are written (a table grows by
    a block every block_size tokens: ~16 rows a step at 256 requests, against a [256, ~20] table to serialise).
    A table otherwise changes only by becoming a new list (admission, preemption, release) or by a cut in place
    (PagedKVCache.free_unused_blocks, which counts its cuts); a new batch, a new list, a cut or a table wider than
    the packed width repacks the whole."""
    reqs: list[Request] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # the lists packed (held: no new list reuses an id)
    lens: list[int] = field(default_factory=list)
    cols: int = 0
    cuts: int = -1
    flat: array = field(default_factory=lambda: array("q"))

    def packed(self, reqs: Sequence[Request], cuts: int) -> tuple[array, int]:
        """padded_tables(reqs, cols) as int64s, and cols (the longest table). cuts: the KV cache's cut count."""
        if cuts == self.cuts and same_batch(reqs, self.reqs):
            flat, lens, tables, cols = self.flat, self.lens, self.tables, self.cols
            for i, r in enumerate(reqs):
                t = r.block_table
                n, was = len(t), lens[i]
                if n == was and t is tables[i]:
                    continue
                if t is not tables[i] or n < was or n > cols:
                    break
                flat[i * cols + was:i * cols + n] = array("q", t[was:n])
                lens[i] = n
            else:
                return flat, cols
        self.reqs, self.tables, self.cuts = list(reqs), [r.block_table for r in reqs], cuts
        self.lens = [len(t) for t in self.tables]
        self.cols = max(self.lens)
        self.flat = array("q", padded_tables(reqs, self.cols))
        return self.flat, self.cols


def decode_rows(reqs: Sequence[Request], ahead: int, block_size: int, tables: TableRows | None = None,
                cuts: int = 0) -> BatchRows:
    """build_batch for one row per request at position num_computed_tokens + ahead (a decode window of one
    step): the same rows, without a RowSpan per request (this runs per step at every batch size). tables: the
    packed tables kept from the previous window (cuts: the KV cache's table_cuts); its rows' `tables` are then
    that array, which the upload copies as it is."""
    positions = [r.num_computed_tokens + ahead for r in reqs]
    slots = [r.block_table[p // block_size] * block_size + p % block_size for r, p in zip(reqs, positions)]
    if tables is None:
        cols = max(len(r.block_table) for r in reqs)
        flat = padded_tables(reqs, cols)
    else:
        flat, cols = tables.packed(reqs, cuts)
    return BatchRows(positions, slots, [p + 1 for p in positions], flat, cols, [])


def device_context_slots(block_tables: torch.Tensor, lengths: torch.Tensor, width: int,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From tensors (graph-safe: static shapes, no host values): the slots [B, width] of positions
    0 .. width - 1 through the block tables [B, cols], slot 0 (the dummy slot) at and past each request's
    length, and which are valid (< lengths [B])."""
    pos = torch.arange(width, device=lengths.device)
    valid = pos[None, :] < lengths[:, None]
    cols = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, cols] * block_size + pos % block_size
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def step_batch(scheduled: Sequence[ScheduledRequest], block_size: int,
               upload: Upload) -> tuple[ForwardBatch, list[ScheduledRequest]]:
    """One forward over each request's next `num_tokens` (a prefill chunk or a decode token): the batch,
    and the scheduled requests whose last row is sampled (their chunk completes the sequence)."""
    spans = [RowSpan(s.request, s.request.num_computed_tokens, s.num_tokens,
                     ids=s.request.token_slice(s.request.num_computed_tokens,
                                               s.request.num_computed_tokens + s.num_tokens)) for s in scheduled]
    rows = build_batch(spans, block_size)
    sampled = [s for s in scheduled if s.completes_sequence]
    ends = itertools.accumulate(s.num_tokens for s in scheduled)
    logits_idx = [end - 1 for end, s in zip(ends, scheduled) if s.completes_sequence]
    t_ids, t_pos, t_slots, t_lens, t_tables, t_logits = upload(
        [rows.ids, rows.positions, rows.slots, rows.seq_lens, rows.tables, logits_idx])
    batch = ForwardBatch(
        input_ids=t_ids, positions=t_pos, out_cache_loc=t_slots, seq_lens=t_lens,
        block_tables=t_tables.view(len(spans), rows.cols), logits_indices=t_logits,
        query_lens=[s.num_tokens for s in scheduled], seq_lens_cpu=rows.seq_lens,
    )
    return batch, sampled
