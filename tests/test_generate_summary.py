"""`tercel generate`'s summary line names what each speculative step verified: for DFLASH the draft
checkpoint's block size (known only once the draft loads), for DDTREE the tree's nodes."""
from __future__ import annotations

import pytest
from dflash_utils import write_random_dflash
from spec_utils import tiny_llama_target

from tercel import LLM, SamplingParams
from tercel.cli import spec_summary

VOCAB = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    _, target = tiny_llama_target(root, vocab=VOCAB, layers=2, max_positions=128, init_range=0.15)
    draft = write_random_dflash(root / "draft", vocab=VOCAB, hidden=32, num_target_layers=2, block_size=4,
                                mask_token_id=VOCAB - 1, target_layer_ids=[0, 1], std=0.3)
    return target, draft


@pytest.mark.parametrize("algo,budget,want", [("DFLASH", None, "DFLASH (block of 4, 4 tokens/verify)"),
                                              ("DDTREE", 6, "DDTREE (tree of 6 draft nodes, 7 tokens/verify)")])
def test_summary_names_the_tokens_each_verify_step_takes(tiny, algo, budget, want):
    target, draft = tiny
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64,
              speculative_algorithm=algo, speculative_draft_model_path=str(draft), speculative_ddtree_budget=budget,
              speculative_adaptive="off")
    out = llm.generate([[3, 7, 1, 12]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    line = spec_summary(llm.engine, out.metrics.mean_accept_length)
    assert line.startswith(f" | {want}: mean accept length "), line
    assert " 0 tokens/verify" not in line


def test_plain_decoding_has_no_speculative_summary(tiny):
    target, _ = tiny
    llm = LLM(str(target), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)
    assert spec_summary(llm.engine, None) == ""
