"""Continuous batching must not change results: one-by-one == batch of 16 (mixed lengths) ==
a run with a tiny KV pool that forces preemption == a run with tiny prefill chunks."""
from __future__ import annotations

import pytest

from tercel import LLM, SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(smol_chat_ids, smol_llm):
    tok = smol_llm.tokenizer
    extra = ["Once upon a time", "def fibonacci(n):", "The three primary colors are",
             "In 1969, astronauts", "A list of fruits: apple,", "SELECT name FROM users WHERE",
             "The quick brown fox", "Dear hiring manager,"]
    ps = smol_chat_ids + [tok.encode(e) for e in extra]
    assert len(ps) == 16 and len({len(p) for p in ps}) > 8  # mixed lengths
    return ps


@pytest.fixture(scope="module")
def one_by_one(smol_llm, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [smol_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def test_batch_of_16_equals_one_by_one(smol_llm, prompts, one_by_one):
    outs = smol_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == one_by_one


def _small_engine_llm(smol_llm, **kw) -> LLM:
    """A second LLM sharing the loaded weights, with other scheduler limits."""
    from tercel.engine import LLMEngine

    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(loaded=smol_llm.engine.loaded, dtype="float32", device="cpu", max_model_len=128, **kw)
    return llm


def test_preemption_gives_the_same_outputs(smol_llm, prompts, one_by_one):
    llm = _small_engine_llm(smol_llm, num_kv_blocks=12, block_size=16)  # 176 tokens for 16 requests
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == one_by_one
    assert llm.engine.stats().kv_blocks_used == 0


def test_chunked_prefill_gives_the_same_outputs(smol_llm, prompts, one_by_one):
    llm = _small_engine_llm(smol_llm, max_num_batched_tokens=7, max_num_seqs=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == one_by_one


def test_seeded_sampling_is_batch_invariant(smol_llm, prompts):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    batched = smol_llm.generate(prompts, params)
    alone = [smol_llm.generate([p], sp)[0] for p, sp in zip(prompts[:4], params[:4])]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in batched[:4]]
