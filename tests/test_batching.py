"""Continuous batching must not change results: one-by-one == batch of 16 (mixed lengths) ==
a run with a tiny KV pool that forces preemption == a run with tiny prefill chunks == a run whose decoding
requests cap each step's tokens. Unit: the step cap (max_step_tokens) and the prefill floor under it."""
from __future__ import annotations

import pytest

from tercel import LLM, SamplingParams
from tercel.kv import BlockAllocator
from tercel.outputs import RequestMetrics
from tercel.request import Request, RequestStatus
from tercel.scheduler import Scheduler

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


def test_step_cap_gives_the_same_outputs(smol_llm, prompts, one_by_one):
    """5 requests decode while the others prefill in chunks of at most 12 - 5 tokens (never below 3)."""
    llm = _small_engine_llm(smol_llm, max_num_batched_tokens=64, max_step_tokens=12, max_num_seqs=5)
    assert llm.engine.scheduler.min_prefill_tokens == 3
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == one_by_one


def _decoding(sched: Scheduler, n: int) -> None:
    """n running requests that decode next (their prompts computed)."""
    for _ in range(n):
        r = Request(f"d{len(sched.running)}", None, [1, 2, 3], SamplingParams(), None, RequestMetrics(0.0))
        r.num_computed_tokens, r.status, r.block_table = 2, RequestStatus.RUNNING, sched.allocator.allocate(1)
        sched.running.insert(0, r)


def test_decoding_requests_cap_the_step_and_the_prefill_keeps_a_floor():
    """While requests decode, decodes plus prefill stay within max_step_tokens, the prefill never below
    min_prefill_tokens (a new short prompt starts at once however many decode); with nothing decoding a
    prefill chunk takes the whole max_num_batched_tokens."""
    sched = Scheduler(BlockAllocator(256), 4, max_num_seqs=64, max_num_batched_tokens=64, max_step_tokens=24,
                      min_prefill_tokens=6)
    long_prompt = Request("long", None, list(range(1000, 1200)), SamplingParams(), None, RequestMetrics(0.0))
    sched.add(long_prompt)

    def step() -> list[int]:
        out = sched.schedule().scheduled
        for s in out:
            s.request.num_computed_tokens += s.num_tokens
        return [s.num_tokens for s in out if s.request is long_prompt]

    assert step() == [64]  # nothing decodes: the whole prefill budget
    _decoding(sched, 10)
    assert step() == [14] and len(sched.running) == 11  # 24 - 10 decodes
    for r in sched.running[:-1]:
        r.num_computed_tokens -= 1  # decode again
    _decoding(sched, 20)
    assert step() == [6]  # 30 decodes go anyway; the prefill gets its floor
    assert (sched.prefill_budget(0), sched.prefill_budget(4), sched.prefill_budget(40)) == (64, 20, 6)
    uncapped = Scheduler(BlockAllocator(8), 4, max_num_seqs=64, max_num_batched_tokens=64)
    assert uncapped.prefill_budget(40) == 64


def test_seeded_sampling_is_batch_invariant(smol_llm, prompts):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    batched = smol_llm.generate(prompts, params)
    alone = [smol_llm.generate([p], sp)[0] for p, sp in zip(prompts[:4], params[:4])]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in batched[:4]]
