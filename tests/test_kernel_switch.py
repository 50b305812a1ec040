"""The Triton switch (tercel.kernels.use_triton) must never run a kernel that has no backward while
autograd records: draft training on the GPU would silently lose the gradient through every norm."""
from __future__ import annotations

import pytest
import torch

import tercel.kernels as kernels


@pytest.fixture
def kernels_on(monkeypatch):
    # pretend a kernel could run here (CPU tensors count under the interpreter switch)
    monkeypatch.setattr(kernels, "triton_enabled", lambda: True)
    monkeypatch.setattr(kernels, "_INTERPRET", True)


def test_kernels_used_for_inference(kernels_on):
    x, w = torch.randn(2, 8), torch.ones(8)
    assert kernels.use_triton(x, w)
    with torch.no_grad():
        assert kernels.use_triton(x, torch.ones(8, requires_grad=True))


def test_kernels_skipped_when_grad_is_recorded(kernels_on):
    x = torch.randn(2, 8)
    assert not kernels.use_triton(x.requires_grad_(), torch.ones(8))
    assert not kernels.use_triton(torch.randn(2, 8), torch.ones(8, requires_grad=True))  # a trained norm weight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eagle3_draft_gets_gradients_on_cuda():
    from tercel.config import ModelConfig
    from tercel.models.llama import MLP, RMSNorm

    norm = RMSNorm(64, 1e-6).cuda()
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 32, "max_position_embeddings": 64}, "test")
    mlp = MLP(cfg).cuda()
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    mlp(norm(x)).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and mlp.gate_up_proj.weight.grad is not None
    assert norm.weight.grad.abs().sum() > 0


def test_pdl_mode_reads_the_switch(monkeypatch):
    monkeypatch.setenv("TERCEL_PDL", "late")
    monkeypatch.setattr(kernels, "_has_pdl", lambda index: True)
    assert kernels.pdl_mode(torch.randn(2, 8)) == 0  # never on CPU tensors

    class FakeCuda:  # is_cuda without a GPU: only the switch is read
        is_cuda = True
        device = torch.device("cuda", 0)

    for value, mode, small, norm in (("0", 0, False, False), ("1", 1, False, False), ("early", 1, False, False),
                                     ("late", 2, False, False), ("late_norm", 3, False, True),
                                     ("late_all", 4, True, True)):
        monkeypatch.setenv("TERCEL_PDL", value)
        assert kernels.pdl_mode(FakeCuda()) == mode
        # the small kernels (attention split / merge, RoPE + store, SwiGLU) with late_all, the norm from late_norm
        assert kernels.pdl_small(FakeCuda()) == small and kernels.pdl_small(FakeCuda(), norm=True) == norm
    monkeypatch.delenv("TERCEL_PDL")
    assert kernels.pdl_mode(FakeCuda()) == 2  # the default
    monkeypatch.setattr(kernels, "_has_pdl", lambda index: False)  # before Hopper
    assert kernels.pdl_mode(FakeCuda()) == 0
    monkeypatch.setenv("TERCEL_PDL", "sometimes")

    with pytest.raises(ValueError, match="TERCEL_PDL='sometimes'.*early, late, late_norm, late_all"):
        kernels.pdl_mode(FakeCuda())


def test_verify_attention_mode_reads_the_switch(monkeypatch):
    monkeypatch.delenv("TERCEL_VERIFY_ATTN", raising=False)
    assert kernels.verify_attention_mode() == "split"  # the default until a GPU run measures the one launch
    monkeypatch.setenv("TERCEL_VERIFY_ATTN", "rope")
    assert kernels.verify_attention_mode() == "rope"
    monkeypatch.setenv("TERCEL_VERIFY_ATTN", "one")
    with pytest.raises(ValueError, match="TERCEL_VERIFY_ATTN='one': use one of split, rope"):
        kernels.verify_attention_mode()


def test_small_m_mode_reads_the_switch(monkeypatch):
    monkeypatch.delenv("TERCEL_SMALL_M", raising=False)
    assert kernels.small_m_mode() == "0" and not kernels.small_m_enabled()
    for mode in ("1", "rowgrid"):
        monkeypatch.setenv("TERCEL_SMALL_M", mode)
        assert kernels.small_m_mode() == mode and kernels.small_m_enabled()
    monkeypatch.setenv("TERCEL_SMALL_M", "on")
    with pytest.raises(ValueError, match="TERCEL_SMALL_M='on': use one of 0, 1, rowgrid"):
        kernels.small_m_enabled()


def test_small_m_buckets_reads_the_switch(monkeypatch):
    monkeypatch.delenv("TERCEL_SMALL_M_BUCKETS", raising=False)
    assert kernels.small_m_buckets() == (2, 4, 8, 16, 32)
    monkeypatch.setenv("TERCEL_SMALL_M_BUCKETS", "16, 8")
    assert kernels.small_m_buckets() == (8, 16)
    for bad in ("6", "eight", ","):
        monkeypatch.setenv("TERCEL_SMALL_M_BUCKETS", bad)
        with pytest.raises(ValueError, match="TERCEL_SMALL_M_BUCKETS=.*among 2, 4, 8, 16, 32"):
            kernels.small_m_buckets()
