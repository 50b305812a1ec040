"""A model family is a registry line (architecture -> module and class) plus a class implementing the
declared target-model interface; the loader builds it through the registry and hands it the attention
backend, which its forwards then use."""
from __future__ import annotations

import pytest
import torch
import transformers

from tercel.attention.torch_ref import TorchAttentionBackend
from tercel.config import ModelConfig
from tercel.loader.model_loader import build_model
from tercel.models.interface import TargetModel
from tercel.models.registry import MODEL_REGISTRY, model_class

transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_every_registered_architecture_resolves_to_a_target_model(arch):
    cfg = ModelConfig.from_hf_dict(dict(architectures=[arch], vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert model_class(cfg.architecture).__name__ == MODEL_REGISTRY[arch].cls
    model = build_model(cfg, 16, torch.float32, torch.device("cpu"))
    assert isinstance(model, TargetModel)
    assert model.max_positions == 16 and model.aux_layer_ids == ()


def test_llama_biases_follow_the_hf_config():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=4)
    plain = ModelConfig.from_hf_dict(base)
    biased = ModelConfig.from_hf_dict(dict(base, attention_bias=True, mlp_bias=True))
    qwen2 = ModelConfig.from_hf_dict(dict(base, architectures=["Qwen2ForCausalLM"]))
    assert (plain.attention_bias, plain.o_proj_bias, plain.mlp_bias) == (False, False, False)
    assert (biased.attention_bias, biased.o_proj_bias, biased.mlp_bias) == (True, True, True)
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.mlp_bias) == (True, False, False)  # HF Qwen2: q/k/v only


class CountingBackend(TorchAttentionBackend):
    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.calls = 0

    def forward(self, *a, **k):
        self.calls += 1
        return super().forward(*a, **k)


def test_the_attention_backend_is_passed_in_not_patched(tmp_path):
    from tercel import LLM
    from tercel.loader import model_loader

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    backend = None

    def counting(cfg, device):
        nonlocal backend
        backend = CountingBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        return backend

    mp = pytest.MonkeyPatch()
    mp.setattr(model_loader, "attention_backend", counting)
    try:
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
                  num_kv_blocks=8)
    finally:
        mp.undo()
    assert llm.engine.model.attn_backend is backend
    from tercel import SamplingParams

    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert backend.calls == 3 * 2  # three forwards (prefill, two decodes) x two layers
