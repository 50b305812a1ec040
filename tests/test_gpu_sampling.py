"""GPU: a request's token draws are the same on the GPU as on the CPU (the counter-based noise is
integer arithmetic, exact on both), so seeded sampling does not depend on the device. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tercel import SamplingParams
from tercel.outputs import RequestMetrics
from tercel.request import Request
from tercel.sampling import draw_keys, draw_noise, sample_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reqs(params: SamplingParams, seeds: list[int]) -> list[Request]:
    return [Request("r", None, [1], params, torch.Generator(), RequestMetrics(0.0), seed=s) for s in seeds]


def test_noise_and_draws_equal_on_cpu_and_gpu():
    seeds = [0, 1, 2**61 + 5, 12345]
    keys = draw_keys(_reqs(SamplingParams(temperature=1.0), seeds))
    cpu = draw_noise(keys, 49152, torch.device("cpu"))
    gpu = draw_noise(keys, 49152, torch.device("cuda")).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=0)
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 4
    p = SamplingParams(temperature=0.8, top_p=0.9)
    cpu_reqs, gpu_reqs = _reqs(p, seeds), _reqs(p, seeds)
    for _ in range(3):  # successive draws of the same streams
        assert sample_batch(logits, cpu_reqs).tolist() == sample_batch(logits.cuda(), gpu_reqs).cpu().tolist()


@pytest.mark.parametrize("b", [1, 3, 64, 65])
def test_captured_sampling_equals_eager_for_every_filter_set(b):
    """The decode windows' sampler graphs (tercel.graphs.sampler) draw the eager path's tokens: every filter
    set, padded buckets (3 -> 4), the largest bucket and one past it (eager), rows with mixed settings, and
    successive draws replaying one graph with new inputs."""
    from tercel.graphs.sampler import SamplerGraphs
    from tercel.sampling import SamplingTensors, sample_rows, stream_keys

    vocab = 49152
    graphs = SamplerGraphs(vocab, torch.device("cuda"))
    gen = torch.Generator().manual_seed(b)
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20),
                dict(temperature=1.0, min_p=0.05), dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02)]
    for kw in settings:
        params = [SamplingParams(**kw) if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.8) for i in range(b)]
        st = SamplingTensors.of(params, vocab, torch.device("cuda"))
        seeds = torch.randint(0, 2**62, (b,), generator=gen).cuda()
        for draw in range(3):
            logits = (torch.randn(b, vocab, generator=gen) * 4).to(torch.bfloat16).cuda()
            draws = torch.full((b,), draw, dtype=torch.long, device="cuda")
            want = sample_rows(logits, st, stream_keys(seeds, draws))
            assert graphs.sample(logits, st, seeds, draws).tolist() == want.tolist(), (kw, draw)
    if b <= graphs.max_bs:
        assert graphs.stats["eager"] == 0 and graphs.stats["replays"] == 3 * len(settings)
    else:
        assert graphs.stats["replays"] == 0


def test_a_bf16_targets_logits_are_exact_in_bf16_and_sort_there_to_the_same_tokens(smol_path):
    """A bf16 target's heads (the fused GEMV at one row, the small-M and cuBLAS heads at more) round each logit to
    bf16 before widening it, so the float32 logits convert to bf16 losslessly (logits_exact_dtype) and the sampler
    sorts them there (half the radix passes) to the same tokens as the float32 sort, ties included."""
    from tercel import LLM
    from tercel.sampling import SamplingTensors, sample_rows, stream_keys

    llm = LLM(model=smol_path, dtype="bfloat16", device="cuda", max_model_len=512, kv_cache_memory=256 << 20,
              progress=False)
    model = llm.engine.model
    assert model.logits_exact_dtype == torch.bfloat16
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    for m in (1, 4, len(ids)):  # the batch-1 head, a small-M head, a prefill's
        logits = _head_logits(llm, ids[:m])
        assert torch.equal(logits.to(torch.bfloat16).float(), logits), m
    logits = _head_logits(llm, ids[:1]).repeat(6, 1)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in
              ((1.0, 0.95, 0), (0.7, 0.9, 0), (1.3, 1.0, 40), (1.0, 0.5, 7), (2.0, 0.99, 0), (1.0, 0.8, 3))]
    st = SamplingTensors.of(params, logits.shape[-1], logits.device)
    for draw in range(8):
        keys = stream_keys(torch.arange(6, device="cuda"), torch.full((6,), draw, device="cuda"))
        assert torch.equal(sample_rows(logits, st, keys, exact=torch.bfloat16), sample_rows(logits, st, keys))


def _head_logits(llm, ids: list[int]) -> torch.Tensor:
    """The target's float32 logits of every row of a fresh prefill of ids."""
    from tercel.batching import RowSpan, build_batch
    from tercel.forward_batch import ForwardBatch

    eng = llm.engine
    blocks = list(range(1, 1 + -(-len(ids) // eng.kv.block_size)))
    req = Request("head", None, ids, SamplingParams(), None, RequestMetrics(0.0), block_table=blocks)
    rows = build_batch([RowSpan(req, 0, len(ids), len(ids), ids)], eng.kv.block_size)
    t = eng.executor.upload([rows.ids, rows.positions, rows.slots, [len(ids)], rows.tables, list(range(len(ids)))])
    batch = ForwardBatch(input_ids=t[0], positions=t[1], out_cache_loc=t[2], seq_lens=t[3],
                         block_tables=t[4].view(1, -1), logits_indices=t[5], query_lens=[len(ids)],
                         seq_lens_cpu=[len(ids)])
    return eng.executor.forward(batch).logits
