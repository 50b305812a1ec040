"""The Q4 x Q8 CPU kernel (tercel.models.cpu_q8): GGUF 4-bit weights against int8-quantised activations.

Specification: the kernel equals a float64 reference of the same 4-bit weights and the same Q8-quantised
activations up to fp32 accumulation order (tight), and the dense product of the dequantised weights up to
the activations' quantisation (loose); any K in whole blocks, any N (not only the kernel's 8-row groups),
Q4_0 and Q4_1, 1 to 11 rows (past the kernel's 4-row passes); a row's result does not depend on the other
rows in the call; bf16 output is the fp32 output rounded. It survives the load cache, fp32 never takes it,
TERCEL_CPU_Q8=0 keeps torch's int4 kernel, and a CPU or machine that cannot build it falls back with one log
line naming the fix.
"""
from __future__ import annotations

import logging

import pytest
import torch
import transformers
from conftest import last_logits
from gguf_utils import tiny_q4_gguf

from tercel import LLM
from tercel.models import cpu_q8
from tercel.models.cpu_linear import Q4_GROUP, PackedInt4, Q4Blocks, cpu_packing_available
from tercel.models.cpu_pack import pack_linear
from tercel.models.cpu_q8 import PackedQ4Q8, Q8Build, Q8KernelUnavailable

pytestmark = [
    pytest.mark.skipif(not cpu_packing_available(), reason="this torch build lacks the int4 CPU matmul"),
    pytest.mark.skipif(cpu_q8.kernel_error() is not None, reason=f"no Q4 x Q8 kernel: {cpu_q8.kernel_error()}"),
]
transformers.logging.set_verbosity_error()


def blocks(n: int, k: int, qtype: str, seed: int = 0) -> Q4Blocks:
    """Random 4-bit blocks with fp16 scales and mins, as GGUF stores them (Q4_0: min = -8 scale)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // Q4_GROUP, generator=g) * 0.02 + 1e-3).half().float()
    m = -8 * d if qtype == "Q4_0" else ((torch.rand(n, k // Q4_GROUP, generator=g) - 0.5) * 0.1).half().float()
    return Q4Blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, m)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8 of x [M, K] per block of 32: (int8 values as float, fp32 scale per block)."""
    xb = x.float().view(x.shape[0], -1, Q4_GROUP)
    amax = xb.abs().amax(-1).double()
    # correctly rounded fp32 quotients (through float64) as the kernel's; torch's own fp32 division of a
    # tensor may differ by an ulp, which flips the many exact ties (x = amax / 2 -> 63.5) of bf16 inputs
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax)).float()
    return torch.round(xb * inv[..., None]), (amax / 127.0).float()  # ties to even, like the kernel


