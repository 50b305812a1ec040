"""Cross-check with the z-lab reference (PyPI `dflash`, run on HF transformers): with the bundled
SmolLM2 DFlash draft, the reference's greedy tokens and its accepted length at every step equal ours.
Skips only when the reference package is not installed."""
from __future__ import annotations

import pytest
import torch

from tercel import LLM, SamplingParams
from tercel.speculative import DEFAULT_DFLASH_DRAFT

ref_model = pytest.importorskip("dflash.model", reason="the dflash reference package is not installed")

NEW_TOKENS = 32


def test_greedy_tokens_and_accept_lengths_equal_the_reference(smol_llm, smol_hf, smol_chat_ids, monkeypatch):
    import time

    from tercel.engine import LLMEngine

    monkeypatch.setattr(ref_model, "_cuda_time", time.perf_counter)  # its stats timer syncs CUDA; we are on CPU
    draft = ref_model.DFlashDraftModel.from_pretrained(str(DEFAULT_DFLASH_DRAFT), dtype=torch.float32).eval()
    ours = LLM.__new__(LLM)
    ours.engine = LLMEngine(loaded=smol_llm.engine.loaded, dtype="float32", device="cpu", max_model_len=2048,
                            max_num_seqs=1, speculative_algorithm="DFLASH",
                            speculative_draft_model_path=DEFAULT_DFLASH_DRAFT,
                            speculative_adaptive=False)  # the reference verifies a full block every step
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for ids in smol_chat_ids[:5]:
        stats = ref_model.dflash_generate(draft, smol_hf, torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                          stop_token_ids=None, temperature=0.0, return_stats=True)
        ref_tokens = stats.output_ids[0, len(ids):].tolist()
        out = ours.generate([ids], params)[0]
        assert out.outputs[0].token_ids == ref_tokens
        # the reference counts the prefill's token apart; every later step emits `accepted + 1` tokens
        assert out.metrics.spec_accept_lengths == stats.acceptance_lengths
