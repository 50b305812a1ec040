"""The one batch builder (tercel/batching.py) and the executor seam (tercel/executor.py), on CPU."""
from __future__ import annotations

import random

import pytest
import torch
from graph_utils import FakeRequests, kv_pool, tiny_model

from tercel.batching import RowSpan, TableRows, build_batch, decode_rows, device_context_slots, padded_tables
from tercel.executor import DECODE, DRAFT, Executor, verify_key
from tercel.graphs import GraphConfig
from tercel.graphs.steps import ModelStep
from tercel.kv import BlockAllocator, KVCacheSpec, PagedKVCache, slot_of
from tercel.request import Request


def _request(rng: random.Random, start: int, rows: int, block_size: int) -> Request:
    r = Request("r", None, [1], None, None, None)
    r.block_table = [rng.randint(1, 99) for _ in range(-(-(start + rows) // block_size) + rng.randint(0, 2))]
    return r


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_build_batch_rows_are_slot_of_per_position(block_size):
    rng = random.Random(block_size)
    for _ in range(50):
        spans, want_pos, want_slots = [], [], []
        for _ in range(rng.randint(1, 6)):
            start, count = rng.randint(0, 70), rng.randint(1, 40)
            width = rng.choice([None, count + rng.randint(0, 5)])
            r = _request(rng, start, width or count, block_size)
            spans.append(RowSpan(r, start, count, width, [7] * count))
            n = width or count
            want_pos += range(start, start + n)
            want_slots += [slot_of(r.block_table, p, block_size) for p in range(start, start + count)]
            want_slots += [0] * (n - count)
        rows = build_batch(spans, block_size)
        assert rows.positions == want_pos and rows.slots == want_slots
        assert rows.seq_lens == [s.start + (s.width or s.count) for s in spans]
        assert rows.cols == max(len(s.request.block_table) for s in spans)
        assert rows.ids == [t for s in spans for t in [7] * s.count + [0] * ((s.width or s.count) - s.count)]


def test_decode_rows_are_build_batchs_one_row_per_request():
    rng = random.Random(5)
    for _ in range(30):
        reqs = [_request(rng, start, 1, 4) for start in [rng.randint(0, 60) for _ in range(rng.randint(1, 9))]]
        for r in reqs:
            r.num_computed_tokens = (len(r.block_table) - 1) * 4 + rng.randint(0, 3) - rng.randint(0, 1)
        want = build_batch([RowSpan(r, r.num_computed_tokens, 1) for r in reqs], 4)
        got = decode_rows(reqs, 0, 4)
        assert (got.positions, got.slots, got.seq_lens, list(got.tables), got.cols) == (
            want.positions, want.slots, want.seq_lens, list(want.tables), want.cols)


def test_packed_tables_follow_every_change_of_the_batch():
    """TableRows against padded_tables over random windows: tables that grow, new lists (readmission), cuts in
    place (counted by the KV cache), requests leaving and joining, a table wider than the rest."""
    rng = random.Random(11)
    kv = PagedKVCache(KVCacheSpec(1, 1, 4, 4, torch.float32), 4000, torch.device("cpu"))
    alloc: BlockAllocator = kv.allocator
    reqs = [_request(rng, 0, 0, 4) for _ in range(6)]
    for r in reqs:
        r.block_table = alloc.allocate(rng.randint(1, 5))
    cache = TableRows()
    for step in range(400):
        op = rng.random()
        r = rng.choice(reqs)
        if op < 0.4:  # a window's reservation
            r.block_table.extend(alloc.allocate(rng.randint(1, 2)))
        elif op < 0.5:  # tree KV compaction
            kv.free_unused_blocks(r.block_table, rng.randint(0, 4 * len(r.block_table)))
        elif op < 0.55:  # preempted and readmitted: a new list of the same length, other blocks
            table = alloc.allocate(len(r.block_table))
            alloc.free(r.block_table)
            r.block_table = table
        elif op < 0.6 and len(reqs) > 1:  # a request leaves
            reqs.remove(r)
        elif op < 0.65:  # one joins
            new = _request(rng, 0, 0, 4)
            new.block_table = alloc.allocate(rng.randint(1, 3))
            reqs.insert(rng.randrange(len(reqs) + 1), new)
        elif op < 0.75 and len(r.block_table) > 1:  # cut, then grown back to its length with another block
            kv.free_unused_blocks(r.block_table, 4 * (len(r.block_table) - 1))
            spare = alloc.allocate(1)  # takes the freed block
            r.block_table.extend(alloc.allocate(1))
            alloc.free(spare)
        if not all(r.block_table for r in reqs):
            for r in reqs:
                if not r.block_table:
                    r.block_table = alloc.allocate(1)
        flat, cols = cache.packed(reqs, kv.table_cuts)
        want_cols = max(len(r.block_table) for r in reqs)
        assert cols == want_cols and list(flat) == padded_tables(reqs, want_cols), step


def test_context_slots_mask_past_each_length():
    rng = random.Random(3)
    reqs = [_request(rng, 0, n, 4) for n in (5, 0, 13)]
    cols = max(len(r.block_table) for r in reqs)
    tables = torch.tensor(padded_tables(reqs, cols)).view(3, cols)
    slots, valid = device_context_slots(tables, torch.tensor([5, 0, 13]), 13, 4)
    assert slots.shape == (3, 13) and valid.sum(1).tolist() == [5, 0, 13]
    for i, (r, n) in enumerate(zip(reqs, (5, 0, 13))):
        assert slots[i].tolist() == [slot_of(r.block_table, p, 4) for p in range(n)] + [0] * (13 - n)


@torch.inference_mode()  # as the engine's step (register captures under it)
def test_executor_runs_registered_kinds_and_falls_back_like_the_runner():
    model, cfg = tiny_model()
    kv = kv_pool(cfg, "cpu", torch.float32)
    ex = Executor(model, kv, torch.device("cpu"))
    reqs = FakeRequests(6, kv, cfg.vocab_size)
    eager = ex.run(DECODE, reqs.batch([0, 1]))  # nothing registered: the target's eager forward
    assert ex.runner(DECODE) is None
    runner = ex.register(DECODE, ModelStep(model, kv, 16), GraphConfig(max_bs=4, backend="breakable-debug"))
    assert ex.runner(DECODE) is runner and len(runner.graphs) == len(runner.buckets)
    torch.testing.assert_close(ex.run(DECODE, reqs.batch([0, 1])).logits, eager.logits)
    ex.run(DECODE, reqs.batch(list(range(6))))  # past the largest bucket: the runner's counted fallback
    assert runner.stats.replays == 1 and runner.stats.eager == 1
    assert ex.run(verify_key(3), reqs.batch([0], 3)).logits.shape[0] == 3  # no verify graph: eager target

    class Step:  # a kind with its own eager forward, registered without graphs
        calls = 0

        def eager(self, batch):
            Step.calls += 1
            return "drafted"

    ex.register(DRAFT, Step())
    assert ex.run(DRAFT, None) == "drafted" and Step.calls == 1 and ex.runner(DRAFT) is None
    assert ex.widths("decode") == {1: runner}
