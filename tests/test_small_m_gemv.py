"""Small-M fused forwards (tercel.kernels.gemm_small; models/llama.py routes 2..32 rows there) compute what
the unfused kernels compute: every fusion per row, for several row counts and shapes, with and without
tl.dot and split-K; a verify / prefill forward of a model equals the unfused one (fp32 within 1e-4, same
KV cache, same greedy tokens); on the GPU a SmolLM2-shaped model gives the same greedy verify tokens fused
and unfused, and graph replay equals eager. CPU: the checks run under TRITON_INTERPRET=1 in a subprocess
(the interpreter patches must not leak into this process); run this file directly to do the same."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_utils import FakeRequests, kv_pool, tiny_model  # noqa: E402
from kernel_checks import check_gemm_small  # noqa: E402

ROOT = Path(__file__).parent.parent


def fuse_all_rows(model) -> None:
    """Every role on its fused kernel for every row count (the tuner's choice, forced): tl.dot with split-K
    on some roles, norm_after on the head, the broadcast product on the rest."""
    from tercel.kernels.gemm_small import ROW_BUCKETS
    from tercel.kernels.gemv import GemvConfig

    plain = GemvConfig(block_n=8, block_k=32)
    dot = GemvConfig(block_n=16, block_k=32, dot=True)
    dot_split = GemvConfig(block_n=16, block_k=16, split_k=2, dot=True)
    after = GemvConfig(block_n=8, block_k=32, norm_after=True)
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_fused, a.o_fused, m.gate_up_fused, m.down_fused = plain, plain, plain, plain
        a.qkv_fused_rows = dict.fromkeys(ROW_BUCKETS, plain)
        a.o_fused_rows = dict.fromkeys(ROW_BUCKETS, dot_split)  # the residual add in the split-sum kernel
        m.gate_up_fused_rows = dict.fromkeys(ROW_BUCKETS, dot)  # the RMSNorm prologue before the dot
        m.down_fused_rows = dict.fromkeys(ROW_BUCKETS, GemvConfig(block_n=8, block_k=32, split_k=2))
    model.lm_head_fused = after
    model.lm_head_fused_rows = dict.fromkeys(ROW_BUCKETS, after)


def _tree(t: int, device: str) -> torch.Tensor:
    """Node j's parent is (j - 1) // 2."""
    m = torch.zeros(t, t, dtype=torch.bool)
    for j in range(t):
        k = j
        while True:
            m[j, k] = True
            if k == 0:
                break
            k = (k - 1) // 2
    return m.to(device)


def _forward(model, kv, batch, fused: bool) -> torch.Tensor:
    os.environ["TERCEL_FUSED_DECODE"] = "1" if fused else "0"
    try:
        return model(batch, kv).logits.clone()
    finally:
        os.environ.pop("TERCEL_FUSED_DECODE", None)


@torch.inference_mode()
def compare_small_m_fused_unfused(device: str, dtype: torch.dtype = torch.float32) -> None:
    """Verify of 4 tokens (a tree mask on the GPU) for one request and of 3 tokens for two (6 rows), and a
    prefill of two 5-token chunks with logits for the last rows only: fused small-M forwards equal the
    unfused ones."""
    from tercel.attention.triton_backend import TritonAttentionBackend

    model, cfg = tiny_model(device, dtype, num_hidden_layers=2)
    if not isinstance(model.attn_backend, TritonAttentionBackend):  # CPU under the interpreter
        model.attn_backend = TritonAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, None, num_sms=8)
    fuse_all_rows(model)
    saved = os.environ.pop("TERCEL_SMALL_M", None)
    try:  # tuned tables without the switch (an engine built with TERCEL_SMALL_M=0): only batch 1 fuses
        assert not model._fused_rows(torch.zeros(4, cfg.hidden_size, device=device, dtype=dtype))
        assert model._fused_rows(torch.zeros(1, cfg.hidden_size, device=device, dtype=dtype))
        os.environ["TERCEL_SMALL_M"] = "1"
        _compare_small_m(model, cfg, device, dtype)
        # rowgrid: no tuning pass; every role's batch-1 choice once per row, the head on its unfused ops
        from tercel.models.gemv_tuning import rowgrid_rows

        os.environ["TERCEL_SMALL_M"] = "rowgrid"
        rowgrid_rows(model)
        layer = model.layers[0]
        assert layer.self_attn.fused_configs(6)[1] == dataclasses.replace(layer.self_attn.o_fused, rowgrid=True)
        assert layer.mlp.fused_configs(16)[0].rowgrid
        assert not model.lm_head_fused_rows.get(8, model.lm_head_fused).rowgrid  # the head keeps its choice
        _compare_small_m(model, cfg, device, dtype)
    finally:
        os.environ.pop("TERCEL_SMALL_M", None)
        if saved is not None:
            os.environ["TERCEL_SMALL_M"] = saved