def reference(b: Q4Blocks, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum of |terms| per output) in float64: sum_b d_w d_x (q_w . q_x) + m_w d_x sum(q_x)."""
    qx, dx = quantize_q8(x)
    n, k = b.q.shape
    qw = b.q.double().view(n, -1, Q4_GROUP)
    dots = torch.einsum("nbk,mbk->mnb", qw, qx.double())
    terms_d = dots * (b.scale.double()[None] * dx.double()[:, None])
    terms_m = b.min.double()[None] * (dx.double() * qx.double().sum(-1))[:, None]
    return (terms_d + terms_m).sum(-1), (terms_d.abs() + terms_m.abs()).sum(-1)


def bf16_values(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """fp32 activations that are exactly bf16 values (what the bf16 model feeds the kernel)."""
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


SHAPES = [(8, 32), (100, 96), (13, 64), (576, 1536)]  # [N, K]: N off the 8-row groups, K = 1 block


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 11])
def test_matches_the_float_reference_of_the_same_q4_and_q8_values(qtype, n, k, rows):
    b = blocks(n, k, qtype)
    x = bf16_values(rows, k)
    want, scale = reference(b, x)
    got = PackedQ4Q8(b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # fp32 products and sums in another order than the float64 reference: relative 1e-5 of the terms' size
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-7).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_close_to_the_dense_product_of_the_dequantized_weights(qtype):
    b = blocks(960, 576, qtype, seed=3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    dense = x.float() @ b.dequantize().t()
    got = PackedQ4Q8(b)(x).float()
    # int8 activations: about 0.5 % of |x| per element, a relative error of that order on the product
    err = (got - dense).norm() / dense.norm()
    assert 1e-4 < err < 0.03, err  # not exact (it quantises) and not far off
    torch_int4 = PackedInt4(b)(x).float()
    assert (got - dense).norm() < 4 * (torch_int4 - dense).norm() + 0.02 * dense.norm()


def test_a_row_does_not_depend_on_the_other_rows_and_bf16_is_fp32_rounded():
    b = blocks(200, 128, "Q4_1", seed=5)
    lin = PackedQ4Q8(b)
    x = bf16_values(9, 128)
    many = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i:i + 1])[0], many[i])
    assert torch.equal(lin(x.bfloat16()), many.bfloat16())
    assert torch.equal(lin(x.bfloat16().view(3, 3, 128)), many.bfloat16().view(3, 3, 200))  # leading dims kept


def test_zero_activations_give_zero():
    lin = PackedQ4Q8(blocks(16, 64, "Q4_1"))
    assert torch.equal(lin(torch.zeros(2, 64)), torch.zeros(2, 16))


def test_saved_tensors_restore_the_same_linear():
    b = blocks(100, 96, "Q4_1")
    lin = PackedQ4Q8(b)
    again = PackedQ4Q8.from_tensors({k: v.clone() for k, v in lin.tensors().items()})
    x = bf16_values(2, 96)
    assert again.out_features == 100 and again.nbytes == lin.nbytes and torch.equal(again(x), lin(x))


def test_unsupported_shapes_are_refused_with_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"K a multiple of 32; got \[16, 48\].*PackedInt4 or PackedDense"):
        PackedQ4Q8(Q4Blocks(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1)))
    lin = PackedQ4Q8(blocks(16, 64, "Q4_1"))
    with pytest.raises(RuntimeError, match="K = 32 is not a multiple|qs must hold"):
        lin(torch.zeros(1, 32))
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        lin(torch.zeros(1, 64, dtype=torch.float16))


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_q8.shutil, "which", lambda name: None)
    with pytest.raises(Q8KernelUnavailable, match="no C\\+\\+ compiler.*TERCEL_CPU_Q8=0"):
        cpu_q8._build(Q8Build(source=cpu_q8._SOURCE, root=tmp_path, cflags=cpu_q8._CFLAGS))


def test_a_cpu_without_avx2_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_q8, "cpu_flags", lambda: frozenset({"sse4_2"}))
    with pytest.raises(Q8KernelUnavailable, match="lacks \\['avx2', 'f16c', 'fma'\\]"):
        cpu_q8._build(Q8Build(source=cpu_q8._SOURCE, root=tmp_path, cflags=cpu_q8._CFLAGS))


def test_an_unavailable_kernel_falls_back_to_torchs_int4_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(cpu_q8, "kernel_error", lambda: "no compiler here (a test)")
    b = blocks(96, 64, "Q4_1")
    with caplog.at_level(logging.WARNING, logger="tercel.models.cpu_q8"):
        packed = [pack_linear(torch.zeros(96, 64), b) for _ in range(3)]
    assert all(isinstance(p, PackedInt4) for p in packed)
    lines = [r for r in caplog.records if "no compiler here (a test)" in r.getMessage()]
    assert len(lines) == 1 and "keeping torch's int4 kernel" in lines[0].getMessage()


def test_the_switch_keeps_torchs_int4_kernel(monkeypatch):
    b = blocks(96, 64, "Q4_1")
    assert isinstance(pack_linear(torch.zeros(96, 64), b), PackedQ4Q8)
    monkeypatch.setenv("TERCEL_CPU_Q8", "0")
    assert isinstance(pack_linear(torch.zeros(96, 64), b), PackedInt4)


KW = dict(device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)


def test_a_model_keeps_it_through_the_load_cache_and_fp32_never_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TERCEL_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_q4_gguf(tmp_path)
    prompt = [3, 17, 200, 45, 9]
    first = LLM(str(path), dtype="bfloat16", **KW)
    assert isinstance(first.engine.model.layers[0].mlp.down_proj.gemv, PackedQ4Q8)
    want = last_logits(first, prompt)
    monkeypatch.setattr(PackedQ4Q8, "__init__", None)  # a cached start packs nothing again
    second = LLM(str(path), dtype="bfloat16", **KW)
    assert isinstance(second.engine.model.layers[1].self_attn.qkv_proj.gemv, PackedQ4Q8)
    assert torch.equal(last_logits(second, prompt), want)
    exact = LLM(str(path), dtype="float32", **KW)
    assert not any(isinstance(getattr(m, "gemv", None), PackedQ4Q8) for m in exact.engine.model.modules())


def test_torch_compile_traces_it_through_its_shape_only_kernel():
    lin = PackedQ4Q8(blocks(100, 96, "Q4_1"))
    x = bf16_values(3, 96).bfloat16()
    # aot_eager runs the fake (shape-only) kernel while tracing, as Inductor does (--cpu-compile), in seconds
    compiled = torch.compile(lambda t: lin(t) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), lin(x) * 2)


def test_threads_split_n_without_changing_a_bit():
    lin = PackedQ4Q8(blocks(1000, 256, "Q4_0", seed=6))  # 125 row groups: several threads' worth
    x = bf16_values(5, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        assert torch.equal(lin(x), one)
    finally:
        torch.set_num_threads(before)


def test_a_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(Q8KernelUnavailable, match="source .* is missing.*TERCEL_CPU_Q8=0"):
        cpu_q8._build(Q8Build(source=tmp_path / "gone.cpp", root=tmp_path, cflags=cpu_q8._CFLAGS))


def test_a_compiler_without_openmp_still_builds_it_on_one_thread(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    calls = []

    def load(**kw):
        calls.append(kw)
        if "-fopenmp" in kw["extra_cflags"]:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level(logging.WARNING, logger="tercel.models.cpu_q8"):
        cpu_q8._build(Q8Build(source=cpu_q8._SOURCE, root=tmp_path, cflags=cpu_q8._CFLAGS))
    assert len(calls) == 2 and "-fopenmp" not in calls[1]["extra_cflags"] and calls[1]["extra_ldflags"] == []
    assert calls[0]["build_directory"] != calls[1]["build_directory"]  # its own cached build
    assert any("without OpenMP" in r.getMessage() for r in caplog.records)


def test_a_failing_build_names_the_first_error(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def load(**kw):
        raise RuntimeError("ninja: build stopped" if "-fopenmp" in kw["extra_cflags"] else "second failure")

    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.raises(Q8KernelUnavailable, match="ninja: build stopped.*TERCEL_CPU_Q8=0"):
        cpu_q8._build(Q8Build(source=cpu_q8._SOURCE, root=tmp_path, cflags=cpu_q8._CFLAGS))
