"""The reference attention backend (tercel/attention/torch_ref.py) on a mixed batch: decodes beside prefill
chunks run as one batched decode, and every row equals attention computed for its request alone."""
from __future__ import annotations

import random

import pytest
import torch
from graph_utils import TINY, kv_pool

from tercel.attention.torch_ref import TorchAttentionBackend
from tercel.batching import RowSpan, build_batch
from tercel.config import ModelConfig
from tercel.forward_batch import ForwardBatch
from tercel.request import Request

BLOCK = 4


def _batch(kv, spans: list[tuple[Request, int, int]]) -> ForwardBatch:
    """(request, start, count) per request: its queries are positions start .. start + count - 1."""
    rows = build_batch([RowSpan(r, start, count) for r, start, count in spans], BLOCK)
    t = torch.tensor
    return ForwardBatch(input_ids=torch.zeros(len(rows.positions), dtype=torch.long), positions=t(rows.positions),
                        out_cache_loc=t(rows.slots), seq_lens=t(rows.seq_lens),
                        block_tables=t(rows.tables).view(len(spans), rows.cols),
                        logits_indices=torch.zeros(0, dtype=torch.long), query_lens=[c for _, _, c in spans],
                        seq_lens_cpu=rows.seq_lens)


@pytest.mark.parametrize("decodes_first", [True, False])
def test_decodes_beside_prefill_chunks_run_batched_and_match_each_request_alone(decodes_first):
    cfg = ModelConfig.from_hf_dict(TINY)
    kv = kv_pool(cfg, "cpu", torch.float32, num_blocks=96, block_size=BLOCK)
    backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, None)
    rng = random.Random(0)
    free = list(range(1, 96))
    rng.shuffle(free)
    spans = []
    for count in [1, 1, 1, 7, 1, 13, 1]:  # decodes of several lengths, prefill chunks after a cached prefix
        start = rng.randint(3, 20)
        r = Request("r", None, [1], None, None, None)
        r.block_table = [free.pop() for _ in range(-(-(start + count) // BLOCK))]
        spans.append((r, start, count))
    if decodes_first:
        spans.sort(key=lambda s: s[2] > 1)
    batch = _batch(kv, spans)
    meta = backend.prepare(batch, BLOCK)
    assert meta.decode_rows is not None and len(meta.per_request) == 2
    assert isinstance(meta.decode_rows, slice) == decodes_first
    g = torch.Generator().manual_seed(3)
    n = batch.input_ids.numel()
    q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
    mixed = backend.forward(0, q, k, v, batch, meta, kv)
    offset = 0
    for r, start, count in spans:  # each request alone (its own K/V are written already)
        one = _batch(kv, [(r, start, count)])
        rows = slice(offset, offset + count)
        alone = backend.forward(0, q[rows], k[rows], v[rows], one, backend.prepare(one, BLOCK), kv)
        torch.testing.assert_close(mixed[rows], alone, rtol=1e-5, atol=1e-5)
        offset += count
