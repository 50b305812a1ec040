"""Automatic prefix caching (tercel.prefix_cache): greedy output is the same with caching on and off
for a multi-turn conversation, plain and with NGRAM, EAGLE-3 and DFLASH (SmolLM2 with the bundled drafts,
fp32), later turns take their history from the cache, an exactly block-aligned fully cached prompt still
computes its last token, copies of a prompt (n > 1) take the first one's blocks with the same tokens, and a
pool filled with distinct prefixes keeps serving (evicting) and leaks no block. Units: reference counts, LRU
eviction of unreferenced cached blocks only, chained keys, the lookahead a draft's KV needs, copies waiting
for the blocks another request is computing (and not for one that stopped)."""
from __future__ import annotations

import gc

import pytest
from spec_utils import spec_llm

from tercel import SamplingParams
from tercel.config import EngineConfig
from tercel.kv import BlockAllocator
from tercel.outputs import RequestMetrics
from tercel.prefix_cache import PrefixCache
from tercel.request import Request
from tercel.speculative import DEFAULT_DFLASH_DRAFT

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
USER_TURNS = ["Hi! Can you explain what a hash table is?", "How does it handle collisions?",
              "Give me a short Python example.", "What is its worst-case lookup time?"]
SPEC = {"plain": {}, "NGRAM": dict(speculative_algorithm="NGRAM"),
        "EAGLE3": dict(speculative_algorithm="EAGLE3"),
        "DFLASH": dict(speculative_algorithm="DFLASH", speculative_draft_model_path=DEFAULT_DFLASH_DRAFT)}


# ---- units --------------------------------------------------------------------------------------
def _req(tokens: list[int]) -> Request:
    return Request("r", None, list(tokens), SamplingParams(), None, RequestMetrics(0.0))


def test_allocator_counts_references_and_evicts_only_unreferenced_cached_blocks():
    a = BlockAllocator(5)  # 4 usable
    x = a.allocate(2)
    a.publish(x[0], b"k0")
    a.publish(x[1], b"k1")
    a.share(x[0])  # a second holder of block x[0]
    a.free(x)
    assert a.num_free == 3 and a.num_cached_free == 1 and a.lookup(b"k0") == x[0]  # still held once
    a.free([x[0]])
    assert a.num_free == 4 and a.num_cached_free == 2
    y = a.allocate(2)  # the free list first: both cached blocks survive
    assert not set(y) & set(x) and a.lookup(b"k1") == x[1]
    z = a.allocate(1)  # then the least recently freed cached block: x[1] (freed before x[0])
    assert z == [x[1]] and a.lookup(b"k1") is None and a.lookup(b"k0") == x[0] and a.num_evictions == 1
    a.share(x[0])  # a hit takes it off the evictable set
    assert a.num_free == 0
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.free(y + z + [x[0]])
    assert a.num_free == 4


def test_duplicate_content_keeps_the_first_block():
    a = BlockAllocator(4)
    x, y = a.allocate(1), a.allocate(1)
    a.publish(x[0], b"k")
    a.publish(y[0], b"k")  # computed at the same time by another request: stays private
    assert a.lookup(b"k") == x[0]
    a.free(y)
    a.free(x)
    assert a.num_cached_free == 1 and a.num_free == 3


@pytest.mark.parametrize("lookahead", [0, 1])
def test_match_is_chained_over_the_prefix_and_leaves_the_last_token(lookahead):
    a = BlockAllocator(32)
    pc = PrefixCache(a, block_size=4, lookahead=lookahead)
    first = _req(list(range(13)))
    first.block_table = a.allocate(4)
    first.num_computed_tokens = first.draft_kv_len = 12
    pc.publish(first)
    # lookahead 1: the block [8, 12) also needs token 12 to be known
    assert first.num_published_blocks == 3
    same = _req(list(range(13)) + [99])
    assert pc.match(same) == first.block_table[:3]
    aligned = _req(list(range(12)))  # fully cached but block-aligned: the last block is computed again
    assert pc.match(aligned) == first.block_table[:2]
    other = _req([7] + list(range(1, 13)))  # differs in block 0: nothing matches, though block 1 is equal
    assert pc.match(other) == []
    if lookahead:
        diverge = _req(list(range(8)) + [50, 51, 52, 53, 54])  # token 8 differs: block 1's draft KV saw token 8
        assert pc.match(diverge) == first.block_table[:1]


