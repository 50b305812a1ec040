"""Our Llama-family model equals HF transformers (fp32, CPU) on random-weight checkpoints of every
supported architecture: last-token logits within 1e-4 and identical greedy 32-token outputs."""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import hf_greedy

from tercel import LLM, SamplingParams

transformers.logging.set_verbosity_error()

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=512, initializer_range=0.2)


def _config(arch: str, tied: bool, gqa: int):
    kv = BASE["num_attention_heads"] // gqa
    common = dict(BASE, num_key_value_heads=kv, tie_word_embeddings=tied)
    if arch == "mistral-sliding":  # window shorter than the prompts, so it matters
        return transformers.MistralConfig(**common, sliding_window=8)
    if arch == "llama3":
        return transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
    if arch == "llama-bias":  # HF LlamaConfig's attention_bias (q/k/v/o) and mlp_bias (gate/up/down)
        return transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)  # head_dim override: 8 * 32 != 128
    raise ValueError(arch)


CASES = [(a, t, g) for a in ("llama3", "mistral", "qwen2", "qwen3") for t in (True, False) for g in (1, 4)]
CASES.append(("mistral-sliding", False, 4))
CASES += [("llama-bias", False, 4), ("llama-bias", True, 1)]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (5, 17, 33)]


@pytest.mark.parametrize("arch,tied,gqa", CASES, ids=[f"{a}-{'tied' if t else 'untied'}-gqa{g}" for a, t, g in CASES])
def test_logits_and_greedy_match_hf(tmp_path, prompts, arch, tied, gqa):
    torch.manual_seed(0)
    cfg = _config(arch, tied, gqa)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch in ("qwen2", "llama-bias"):  # biases start at zero; make them count
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
              max_model_len=256)

    # last-token logits of a prefill, through the engine's own forward path
    from tercel.forward_batch import ForwardBatch

    eng = llm.engine
    for ids in prompts:
        blocks = eng.kv.allocator.allocate(-(-len(ids) // eng.kv.block_size))
        pos = torch.arange(len(ids))
        table = torch.tensor([blocks])
        batch = ForwardBatch(torch.tensor(ids), pos, table[0][pos // 16] * 16 + pos % 16, torch.tensor([len(ids)]),
                             table, torch.tensor([len(ids) - 1]), [len(ids)], [len(ids)])
        with torch.inference_mode():
            ours = eng.model(batch, eng.kv).logits[0]
            ref = hf(torch.tensor([ids])).logits[0, -1]
        eng.kv.allocator.free(blocks)
        assert (ours - ref).abs().max().item() <= 1e-4

    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref = hf_greedy(hf, ids, 32)
        assert out.outputs[0].token_ids == ref
