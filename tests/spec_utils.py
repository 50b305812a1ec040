"""Helpers for speculative decoding tests: engines sharing a loaded target, and an oracle drafter."""
from __future__ import annotations

import os

import pytest

from tercel import LLM
from tercel.engine import LLMEngine
from tercel.request import Request
from tercel.speculative.drafter import Drafter
from tercel.speculative.tree import DraftTree

# The full greedy-lossless matrices (every config x batch 1 and 8 x all 20 SmolLM2 prompts x 64 tokens) take
# tens of CPU minutes, so CI runs spread subsets; TERCEL_FULL_LOSSLESS=1 runs them
# (log: benchmarks/results/lossless_full_matrix_cpu.log).
full_lossless = pytest.mark.skipif(os.environ.get("TERCEL_FULL_LOSSLESS") != "1",
                                   reason="the full lossless matrix runs with TERCEL_FULL_LOSSLESS=1")


def spec_llm(base: LLM, **kw) -> LLM:
    """A second LLM on the same loaded weights (no reload), with its own engine settings."""
    llm = LLM.__new__(LLM)
    e = base.engine
    kw.setdefault("max_model_len", e.config.max_model_len)
    llm.engine = LLMEngine(loaded=e.loaded, dtype=e.dtype, device=e.device, **kw)
    return llm


class OracleTreeDrafter(Drafter):
    """Knows the plain greedy continuation of each prompt and hides it in a tree: at every depth the
    right token is the LAST of `width` siblings (the others are wrong), so accepted paths go through
    non-first children and verify must compact their KV. `depth` levels (num_draft_tokens - 1 =
    depth * width nodes)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], depth: int, width: int, vocab: int) -> None:
        self.cont, self.depth, self.width, self.vocab = continuations, depth, width, vocab

    def propose(self, reqs: list[Request]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            truth = self.cont[tuple(r.prompt_token_ids)][len(r.output_token_ids):]
            tokens, parents = [r.output_token_ids[-1]], [-1]
            parent = 0
            for d in range(min(self.depth, len(truth))):
                for w in range(self.width):
                    wrong = (truth[d] + 1 + w) % self.vocab
                    tokens.append(truth[d] if w == self.width - 1 else wrong)
                    parents.append(parent)
                parent = len(tokens) - 1
            trees.append(DraftTree(tokens, parents))
        return trees


def write_random_eagle(out, target_cfg, *, layers: int = 1, intermediate: int = 64, std: float = 0.2, seed: int = 0):
    """A random EAGLE (v1/v2, SGLang's LlamaForCausalLMEagle) draft for a target config."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h, heads, kv, d = target_cfg.hidden_size, target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim
    cfg = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "vocab_size": target_cfg.vocab_size,
           "hidden_size": h, "intermediate_size": intermediate, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "rope_theta": target_cfg.rope_theta}
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    sd = {"fc.weight": w(h, 2 * h), "fc.bias": w(h)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                   p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                   p + "mlp.gate_proj.weight": w(intermediate, h), p + "mlp.up_proj.weight": w(intermediate, h),
                   p + "mlp.down_proj.weight": w(h, intermediate),
                   p + "post_attention_layernorm.weight": torch.ones(h)})
        if i > 0:
            sd[p + "input_layernorm.weight"] = torch.ones(h)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


def tiny_llama_target(root, *, vocab: int, layers: int, max_positions: int, init_range: float):
    """A seeded random HF Llama with a tiny vocabulary, saved to root / "target" (for the chi-square
    tests, where the exact target distribution is enumerable). Returns (HF model, path)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_positions, initializer_range=init_range)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(root / "target")
    return hf, root / "target"
