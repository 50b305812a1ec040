"""The real model: SmolLM2-135M-Instruct from its Q4_1 GGUF, token-identical to HF transformers
loading the same GGUF (fp32, CPU, greedy, 64 new tokens, chat prompts)."""
from __future__ import annotations

from conftest import hf_greedy

from tercel import SamplingParams


def test_greedy_chat_matches_hf(smol_llm, smol_hf, smol_chat_ids):
    prompts = smol_chat_ids[:5]
    outs = smol_llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref = hf_greedy(smol_hf, ids, 64)
        assert out.outputs[0].token_ids == ref, out.outputs[0].text


def test_chat_api_uses_the_template(smol_llm, smol_chat_ids):
    out = smol_llm.chat([{"role": "user", "content": "Tell me about the ocean."}],
                        SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt_token_ids == smol_chat_ids[0]
    assert out.outputs[0].text.startswith("The ocean")


def test_eos_stops_generation(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is 2+2? Answer with just the number."}],
                        SamplingParams(max_tokens=64, temperature=0))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and len(c.token_ids) < 64
    assert c.token_ids[-1] in smol_llm.engine.eos_token_ids
    assert "<|im_end|>" not in c.text