def test_draft_kv_holds_back_publishing():
    a = BlockAllocator(8)
    pc = PrefixCache(a, block_size=4, draft_kv=True)
    r = _req(list(range(10)))
    r.block_table = a.allocate(3)
    r.num_computed_tokens, r.draft_kv_len = 9, 4
    pc.publish(r)
    assert r.num_published_blocks == 1
    r.draft_kv_len = 9
    pc.publish(r)
    assert r.num_published_blocks == 2


def _scheduler(pc_on: bool = True, num_blocks: int = 64, **kw):
    from tercel.scheduler import Scheduler

    a = BlockAllocator(num_blocks)
    return Scheduler(a, 4, kw.pop("max_num_seqs", 16), kw.pop("max_num_batched_tokens", 64),
                     PrefixCache(a, block_size=4) if pc_on else None, **kw)


def _step(sched) -> dict[str, int]:
    """Schedule a step and pretend it ran: request id -> tokens computed."""
    out = sched.schedule()
    for s in out.scheduled:
        done = s.completes_sequence
        s.request.num_computed_tokens += s.num_tokens
        if done:
            s.request.output_token_ids.append(5)
    return {s.request.request_id: s.num_tokens for s in out.scheduled}


def _named(name: str, tokens: list[int]) -> Request:
    r = _req(tokens)
    r.request_id = name
    return r


def test_copies_of_a_prompt_wait_for_the_first_and_start_after_its_blocks():
    """n copies of a prompt (and a prompt sharing its first blocks) queued together: the first computes the
    shared blocks, the others wait one step and take them from the cache; an unrelated prompt behind them is
    admitted meanwhile. The server's admission room counts the shared blocks as free."""
    sched = _scheduler()
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    reqs = [_named(f"c{i}", prompt) for i in range(3)] + [_named("shared", prompt[:8] + [7, 7, 7, 7, 7]),
                                                          _named("other", list(range(200, 206)))]
    for r in reqs:
        sched.add(r)
    room = sched.admission_room()
    assert room.tokens == 64 - (11 + 3 + 3 + 5 + 6)  # each follower computes only what is past the 2 shared blocks
    assert _step(sched) == {"c0": 11, "other": 6}
    assert [r.request_id for r in sched.waiting] == ["c1", "c2", "shared"]
    assert _step(sched) == {"c0": 1, "other": 1, "c1": 3, "c2": 3, "shared": 5}
    assert [r.metrics.num_cached_tokens for r in reqs] == [0, 8, 8, 8, 0]
    assert sched.prefix_cache.stats.hit_tokens == 24


def test_a_copy_does_not_wait_for_a_request_that_stopped_computing_its_prompt():
    """The wait is only for blocks a running request is still computing: once the first copy is gone
    (aborted mid-prefill, or preempted), the next one is admitted and computes them itself."""
    sched = _scheduler(max_num_batched_tokens=4)
    first, second = _named("a", list(range(100, 111))), _named("b", list(range(100, 111)))
    sched.add(first)
    sched.add(second)
    assert _step(sched) == {"a": 4}  # a chunk: its blocks 1 and 2 are still ahead, so b waits
    assert _step(sched) == {"a": 4}
    sched.finish(first)
    assert _step(sched) == {"b": 3}  # the 2 blocks a computed came from the cache; b computes the rest
    assert second.metrics.num_cached_tokens == 8


def test_without_prefix_caching_copies_are_admitted_together():
    sched = _scheduler(pc_on=False)
    for i in range(3):
        sched.add(_named(f"c{i}", list(range(100, 111))))
    assert _step(sched) == {"c0": 11, "c1": 11, "c2": 11}