def _compare_small_m(model, cfg, device: str, dtype: torch.dtype) -> None:
    kv_f, kv_u = kv_pool(cfg, device, dtype, 100, 16), kv_pool(cfg, device, dtype, 100, 16)
    reqs = FakeRequests(3, kv_f, cfg.vocab_size)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    prefill = reqs.batch([0, 2], 5)
    prefill = dataclasses.replace(prefill, logits_indices=torch.tensor([4, 9], device=device))
    # the tree mask only natively: the interpreter of some Triton versions cannot load the bool mask
    tree = [_tree(4, device)] if device == "cuda" else None
    for batch in (reqs.batch([1], 4, tree), reqs.batch([0, 2], 3), prefill):
        m = batch.input_ids.shape[0]
        assert model._fused_rows(torch.zeros(m, cfg.hidden_size, device=device, dtype=dtype))
        got, want = _forward(model, kv_f, batch, True), _forward(model, kv_u, batch, False)
        assert got.shape == want.shape == (batch.logits_indices.shape[0], cfg.vocab_size)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(kv_f.k, kv_u.k, atol=tol, rtol=tol)
    torch.testing.assert_close(kv_f.v, kv_u.v, atol=tol, rtol=tol)
    assert not model._fused_rows(torch.zeros(33, cfg.hidden_size, device=device, dtype=dtype))  # past 32 rows


def _interpreter_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _interpreter_available(), reason="needs triton (its CPU interpreter)")
def test_small_m_kernels_and_model_equal_unfused_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TERCEL_FUSED_DECODE", None)
    out = subprocess.run([sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "small-M fused equals unfused" in out.stdout


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_kernels_gpu(dtype):
    check_gemm_small("cuda", dtype)
    compare_small_m_fused_unfused("cuda", dtype)


SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0)


def _smol_model(dtype: torch.dtype):
    """A SmolLM2-shaped model, random weights (std 0.02, norms 1)."""
    model, cfg = tiny_model("cuda", dtype, **SMOL)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else 0.02 * torch.randn(p.shape, generator=g))
    return model, cfg


def _verify_steps(model, kv, reqs, t: int, steps: int, fused: bool, run=None,
                  tokens: list[int] | None = None) -> list[torch.Tensor]:
    """Greedy chains: each step verifies t tokens of request 0 (causal) and appends the first argmax, or
    tokens[i] where given (so runs compared against each other see the same contexts: at a near-tie of a random
    model's logits a bf16 argmax may flip, and the runs would then compare logits of different texts)."""
    os.environ["TERCEL_FUSED_DECODE"] = "1" if fused else "0"
    try:
        out = []
        for i in range(steps):
            logits = (run(reqs.batch([0], t)) if run is not None else model(reqs.batch([0], t), kv)).logits.clone()
            reqs.advance([0], [tokens[i]] if tokens is not None else logits[:1].argmax(-1).tolist())
            out.append(logits)
        return out
    finally:
        os.environ.pop("TERCEL_FUSED_DECODE", None)


def _runs(model, cfg, t: int, graph: bool) -> tuple[list, list, list | None]:
    """(unfused eager, fused eager, fused graph replay) logits of 3 verify steps of t tokens each."""
    from tercel.graphs import CudaGraphRunner, GraphConfig
    from tercel.graphs.steps import ModelStep

    dtype = model.embed_tokens.weight.dtype
    kvs = [kv_pool(cfg, "cuda", dtype, 200, 16) for _ in range(3)]
    reqs = [FakeRequests(1, kv, cfg.vocab_size, min_len=100, max_len=101) for kv in kvs]
    want = _verify_steps(model, kvs[0], reqs[0], t, 3, fused=False)
    forced = [int(w[0].argmax()) for w in want]
    eager = _verify_steps(model, kvs[1], reqs[1], t, 3, fused=True, tokens=forced)
    if not graph:
        return want, eager, None
    os.environ["TERCEL_FUSED_DECODE"] = "1"  # captured with the fused kernels
    try:
        runner = CudaGraphRunner(ModelStep(model, kvs[2], 16, tokens_per_request=t),
                                 GraphConfig(batch_sizes=(1,), backend="full"), "cuda")
        runner.capture_all()
    finally:
        os.environ.pop("TERCEL_FUSED_DECODE", None)
    graphed = _verify_steps(model, kvs[2], reqs[2], t, 3, fused=True, run=runner.run, tokens=forced)
    assert runner.stats.eager == 0
    return want, eager, graphed


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_smol_verify_fp32_fused_greedy_equals_unfused(monkeypatch):
    """fp32, every role forced onto the small-M kernels: the same greedy tokens as the unfused path."""
    monkeypatch.setenv("TERCEL_SMALL_M", "1")  # forwards read it too (models.llama._fused_rows)
    model, cfg = _smol_model(torch.float32)
    fuse_all_rows(model)
    for t in (2, 8, 16):
        want, eager, _ = _runs(model, cfg, t, graph=False)
        for g, w in zip(eager, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1)), t


