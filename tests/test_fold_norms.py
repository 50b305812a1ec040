"""Norms folded into the weights (LlamaForCausalLM.fold_norms, TERCEL_FOLD_NORMS): the unfused GPU forwards take
copies of qkv and gate_up multiplied by their RMSNorm weights, and the RoPE + store and SwiGLU kernels finish each
norm with the residual row's 1/rms. kernel_checks.check_folded_norms: a verify, a batch of verifies and a prefill
with logits on its last rows give the unfolded forward's logits, K/V cache and captured hidden states, in Triton's
interpreter here and natively on a GPU (also among tests/test_gpu_graphs.py's kernel checks). Here too: biased
projections, q/k norms and a too-large copy under auto stay unfolded, and a bad switch value is named."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_utils import tiny_model  # noqa: E402
from kernel_checks import check_folded_norms, run_in_interpreter  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_folded_norms_give_the_unfolded_forwards_in_interpreter():
    run_in_interpreter("check_folded_norms")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_norms_give_the_unfolded_forwards_gpu(dtype):
    check_folded_norms("cuda", dtype)


def test_fold_norms_leaves_biased_normed_and_oversized_models_unfolded(monkeypatch):
    import tercel.kernels as kernels

    monkeypatch.setenv("TERCEL_FOLD_NORMS", "auto")
    for overrides in (dict(attention_bias=True), dict(mlp_bias=True)):
        model, _ = tiny_model(num_hidden_layers=1, **overrides)
        assert not model.fold_norms() and model.layers[0].self_attn.qkv_folded is None
    qwen3, _ = tiny_model(num_hidden_layers=1, architectures=["Qwen3ForCausalLM"], head_dim=16)
    assert qwen3.layers[0].self_attn.q_norm is not None and not qwen3.fold_norms()
    model, _ = tiny_model(num_hidden_layers=2)
    monkeypatch.setattr(kernels, "FOLD_NORMS_AUTO_BYTES", 1000)  # the copies take 2 x 2 x 32 KiB here
    assert not model.fold_norms()
    monkeypatch.setenv("TERCEL_FOLD_NORMS", "1")
    assert model.fold_norms() and model.layers[1].self_attn.qkv_folded is not None
    first = model.layers[0].mlp.gate_up_folded
    assert model.fold_norms() and model.layers[0].mlp.gate_up_folded is first  # folds once
    monkeypatch.setenv("TERCEL_FOLD_NORMS", "yes")
    with pytest.raises(ValueError, match="TERCEL_FOLD_NORMS='yes'.*auto, 0, 1"):
        model.fold_norms()
