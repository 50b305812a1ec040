"""The Q8_0 variant of the CPU kernel (tercel.models.cpu_q8.PackedQ8): a GGUF's Q8_0 head (or tied embedding) kept
8-bit, against activations quantised to int16 per block of 32.

Specification: it equals a float64 reference of the same int8 weights against the same int16-quantised
activations up to fp32 accumulation order, for any N (not only 8-row groups), 1 to 11 rows, at the extreme values;
results are fp32 whatever x's dtype; a row does not depend on the other rows; it
survives the saved form; a GGUF model whose tied embedding is Q8_0 takes it as its head (through the load cache
too) and its logits stay close to the dense head's; bad shapes are refused naming the value.
"""
from __future__ import annotations

import pytest
import torch
from conftest import last_logits
from gguf_utils import tiny_q4_gguf
from test_cpu_q8_kernel import bf16_values

from tercel import LLM
from tercel.models import cpu_q8
from tercel.models.cpu_linear import Q4_GROUP, Q8Blocks, cpu_packing_available, pack_dense
from tercel.models.cpu_q8 import PackedQ8

pytestmark = [
    pytest.mark.skipif(not cpu_packing_available(), reason="this torch build lacks the int4 CPU matmul"),
    pytest.mark.skipif(cpu_q8.kernel_error() is not None, reason=f"no Q4 x Q8 kernel: {cpu_q8.kernel_error()}"),
]


def q8_blocks(n: int, k: int, seed: int = 0, low: int = -127, high: int = 128) -> Q8Blocks:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // Q4_GROUP, generator=g) * 0.01 + 1e-3).half().float()
    return Q8Blocks(torch.randint(low, high, (n, k), generator=g, dtype=torch.int8), d)


def quantize_q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] per block of 32 as int16 values (as float) and the fp32 scale amax / 32767 per block."""
    xb = x.float().view(x.shape[0], -1, Q4_GROUP)
    amax = xb.abs().amax(-1).double()
    inv = torch.where(amax != 0, 32767.0 / amax, torch.zeros_like(amax)).float()  # correctly rounded, as the kernel
    return torch.round(xb * inv[..., None]), (amax / 32767.0).float()


def reference(b: Q8Blocks, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qx, dx = quantize_q16(x)
    n, k = b.q.shape
    dots = torch.einsum("nbk,mbk->mnb", b.q.double().view(n, -1, Q4_GROUP), qx.double())
    terms = dots * (b.scale.double()[None] * dx.double()[:, None])
    return terms.sum(-1), terms.abs().sum(-1)


@pytest.mark.parametrize("n,k", [(8, 32), (100, 96), (13, 64), (1000, 576)])
@pytest.mark.parametrize("rows", [1, 3, 11])
def test_matches_the_float_reference_of_the_same_q8_values(n, k, rows):
    b = q8_blocks(n, k)
    x = bf16_values(rows, k)
    want, scale = reference(b, x)
    got = PackedQ8(b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-7).all()
    assert torch.equal(PackedQ8(b)(x.bfloat16()), got)  # fp32 out from bf16 in: the same values


def test_extreme_values_stay_exact():
    """Weights -128 / 127 against activations at +-32767 after quantisation: the int32 sums hold them."""
    b = q8_blocks(16, 64, low=-128, high=-127)  # every weight -128
    b = Q8Blocks(torch.where(torch.arange(64) % 2 == 0, b.q, torch.full_like(b.q, 127)), b.scale)
    x = torch.where(torch.arange(64) % 2 == 0, -1.0, 1.0).repeat(2, 1)  # quantises to -32767 / 32767
    want, _ = reference(b, x)
    assert torch.allclose(PackedQ8(b)(x).double(), want, rtol=1e-6)


def test_a_row_does_not_depend_on_the_other_rows():
    lin = PackedQ8(q8_blocks(200, 128, seed=5))
    x = bf16_values(9, 128)
    many = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i:i + 1])[0], many[i])
    assert lin(x.view(3, 3, 128)).shape == (3, 3, 200)


def test_saved_tensors_restore_the_same_linear():
    lin = PackedQ8(q8_blocks(100, 96))
    again = PackedQ8.from_tensors({k: v.clone() for k, v in lin.tensors().items()})
    x = bf16_values(2, 96)
    assert again.out_features == 100 and again.nbytes == lin.nbytes and torch.equal(again(x), lin(x))


def test_unsupported_shapes_are_refused_with_the_value():
    with pytest.raises(ValueError, match=r"Q8_0 CPU kernel needs .* K a multiple of 32; got \[16, 48\]"):
        PackedQ8(Q8Blocks(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 1)))
    with pytest.raises(RuntimeError, match="q8_linear: K = 32 is not a multiple|q8_linear: qs must hold"):
        PackedQ8(q8_blocks(16, 64))(torch.zeros(1, 32))


KW = dict(device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)


def test_a_q8_0_tied_embedding_is_the_head_through_the_load_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TERCEL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tiny_q4_gguf(tmp_path))  # its embedding is Q8_0, tied
    prompt = [3, 17, 200, 45, 9]
    first = LLM(path, dtype="bfloat16", **KW)
    model = first.engine.model
    assert isinstance(model.lm_head_gemv, PackedQ8)
    want = last_logits(first, prompt)
    # the dense bf16 head on the same model: the 8-bit head's logits are close (it quantises the activations)
    head = model.lm_head_gemv
    model.lm_head_gemv = pack_dense(model.embed_tokens.weight)
    dense = last_logits(first, prompt)
    model.lm_head_gemv = head
    assert not torch.equal(want, dense)
    assert (want - dense).norm() < 0.03 * dense.norm()
    monkeypatch.setattr(PackedQ8, "__init__", None)  # a cached start packs nothing again
    second = LLM(path, dtype="bfloat16", **KW)
    assert isinstance(second.engine.model.lm_head_gemv, PackedQ8)
    assert torch.equal(last_logits(second, prompt), want)