def test_settings_and_flags():
    assert EngineConfig().cache.enable_prefix_caching is True
    import argparse

    from tercel.cli_args import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert engine_config_from_args(p.parse_args([])).enable_prefix_caching is True
    assert engine_config_from_args(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(p.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True


# ---- SmolLM2 ------------------------------------------------------------------------------------
def _conversation(llm, turns: int = 3) -> tuple[list[list[int]], list[int]]:
    """A chat: each turn's prompt is the whole history; returns the outputs and cached-token counts."""
    tok = llm.tokenizer
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in a few sentences."}]
    outs, cached = [], []
    for text in USER_TURNS[:turns]:
        messages.append({"role": "user", "content": text})
        o = llm.generate(tok.apply_chat_template(messages), GREEDY)[0]
        outs.append(o.outputs[0].token_ids)
        cached.append(o.num_cached_tokens)
        messages.append({"role": "assistant", "content": o.outputs[0].text})
    return outs, cached


@pytest.mark.parametrize("algo", list(SPEC))
def test_multi_turn_greedy_output_is_the_same_with_caching_on_and_off(smol_llm, algo):
    kw = dict(SPEC[algo], max_model_len=1024, num_kv_blocks=96)  # a small pool: 1 GiB per engine adds up
    on = spec_llm(smol_llm, enable_prefix_caching=True, **kw)
    off = spec_llm(smol_llm, enable_prefix_caching=False, **kw)
    outs_on, cached_on = _conversation(on)
    outs_off, cached_off = _conversation(off)
    assert outs_on == outs_off
    assert cached_off == [0, 0, 0]
    # turns 2 and 3 find the history in the cache: plain and NGRAM all the full blocks of the previous turn's
    # prompt and most of its answer; EAGLE-3 and DFLASH the blocks their draft KV covered too (adaptive
    # speculation defers draft_extend over plain steps, so the last blocks of a turn may not be shared)
    assert cached_on[0] == 0 and 32 <= cached_on[1] < cached_on[2], cached_on
    stats = on.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    assert stats.prefix_cache_hit_tokens == sum(cached_on) and 0 < stats.prefix_cache_hit_rate < 1
    if algo != "plain":
        assert on.engine.spec_stats().verify_steps > 0
    del on, off
    gc.collect()


def test_copies_of_prompts_give_the_same_greedy_tokens_with_caching_on_and_off(smol_llm):
    """n = 3 copies of 3 prompts in one generate call: with caching on, the copies wait for the first and
    take its full blocks from the cache; the tokens are those of an engine without caching."""
    tok = smol_llm.tokenizer
    prompts = [tok.encode(f"Story {i}: the lighthouse keeper counted {i + 3} ships before the storm, and then")
               for i in range(3)]
    batch = [p for p in prompts for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on = spec_llm(smol_llm, max_model_len=256, num_kv_blocks=48)
    off = spec_llm(smol_llm, max_model_len=256, num_kv_blocks=48, enable_prefix_caching=False)
    outs_on, outs_off = on.generate(batch, params), off.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    full = [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.num_cached_tokens for o in outs_on] == [n for f in full for n in (0, f, f)] and min(full) > 0
    assert on.engine.stats().kv_blocks_used == 0


def test_block_aligned_prompt_fully_cached_still_computes_its_last_token(smol_llm):
    llm = spec_llm(smol_llm, block_size=16, max_model_len=256, num_kv_blocks=32)
    ids = smol_llm.tokenizer.encode("The history of the printing press begins in the fifteenth century " * 8)[:64]
    assert len(ids) == 64
    first = llm.generate(ids, GREEDY)[0]
    again = llm.generate(ids, GREEDY)[0]
    assert again.num_cached_tokens == 48  # 3 of the 4 blocks: the 4th holds the token whose logits are needed
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.stats().kv_blocks_used == 0


def test_eviction_keeps_serving_and_leaks_no_block(smol_llm):
    """A pool of 24 blocks x 16 tokens; 12 prompts of ~70 tokens with distinct prefixes fill it with cached
    blocks many times over: later requests evict, outputs equal an uncached engine's, nothing leaks."""
    kw = dict(block_size=16, num_kv_blocks=24, max_model_len=256, max_num_seqs=4)
    llm = spec_llm(smol_llm, **kw)
    ref = spec_llm(smol_llm, enable_prefix_caching=False, **kw)
    tok = smol_llm.tokenizer
    prompts = [tok.encode(f"Document {i}: " + "a list of facts about the number %d. " % i * 6)[:70] for i in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for round_ in range(2):  # the second round's prefixes were evicted by the first's later prompts
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref.generate(prompts,
                                                                                                          params)]
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert llm.engine.kv.allocator.num_evictions > 0
    # a prompt sent twice in a row still hits after all that churn
    a, b = llm.generate([prompts[3]], params)[0], llm.generate([prompts[3]], params)[0]
    assert b.num_cached_tokens == 64 and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.engine.stats().kv_blocks_used == 0
