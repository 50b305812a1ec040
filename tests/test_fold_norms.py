"""Norms folded into the weights (LlamaForCausalLM.fold_norms, TERCEL_FOLD_NORMS): the unfused GPU forwards take
copies of qkv and gate_up multiplied by their RMSNorm weights, and the RoPE + store and SwiGLU kernels finish each
norm with the residual row's 1/rms. A verify, a batch of verifies and a prefill with logits on its last rows give
the unfolded forward's logits, K/V cache and captured hidden states (fp32 within 1e-4 and the same greedy tokens,
bf16 within 3% of each tensor's norm);
biased projections, q/k norms and a too-large copy under auto stay unfolded; a bad switch value is named. CPU: the
forwards run under TRITON_INTERPRET=1 in a subprocess (run this file directly to do the same); GPU: natively."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_checks  # noqa: E402,F401  (under TRITON_INTERPRET=1: the interpreter's numpy-2 patch)
from graph_utils import FakeRequests, kv_pool, tiny_model  # noqa: E402

ROOT = Path(__file__).parent.parent


def _with_fold(mode: str, fn):
    saved = os.environ.get("TERCEL_FOLD_NORMS")
    os.environ["TERCEL_FOLD_NORMS"] = mode
    try:
        return fn()
    finally:
        os.environ.pop("TERCEL_FOLD_NORMS", None)
        if saved is not None:
            os.environ["TERCEL_FOLD_NORMS"] = saved


@torch.inference_mode()
def compare_folded_unfolded(device: str, dtype: torch.dtype = torch.float32) -> None:
    from tercel.attention.triton_backend import TritonAttentionBackend
    from tercel.forward_batch import CaptureHiddenMode

    model, cfg = tiny_model(device, dtype, num_hidden_layers=3)
    if not isinstance(model.attn_backend, TritonAttentionBackend):  # CPU under the interpreter
        model.attn_backend = TritonAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, None, num_sms=8)
    model.set_aux_layers((0, 2))
    assert _with_fold("1", model.fold_norms) and model.layers[1].mlp.gate_up_folded is not None
    norm = model.layers[1].post_attention_layernorm.weight
    torch.testing.assert_close(model.layers[1].mlp.gate_up_folded.float(),
                               model.layers[1].mlp.gate_up_proj.weight.float() * norm.float(), atol=1e-6, rtol=1e-2)
    kv_f, kv_u = kv_pool(cfg, device, dtype, 100, 16), kv_pool(cfg, device, dtype, 100, 16)
    reqs = FakeRequests(3, kv_f, cfg.vocab_size)
    fp32 = dtype == torch.float32
    tol = 1e-4 if fp32 else 3e-2

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        """fp32: element by element; bf16: relative to the whole tensor (the folded weight and the 1/rms after the
        GEMM round elsewhere than the norm, so a small element can move by a bf16 step of a larger one)."""
        if fp32:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        else:
            rel = float((got.double() - want.double()).norm() / want.double().norm())
            assert rel < tol, rel
    prefill = dataclasses.replace(reqs.batch([0, 2], 5), logits_indices=torch.tensor([4, 9], device=device))
    for batch in (reqs.batch([1], 4), reqs.batch([0, 2], 3), prefill):
        batch = dataclasses.replace(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        meta = model.attn_backend.prepare(batch, kv_f.block_size)
        h = torch.zeros(batch.input_ids.shape[0], cfg.hidden_size, device=device, dtype=dtype)
        assert _with_fold("1", lambda: model._folds(h, meta)), "the folded layers did not take this batch"
        assert not _with_fold("0", lambda: model._folds(h, meta))
        got = _with_fold("1", lambda: model(batch, kv_f))
        want = _with_fold("0", lambda: model(batch, kv_u))
        assert got.logits.shape == want.logits.shape == (batch.logits_indices.shape[0], cfg.vocab_size)
        close(got.logits, want.logits)
        if fp32:  # bf16 may part at a near-tie of a random model's logits
            assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        close(got.hidden_states, want.hidden_states)
    close(kv_f.k, kv_u.k)
    close(kv_f.v, kv_u.v)


def _interpreter_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _interpreter_available(), reason="needs triton (its CPU interpreter)")
def test_folded_norms_give_the_unfolded_forwards_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    for k in ("TERCEL_FUSED_DECODE", "TERCEL_FOLD_NORMS", "TERCEL_VERIFY_ATTN"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "folded equals unfolded" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_norms_give_the_unfolded_forwards_gpu(dtype):
    compare_folded_unfolded("cuda", dtype)


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


if __name__ == "__main__":
    compare_folded_unfolded("cpu", torch.float32)
    print("folded equals unfolded")
