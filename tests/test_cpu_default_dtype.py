"""dtype="auto" on the CPU: bf16 (a GGUF's 4-bit matrices kept) where this CPU runs bf16 faster, else fp32,
with a start line naming the choice and the fp32 flag. The capability check is monkeypatched both ways,
so these run the same on any CPU."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from gguf_utils import write_gguf  # noqa: E402

from tercel import LLM  # noqa: E402
from tercel.config import ModelLoadConfig  # noqa: E402
from tercel.loader import model_loader  # noqa: E402
from tercel.loader.model_loader import read_checkpoint, resolve_dtype  # noqa: E402
from tercel.models.cpu_linear import CpuBf16Support, PackedInt4, cpu_packing_available  # noqa: E402
from tercel.models.cpu_q8 import PackedQ4Q8  # noqa: E402

CPU = torch.device("cpu")
AVX2 = CpuBf16Support(capability="AVX2", int4_matmul=True, dense_packing=False, native_bf16=False)
AMX = CpuBf16Support(capability="AVX512", int4_matmul=True, dense_packing=True, native_bf16=True)
NONE = CpuBf16Support(capability="DEFAULT", int4_matmul=False, dense_packing=False, native_bf16=False)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """The same tiny Llama as a Q4_1 GGUF (embedding Q8_0, like SmolLM2), an all-Q8_0 GGUF, and safetensors."""
    cfg = transformers.LlamaConfig(**TINY)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    root = tmp_path_factory.mktemp("auto")
    write_gguf(root / "q4.gguf", sd, cfg, "llama", "Q4_1", qtypes={"model.embed_tokens.weight": "Q8_0"})
    write_gguf(root / "q8.gguf", sd, cfg, "llama", "Q8_0")
    hf.save_pretrained(root / "hf")
    return {"q4": root / "q4.gguf", "q8": root / "q8.gguf", "hf": root / "hf"}


def _auto(path: Path, cpu: CpuBf16Support, monkeypatch, dequantize: bool = False):
    monkeypatch.setattr(model_loader, "cpu_bf16_support", lambda: cpu)
    return resolve_dtype("auto", CPU, read_checkpoint(path), dequantize_gguf=dequantize)


def test_q4_gguf_runs_bf16_where_the_int4_matmul_is_vectorised(tiny_files, monkeypatch):
    for cpu in (AVX2, AMX):  # no bf16 hardware needed: the 4-bit bytes are what pays (65 vs 15 tok/s on AVX2)
        choice = _auto(tiny_files["q4"], cpu, monkeypatch)
        assert choice.dtype == torch.bfloat16
        assert choice.note.startswith("dtype auto -> bfloat16 on CPU (bf16 activations, Q4_1 matrices kept")
        assert "--dtype float32" in choice.note and cpu.capability in choice.note
    choice = _auto(tiny_files["q4"], NONE, monkeypatch)
    assert choice.dtype == torch.float32 and "no vectorised int4 matmul" in choice.note
    assert "--dtype bfloat16" in choice.note


def test_dense_checkpoints_run_bf16_only_where_onednn_packs_bf16(tiny_files, monkeypatch):
    # safetensors, a GGUF without 4-bit matrices, a 4-bit GGUF run dequantized: dense weights all
    for path, dequantize in ((tiny_files["hf"], False), (tiny_files["q8"], False), (tiny_files["q4"], True)):
        fast = _auto(path, AMX, monkeypatch, dequantize)
        assert fast.dtype == torch.bfloat16 and "oneDNN-packed bf16 weights" in fast.note
        assert "--dtype float32" in fast.note
        slow = _auto(path, AVX2, monkeypatch, dequantize)  # bf16 F.linear re-lays weights out: slower than fp32
        assert slow.dtype == torch.float32 and "dense weights" in slow.note


def test_explicit_dtypes_and_the_gpu_are_untouched(tiny_files, monkeypatch):
    monkeypatch.setattr(model_loader, "cpu_bf16_support", lambda: AMX)
    ckpt = read_checkpoint(tiny_files["q4"])
    assert resolve_dtype("float32", CPU, ckpt).dtype == torch.float32
    assert resolve_dtype("float32", CPU, ckpt).note is None  # asked for: nothing to explain
    assert resolve_dtype(torch.float16, CPU, ckpt).dtype == torch.float16
    assert resolve_dtype("auto", torch.device("cuda"), None).dtype == torch.bfloat16
    assert "bf16 on a CPU" in ModelLoadConfig.__dataclass_fields__["dtype"].metadata["option"].help


@pytest.mark.skipif(not cpu_packing_available(), reason="this torch build lacks oneDNN / int4 CPU matmul")
@pytest.mark.parametrize("cpu", [AVX2, NONE], ids=["bf16-capable", "fp32-only"])
def test_the_engine_logs_its_choice_at_start(tiny_files, monkeypatch, caplog, cpu):
    monkeypatch.setattr(model_loader, "cpu_bf16_support", lambda: cpu)
    with caplog.at_level(logging.INFO, logger="tercel.engine"):
        llm = LLM(str(tiny_files["q4"]), device="cpu", skip_tokenizer_init=True, progress=False, num_kv_blocks=16,
                  max_model_len=64)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert len(lines) == 1 and lines[0] == llm.engine.dtype_note
    if cpu is AVX2:
        assert llm.engine.dtype == torch.bfloat16 and "bfloat16 on CPU" in lines[0] and "--dtype float32" in lines[0]
        four_bit = (PackedQ4Q8, PackedInt4)
        packed = [m for m in llm.engine.model.modules() if isinstance(getattr(m, "gemv", None), four_bit)]
        assert packed, "the Q4_1 matrices should stay 4-bit (the Q4 x Q8 kernel, else torch's int4 matmul)"
    else:
        assert llm.engine.dtype == torch.float32 and "float32 on CPU" in lines[0]
    out = llm.generate([[1, 2, 3]], _greedy(4))[0].outputs[0].token_ids
    assert len(out) == 4
    # fp32 stays one argument away, and says nothing (it was asked for)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tercel.engine"):
        exact = LLM(str(tiny_files["q4"]), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
                    num_kv_blocks=16, max_model_len=64)
    assert exact.engine.dtype == torch.float32 and exact.engine.dtype_note is None
    assert not [r for r in caplog.records if r.getMessage().startswith("dtype auto")]


def _greedy(n: int):
    from tercel import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
