"""Adaptive speculation on a GPU (SmolLM2 bf16 under CUDA graphs; skipped without CUDA): a hopeless draft (a
random EAGLE-3 head: every draft rejected) goes plain and runs its plain stretches as decode windows; a draft
that pays (n-gram on text that repeats itself) keeps speculating; either way the output is plain output."""
from __future__ import annotations

import pytest
import torch
from conftest import smollm2_gguf_or_skip
from spec_utils import spec_llm

from tercel import LLM, SamplingParams
from tercel.train.export import random_eagle3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32():
    return LLM(smollm2_gguf_or_skip(), dtype="float32", device="cuda", max_model_len=1024,
               kv_cache_memory=2 << 30, progress=False)


@pytest.fixture(scope="module")
def prompts(fp32):
    tok = fp32.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": "Tell me about the history of Rome."}]),
            tok.encode("The quick brown fox jumps over the lazy dog. " * 8)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_a_hopeless_draft_goes_plain_at_decode_window_speed(fp32, prompts, tmp_path):
    head = random_eagle3(tmp_path / "e3", fp32.engine.model_config, draft_vocab_size=4096, intermediate_size=256)
    llm = spec_llm(fp32, kv_cache_memory=2 << 30, cuda_graph_max_bs=4, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=str(head))
    want = _tokens(fp32, prompts[:1])
    assert _tokens(llm, prompts[:1]) == want
    stats = llm.engine.spec_stats()
    assert stats.plain_window_steps >= 0.8 * 256, stats  # most tokens from plain decode windows
    assert stats.verify_steps < 24, stats  # a few probes, never a run of speculative steps
    assert llm.engine.stats().kv_blocks_used == 0


def test_a_draft_that_pays_keeps_speculating(fp32, prompts):
    llm = spec_llm(fp32, kv_cache_memory=2 << 30, cuda_graph_max_bs=4, speculative_algorithm="NGRAM")
    assert _tokens(llm, prompts[1:]) == _tokens(fp32, prompts[1:])
    stats = llm.engine.spec_stats()
    assert stats.mean_accept_length > 2.0, stats
    assert stats.plain_window_steps < 64, stats


def test_a_hopeless_draft_at_t1_goes_plain_and_draws_inside_the_graph(fp32, prompts, tmp_path):
    """The same at T = 1 with top-p: the plain windows' one-token verify graph draws each token itself
    (graphs/sampled_decode.py), and the seeded tokens are plain sampling's."""
    from tercel.executor import sampled_decode_key, verify_key

    head = random_eagle3(tmp_path / "e3", fp32.engine.model_config, draft_vocab_size=4096, intermediate_size=256)
    llm = spec_llm(fp32, kv_cache_memory=2 << 30, cuda_graph_max_bs=4, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=str(head))
    params = SamplingParams(max_tokens=256, temperature=1.0, top_p=0.95, seed=3, ignore_eos=True)
    want = fp32.generate(prompts[:1], params)[0].outputs[0].token_ids
    assert llm.generate(prompts[:1], params)[0].outputs[0].token_ids == want
    stats = llm.engine.spec_stats()
    assert stats.plain_window_steps >= 0.8 * 256, stats
    assert llm.engine.executor.runner(sampled_decode_key(True, False, verify_key(1))).stats.replays > 0