def _graph_equals_eager_near_unfused(model, cfg) -> None:
    """Verify steps of 2, 8 and 16 tokens: graph replay == eager bit for bit, and within bf16 of the unfused path:
    the logits' norm, and the same greedy token on every row whose unfused lead over its runner-up is clear of the
    rounding drift (8x the row's rms difference). A random model's logits are near-flat, so near-ties are common
    and a bf16 argmax may flip there (4 of 24 rows at t = 8 on an H100); a wrong product would flip clear ones."""
    clear = 0
    for t in (2, 8, 16):
        want, eager, graphed = _runs(model, cfg, t, graph=True)
        for g, e, w in zip(graphed, eager, want):
            assert torch.equal(g, e), t
            # 30 layers that round at different points (a fused norm stays fp32, the unfused one rounds to bf16)
            # drift by ~3% of the logits' norm; the fp32 test above holds the kernels to 1e-4
            assert float((e - w).norm() / w.norm()) < 4e-2, t
            top2 = w.float().topk(2, dim=-1).values
            lead = top2[:, 0] - top2[:, 1]
            drift = (e.float() - w.float()).pow(2).mean(-1).sqrt()
            rows = lead > 8 * drift
            clear += int(rows.sum())
            assert torch.equal(e.argmax(-1)[rows], w.argmax(-1)[rows]), (t, rows.nonzero().flatten().tolist())
    assert clear > 0, "no verify row had a clear greedy token, so the check saw nothing"


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_smol_verify_bf16_tuned_graph_equals_eager(monkeypatch):
    """bf16 as the engine runs it (tune_model's choices): graph replay == eager bit for bit, and the
    fused verify agrees with the unfused one within bf16 (logits and nearly every greedy token)."""
    from tercel.models.gemv_tuning import tune_model

    monkeypatch.setenv("TERCEL_SMALL_M", "1")  # opt-in (kernels.small_m_enabled)
    model, cfg = _smol_model(torch.bfloat16)
    choices = tune_model(model)
    assert {c.rows for c in choices} == {1, 2, 4, 8, 16, 32}
    layer = model.layers[0]
    assert any(layer.self_attn.fused_configs(8) + layer.mlp.fused_configs(8)), "the tuner kept no small-M role"
    _graph_equals_eager_near_unfused(model, cfg)



@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_smol_verify_bf16_rowgrid_graph_equals_eager(monkeypatch):
    """TERCEL_SMALL_M=rowgrid (each role's batch-1 GEMV once per row, no small-M tuning pass): every bucket but
    the head's is filled, graph replay == eager bit for bit, and the verify agrees with the unfused one within
    bf16."""
    from tercel.models.gemv_tuning import tune_model

    monkeypatch.setenv("TERCEL_SMALL_M", "rowgrid")
    model, cfg = _smol_model(torch.bfloat16)
    choices = tune_model(model)
    assert {c.rows for c in choices} == {1}, "rowgrid measures nothing past batch 1"
    layer = model.layers[0]
    assert all(c is not None and c.rowgrid for c in layer.self_attn.fused_configs(8) + layer.mlp.fused_configs(8))
    assert not model.lm_head_fused_rows
    _graph_equals_eager_near_unfused(model, cfg)

if __name__ == "__main__":
    import kernel_checks  # noqa: F401  (under TRITON_INTERPRET=1: patches the interpreter for NumPy 2)

    check_gemm_small("cpu", torch.float32)
    print("ok check_gemm_small float32", flush=True)
    check_gemm_small("cpu", torch.bfloat16)
    print("ok check_gemm_small bfloat16", flush=True)
    compare_small_m_fused_unfused("cpu")
    print("small-M fused equals unfused")
