"""bf16 on CPU: prepacked linears and GGUF 4-bit weights kept 4-bit (tercel.models.cpu_linear).

Specification: the raw Q4_0 / Q4_1 blocks read back exactly as gguf's own dequantize; the int4
kernel's zero-point form of them is exact in fp32; each packed linear equals the dense matmul up
to bf16 rounding; and a bf16 model with 4-bit weights is as close to the fp32 model as the same
model with dense bf16 weights (tiny random GGUFs, and the real SmolLM2).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from conftest import last_logits  # noqa: E402
from gguf_utils import write_gguf  # noqa: E402

from tercel import LLM  # noqa: E402
from tercel.loader import gguf_file  # noqa: E402
from tercel.models import cpu_linear, cpu_q8  # noqa: E402
from tercel.models.cpu_linear import (  # noqa: E402
    Q4_GROUP,
    PackedDense,
    PackedInt4,
    Q4Blocks,
    UnpackedDense,
    cpu_packing_available,
    dense_packing_available,
)
from tercel.models.cpu_pack import pack_linear  # noqa: E402
from tercel.models.cpu_q8 import PackedQ4Q8, PackedQ8  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="this torch build lacks oneDNN / int4 CPU matmul")
transformers.logging.set_verbosity_error()
# what a dense bf16 weight becomes on this CPU: oneDNN packs bf16 only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
DENSE = PackedDense if dense_packing_available() else UnpackedDense
# a Q8_0 head stays 8-bit where the kernel built, else dense bf16 (the tiny GGUFs' embedding is Q8_0, tied)
Q8_HEAD = PackedQ8 if cpu_q8.kernel_error() is None else (PackedDense, UnpackedDense)
FOUR_BIT = (PackedQ4Q8, PackedInt4)  # a 4-bit matrix stays 4-bit: the Q4 x Q8 kernel where it built, else torch's

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05,
            tie_word_embeddings=True)  # tied like SmolLM2: the Q8_0 embedding is the head
PROMPTS = [[3, 17, 200, 45, 9],
           [int(x) for x in torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(7))]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama GGUF per 4-bit type (2-D weights in that type, the embedding Q8_0 like SmolLM2's)."""
    cfg = transformers.LlamaConfig(**TINY, rope_theta=50000.0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: GGUF stores no output.weight
    paths = {}
    for qtype in ("Q4_0", "Q4_1"):
        path = tmp_path_factory.mktemp("q4") / f"tiny-{qtype}.gguf"
        write_gguf(path, sd, cfg, "llama", qtype, qtypes={"model.embed_tokens.weight": "Q8_0"})
        paths[qtype] = path
    return paths


def _blocks(n: int, k: int, seed: int = 0) -> Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    return Q4Blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                    (torch.rand(n, k // Q4_GROUP, generator=g) * 0.02).half().float(),
                    (torch.randn(n, k // Q4_GROUP, generator=g) * 0.1).half().float())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_read_back_as_ggufs_dequantize(tiny_gguf, qtype):
    path = tiny_gguf[qtype]
    reader = gguf_file.open_reader(path)
    cfg = gguf_file.gguf_config(reader, path)
    dense = dict(gguf_file.iter_gguf_tensors(reader, path, cfg))
    q4 = dict(gguf_file.iter_q4_weights(reader, cfg))
    # every 2-D weight but the Q8_0 embedding, q/k rows unpermuted like the dense ones
    assert sorted(q4) == sorted(n for n, t in dense.items() if t.ndim == 2 and "embed" not in n)
    for name, blocks in q4.items():
        assert blocks.q.dtype == torch.uint8 and int(blocks.q.max()) <= 15
        assert torch.equal(blocks.dequantize(), dense[name]), name


def test_zero_point_form_is_exact_in_fp32():
    b = _blocks(64, 256)
    g = lambda t: t.repeat_interleave(Q4_GROUP, 1)  # noqa: E731
    zero = b.min + 8 * b.scale
    assert torch.equal((b.q.float() - 8) * g(b.scale) + g(zero), b.dequantize())


@pytest.mark.parametrize("rows", [1, 5])
def test_packed_int4_equals_the_dense_matmul_up_to_bf16(rows):
    b = _blocks(96, 256, seed=1)
    x = torch.randn(rows, 256).bfloat16()
    bias = torch.randn(96).bfloat16()
    # the kernel's weights: scale and zero rounded to bf16 (module docstring), applied exactly
    g = lambda t: t.bfloat16().float().repeat_interleave(Q4_GROUP, 1)  # noqa: E731
    w = (b.q.float() - 8) * g(b.scale) + g(b.min + 8 * b.scale)
    ref = x.float() @ w.t() + bias.float()
    out = PackedInt4(b)(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # and the bf16 rounding of scale/zero stays within bf16's own error on the true weights
    true = x.float() @ b.dequantize().t() + bias.float()
    assert (out.float() - true).abs().max() <= 2e-2 * true.abs().max()


def test_shapes_the_int4_kernel_cannot_take_are_packed_dense(monkeypatch):
    monkeypatch.setenv("TERCEL_CPU_Q8", "0")  # torch's int4 kernel (the Q4 x Q8 one takes any N)
    odd = Q4Blocks(torch.zeros(100, 64, dtype=torch.uint8), torch.ones(100, 2), torch.zeros(100, 2))  # 100 % 16
    with pytest.raises(ValueError, match=r"\[100, 64\]"):
        PackedInt4(odd)
    packed = pack_linear(odd.dequantize(), odd)
    assert isinstance(packed, DENSE)
    x = torch.randn(2, 64).bfloat16()
    assert torch.allclose(packed(x).float(), torch.zeros(2, 100))
    assert isinstance(pack_linear(torch.zeros(96, 64), _blocks(96, 64)), PackedInt4)


@pytest.mark.skipif(not dense_packing_available(), reason="this CPU's oneDNN has no bf16 weight packing")
@pytest.mark.parametrize("rows", [1, 7])
def test_packed_dense_equals_f_linear(rows):
    w = torch.randn(80, 64).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float())
    out = PackedDense(w)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_dense_packing_probe_tells_whether_onednn_takes_bf16_weights():
    w = torch.randn(32, 64).bfloat16()
    if dense_packing_available():
        PackedDense(w)
    else:  # AVX2-only CPUs: the error the probe saw, so every dense weight stays an UnpackedDense
        with pytest.raises(RuntimeError, match="bf16"):
            PackedDense(w)


def test_without_bf16_packing_dense_weights_run_through_f_linear(monkeypatch, tiny_gguf):
    monkeypatch.setattr(cpu_linear, "dense_packing_available", lambda: False)
    w, x = torch.randn(80, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    packed = pack_linear(w, None)
    assert isinstance(packed, UnpackedDense) and packed.weight.data_ptr() == w.data_ptr()  # no copy
    assert torch.equal(packed(x), torch.nn.functional.linear(x, w))
    assert isinstance(pack_linear(torch.zeros(96, 64), _blocks(96, 64)), FOUR_BIT)  # 4-bit needs no oneDNN
    ref, q4 = _tiny(tiny_gguf["Q4_0"], "float32"), _tiny(tiny_gguf["Q4_0"], "bfloat16")
    assert isinstance(q4.engine.model.lm_head_gemv, Q8_HEAD)  # the Q8_0 tied embedding as the head needs no oneDNN
    assert isinstance(q4.engine.model.layers[0].self_attn.qkv_proj.gemv, FOUR_BIT)
    for ids in PROMPTS:
        want = last_logits(ref, ids)
        assert (last_logits(q4, ids) - want).abs().max() <= 0.03 * want.abs().max()


def _tiny(path: Path, dtype: str, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, device="cpu", max_model_len=128, num_kv_blocks=16, skip_tokenizer_init=True,
               progress=False, **kw)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_bf16_model_keeps_4bit_weights_and_is_as_close_to_fp32_as_dense_bf16(tiny_gguf, qtype):
    path = tiny_gguf[qtype]
    ref, q4, dense = _tiny(path, "float32"), _tiny(path, "bfloat16"), _tiny(path, "bfloat16", dequantize_gguf=True)
    layer = q4.engine.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.gemv, FOUR_BIT) and isinstance(layer.mlp.down_proj.gemv, FOUR_BIT)
    assert layer.self_attn.qkv_proj.weight.numel() == 0  # the dense copy is dropped
    assert isinstance(q4.engine.model.lm_head_gemv, Q8_HEAD)  # the Q8_0 tied head stays 8-bit
    assert isinstance(dense.engine.model.layers[0].self_attn.qkv_proj.gemv, DENSE)
    assert ref.engine.model.layers[0].self_attn.qkv_proj.gemv is None  # fp32 stays the exact reference
    for ids in PROMPTS:
        want = last_logits(ref, ids)
        err_q4 = (last_logits(q4, ids) - want).abs().max().item()
        err_dense = (last_logits(dense, ids) - want).abs().max().item()
        scale = want.abs().max().item()
        assert err_q4 <= 0.03 * scale and err_dense <= 0.03 * scale, (err_q4, err_dense, scale)
        assert err_q4 <= 3 * err_dense + 1e-3 * scale, (err_q4, err_dense)


@pytest.mark.slow
def test_smollm2_bf16_4bit_next_tokens_track_fp32_like_dense_bf16(smol_path, smol_llm, smol_chat_ids):
    """The real model: per prompt, the next-token distribution of bf16 with 4-bit weights is as close
    to fp32's as bf16 with dense weights (total variation), and its top token agrees as often."""
    q4 = LLM(smol_path, dtype="bfloat16", device="cpu", max_model_len=512, progress=False)
    dense = LLM(smol_path, dtype="bfloat16", device="cpu", max_model_len=512, progress=False, dequantize_gguf=True)
    tv = {"q4": [], "dense": []}
    top = {"q4": 0, "dense": 0}
    for ids in smol_chat_ids:
        p = last_logits(smol_llm, ids).softmax(-1)
        for name, llm in (("q4", q4), ("dense", dense)):
            lq = last_logits(llm, ids)
            tv[name].append(0.5 * (lq.softmax(-1) - p).abs().sum().item())
            top[name] += int(lq.argmax() == p.argmax())
    mean = {k: sum(v) / len(v) for k, v in tv.items()}
    assert mean["q4"] <= 0.05 and mean["q4"] <= 2 * mean["dense"] + 0.005, mean
    assert top["q4"] >= top["dense"] - 1 and top["q4"] >= len(smol_chat_ids) - 2, top


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["EAGLE3", "DFLASH"])
def test_bf16_drafts_of_smollm2_are_prepacked_and_still_accept(smol_path, smol_chat_ids, algorithm):
    """The bundled drafts load their linears prepacked too (an EAGLE draft runs fp32 where oneDNN cannot pack
    bf16: loader.model_loader.draft_dtype), and their drafts are still accepted."""
    from tercel import SamplingParams
    from tercel.models.cpu_linear import cpu_bf16_support

    llm = LLM(smol_path, dtype="bfloat16", device="cpu", max_model_len=512, progress=False,
              speculative_algorithm=algorithm)
    drafter = llm.engine.spec.drafter
    draft = drafter.model if algorithm == "EAGLE3" else drafter.draft
    if algorithm == "EAGLE3" and not cpu_bf16_support().dense_packing:
        assert draft.fc.weight.dtype == torch.float32 and drafter.kv.k.dtype == torch.float32
    else:
        assert isinstance(draft.fc.gemv, DENSE)
    out = llm.generate(smol_chat_ids[:2], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 32 for o in out)
    accept = [o.metrics.mean_accept_length for o in out]
    assert sum(accept) / len(accept) > 1.2, accept  # a draft that lost its weights accepts ~1.0
