"""The compiled CPU steps (tercel/graphs/compiled.py, --cpu-compile): the same tokens as the eager forward.

fp32 SmolLM2: greedy decode on the 20 prompts of the speculative tests, a batch padded to its bucket,
seeded sampling, and EAGLE-3 verify steps on the compiled path still equal plain greedy decoding.
Each compiled (step kind, batch bucket) costs a C++ compile the first time (about a minute here)."""
from __future__ import annotations

import pytest
from spec_utils import spec_llm
from test_spec_greedy import prompts  # noqa: F401  (the 20 SmolLM2 prompts fixture)

from tercel import SamplingParams
from tercel.graphs.compiled import CompiledSteps, batch_buckets

pytestmark = pytest.mark.timeout(1200)
N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
PREFILL = "logits wanted for only some tokens"  # a prefill chunk samples its last row only: eager


@pytest.fixture(scope="module")
def one_by_one(smol_llm):
    """Eager and compiled engines on the same weights, one request at a time (batch bucket 1)."""
    return spec_llm(smol_llm, max_num_seqs=1), spec_llm(smol_llm, max_num_seqs=1, cpu_compile=True)


def _tokens(llm, token_prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts, params)]


def test_batch_buckets_are_powers_of_two_up_to_the_cap():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]


def test_greedy_on_20_prompts_equals_eager(one_by_one, prompts):  # noqa: F811
    eager, compiled = one_by_one
    assert _tokens(compiled, prompts, GREEDY) == _tokens(eager, prompts, GREEDY)
    stats = compiled.engine.compiled.stats
    assert stats.steps_by_tokens[1] >= 20 * (N - 1)  # every decode step after the prefill ran compiled
    assert set(stats.fallbacks) == {PREFILL}
    assert compiled.engine.stats().kv_blocks_used == 0


def test_seeded_sampling_equals_eager(one_by_one, prompts):  # noqa: F811
    eager, compiled = one_by_one
    params = [SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, top_k=50, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    assert _tokens(compiled, prompts[:4], params) == _tokens(eager, prompts[:4], params)


def test_a_batch_padded_to_its_bucket_equals_eager(smol_llm, prompts):  # noqa: F811
    """Three requests of one prompt length decode together: the compiled step pads them to bucket 4."""
    tok = smol_llm.tokenizer
    same_len = [tok.encode(t) for t in ("The sea is deep and", "My cat likes to eat", "Our old car will not")]
    assert len({len(p) for p in same_len}) == 1
    eager = spec_llm(smol_llm, max_num_seqs=4)
    compiled = spec_llm(smol_llm, max_num_seqs=4, cpu_compile=True)
    assert _tokens(compiled, same_len, GREEDY) == _tokens(eager, same_len, GREEDY)
    assert compiled.engine.compiled.stats.steps_by_tokens[1] == N - 1


def test_eagle3_verify_on_the_compiled_path_equals_plain(smol_llm, prompts):  # noqa: F811
    plain = _tokens(spec_llm(smol_llm, max_num_seqs=1), prompts[:3], GREEDY)
    # a fixed width: one verify shape to compile (the adaptive widths would each trace once at start)
    llm = spec_llm(smol_llm, max_num_seqs=1, cpu_compile=True, speculative_algorithm="EAGLE3",
                   speculative_eagle_topk=1, speculative_adaptive=False)
    assert _tokens(llm, prompts[:3], GREEDY) == plain
    steps = llm.engine.compiled.stats.steps_by_tokens
    assert sum(n for t, n in steps.items() if t > 1) > 0  # verify steps of several tokens ran compiled
    assert llm.engine.stats().kv_blocks_used == 0


def test_a_mixed_batch_is_refused_with_its_reason(smol_llm):
    class Mixed:  # a prefill chunk beside a decode: the fields unsupported() reads
        query_lens = [1, 3]
        num_requests = 2
    steps = CompiledSteps(smol_llm.engine.model, smol_llm.engine.kv, max_bs=2)
    assert steps.unsupported(Mixed()) == "not a uniform batch (prefill or mixed step)"
