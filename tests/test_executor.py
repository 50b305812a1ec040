"""The one batch builder (tercel/batching.py) and the executor seam (tercel/executor.py), on CPU."""
from __future__ import annotations

import random

import pytest
import torch
from graph_utils import FakeRequests, kv_pool, tiny_model

from tercel.batching import RowSpan, build_batch, context_slots
from tercel.executor import DECODE, DRAFT, Executor, verify_key
from tercel.graphs import GraphConfig
from tercel.graphs.steps import ModelStep
from tercel.kv import slot_of
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


def test_context_slots_mask_past_each_length():
    rng = random.Random(3)
    reqs = [_request(rng, 0, n, 4) for n in (5, 0, 13)]
    slots, valid = context_slots(reqs, [5, 0, 13], 4, "cpu")
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
