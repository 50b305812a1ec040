"""GGUF loading: every supported storage type reads back as gguf's own dequantize(quantize(w)),
llama.cpp's q/k row permutation is undone, and the loaded model equals HF transformers run on
those same dequantized weights (fp32, CPU): last-token logits within 1e-4, greedy decoding equal.

Tiny random models (hidden 64, 2 layers, vocab 256) written with tests/gguf_utils.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from conftest import last_logits  # noqa: E402
from gguf_utils import write_gguf  # noqa: E402

from tercel import LLM, SamplingParams  # noqa: E402
from tercel.loader import gguf_file  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
PROMPTS = [[3, 17, 200, 45, 9],
           [int(x) for x in torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(7))]]


def _random_hf(cfg) -> torch.nn.Module:
    """HF model with random weights large enough (std 0.2) that argmaxes are not near-ties, random norms and
    biases (HF initialises those to 1 / 0, which would hide a mix-up)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(**TINY, rope_theta=50000.0)
    return cfg, _random_hf(cfg)


def _hf_with(cfg, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set()), missing
    return hf


def _llm(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16,
               skip_tokenizer_init=True, progress=False)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = gguf_file.open_reader(path)
    cfg = gguf_file.gguf_config(reader, path)
    return dict(gguf_file.iter_gguf_tensors(reader, path, cfg))


def _check_tensors_and_logits(path: Path, cfg, expected: dict[str, torch.Tensor]) -> None:
    got = _read_tensors(path)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), f"{name}: max diff {(got[name] - want).abs().max().item()}"
    hf = _hf_with(cfg, expected)
    llm = _llm(path)
    for ids in PROMPTS:
        ours = last_logits(llm, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() <= 1e-4
        assert ours.argmax().item() == ref.argmax().item()


@pytest.mark.parametrize("qtype", QTYPES)
def test_llama_gguf_quant_types_match_hf(tmp_path, llama, qtype):
    cfg, hf = llama
    path = tmp_path / f"tiny-llama-{qtype}.gguf"
    expected = write_gguf(path, hf.state_dict(), cfg, "llama", qtype)
    if qtype == "F32":  # F32 is lossless: the originals come back bit for bit
        for name, t in hf.state_dict().items():
            assert torch.equal(expected[name], t), name
    elif qtype not in ("F16", "BF16"):  # block quants really are lossy, so the test is not vacuous
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(expected[q], hf.state_dict()[q])
    _check_tensors_and_logits(path, cfg, expected)


def test_llama_gguf_stores_permuted_qk_and_loader_unpermutes(tmp_path, llama):
    """The file holds llama.cpp's interleaved row order (not HF's); the loader restores HF's."""
    cfg, hf = llama
    path = tmp_path / "tiny-llama-perm.gguf"
    write_gguf(path, hf.state_dict(), cfg, "llama", "F32")
    reader = gguf_file.open_reader(path)
    raw = {t.name: np.array(t.data) for t in reader.tensors}
    got = _read_tensors(path)
    for layer in range(cfg.num_hidden_layers):
        for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            orig = hf.state_dict()[f"model.layers.{layer}.self_attn.{h}.weight"]
            stored = torch.from_numpy(raw[f"blk.{layer}.{g}.weight"])
            assert stored.shape == orig.shape
            assert not torch.equal(stored, orig)  # permuted on disk
            assert torch.equal(got[f"model.layers.{layer}.self_attn.{h}.weight"], orig)
        # v is never permuted
        assert torch.equal(torch.from_numpy(raw[f"blk.{layer}.attn_v.weight"]),
                           hf.state_dict()[f"model.layers.{layer}.self_attn.v_proj.weight"])


def test_llama_gguf_config(tmp_path, llama):
    cfg, hf = llama
    path = tmp_path / "tiny-llama-cfg.gguf"
    write_gguf(path, hf.state_dict(), cfg, "llama", "F32")
    d = gguf_file.gguf_config(gguf_file.open_reader(path), path)
    assert d["architectures"] == ["LlamaForCausalLM"]
    assert (d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]) == (VOCAB, 64, 128, 2)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (4, 2, 16)
    assert d["rope_theta"] == 50000.0 and d["max_position_embeddings"] == 256
    assert d["tie_word_embeddings"] is False and d["attention_bias"] is False
    assert d["rms_norm_eps"] == pytest.approx(1e-6)


def test_qwen2_gguf_with_qkv_bias_matches_hf(tmp_path):
    cfg = transformers.Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=False)
    hf = _random_hf(cfg)
    path = tmp_path / "tiny-qwen2.gguf"
    expected = write_gguf(path, hf.state_dict(), cfg, "qwen2", "F32")
    assert "model.layers.0.self_attn.q_proj.bias" in expected
    d = gguf_file.gguf_config(gguf_file.open_reader(path), path)
    assert d["architectures"] == ["Qwen2ForCausalLM"] and d["attention_bias"] is True
    _check_tensors_and_logits(path, cfg, expected)


def test_qwen3_gguf_with_qk_norm_tied_and_wide_heads_matches_hf(tmp_path):
    """Qwen3: q/k RMSNorm, head_dim 32 != hidden/heads (attention.key_length), tied embeddings
    (no output.weight in the file), no q/k permutation."""
    cfg = transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    hf = _random_hf(cfg)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "tiny-qwen3.gguf"
    expected = write_gguf(path, sd, cfg, "qwen3", "F32")
    assert "model.layers.0.self_attn.q_norm.weight" in expected
    d = gguf_file.gguf_config(gguf_file.open_reader(path), path)
    assert d["architectures"] == ["Qwen3ForCausalLM"]
    assert d["head_dim"] == 32 and d["tie_word_embeddings"] is True
    _check_tensors_and_logits(path, cfg, expected)


def test_llama_gguf_greedy_generation_matches_hf(tmp_path, llama):
    cfg, hf = llama
    path = tmp_path / "tiny-llama-gen.gguf"
    write_gguf(path, hf.state_dict(), cfg, "llama", "F32")
    llm = _llm(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
        assert len(ref) == 16
