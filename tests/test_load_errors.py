"""Every way a checkpoint, engine setting or request can be wrong gives a clear error: a ConfigError
(or ValueError for requests) whose message names the file / tensor / value and says what is
supported or what to do. Never a raw KeyError, struct.error, AttributeError or reshape failure."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from gguf_utils import write_gguf  # noqa: E402

from tercel import LLM, SamplingParams  # noqa: E402
from tercel.config import ConfigError  # noqa: E402
from tercel.loader import load_model  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 256
CFG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)
ST = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF config, state dict, saved HF dir) of a tiny random Llama."""
    cfg = transformers.LlamaConfig(**CFG)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    d = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(d, safe_serialization=True)
    return cfg, {k: v.clone() for k, v in hf.state_dict().items()}, d


@pytest.fixture
def hf_dir(tiny, tmp_path) -> Path:
    """A private copy of the tiny HF checkpoint that a test may damage."""
    d = tmp_path / "model"
    shutil.copytree(tiny[2], d)
    return d


def _load(path):
    return load_model(path, torch.float32, torch.device("cpu"), load_tokenizer_too=False, progress=False)


def _raises(path, *needles: str) -> str:
    """Loading `path` raises ConfigError whose message contains every needle; returns the message."""
    with pytest.raises(ConfigError) as ei:
        _load(path)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit) -> None:
    sd = load_file(str(d / ST))
    edit(sd)
    save_file(sd, str(d / ST), metadata={"format": "pt"})


def test_tiny_checkpoint_loads(hf_dir):  # the baseline the damaged copies below start from
    loaded = _load(hf_dir)
    assert loaded.config.vocab_size == VOCAB and loaded.config.num_layers == 2


# ---- unsupported models -------------------------------------------------------------------

def test_unsupported_architecture_config_json(hf_dir):
    _edit_config(hf_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    _raises(hf_dir, str(hf_dir / "config.json"), "GPT2LMHeadModel", "unsupported architecture", "LlamaForCausalLM",
            "Qwen2ForCausalLM")


def test_unsupported_architecture_gguf(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, sd, cfg, arch="gpt2")
    _raises(path, str(path), "'gpt2'", "not supported", "llama", "qwen3")


def test_unsupported_rope_type_config_json(hf_dir):
    _edit_config(hf_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    _raises(hf_dir, str(hf_dir / "config.json"), "'yarn'", "not supported", "llama3", "linear")


def test_unsupported_rope_type_legacy_rope_scaling(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    _raises(hf_dir, "config.json", "'dynamic'", "not supported", "default")


def test_unsupported_rope_type_gguf(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "yarn.gguf"
    write_gguf(path, sd, cfg, extra_kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    _raises(path, str(path), "'yarn'", "not supported", "llama3")


def test_gguf_rope_scaling_without_factor(tiny, tmp_path):
    """Was a raw TypeError (float(None)); now names both metadata keys."""
    cfg, sd, _ = tiny
    path = tmp_path / "linear-nofactor.gguf"
    write_gguf(path, sd, cfg, extra_kv={"llama.rope.scaling.type": "linear"})
    _raises(path, str(path), "llama.rope.scaling.type='linear'", "llama.rope.scaling.factor")


def test_missing_config_field(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    _raises(hf_dir, str(hf_dir / "config.json"), "missing required field 'hidden_size'")


def test_gguf_missing_metadata(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "noemb.gguf"
    write_gguf(path, sd, cfg, skip_kv=("embedding_length",))
    _raises(path, str(path), "llama.embedding_length")


def test_gguf_without_vocab_size_uses_embedding_rows(tiny, tmp_path):
    """No {arch}.vocab_size and no tokenizer tokens: was vocab_size=0 and a baffling shape error
    "(256, 64), expected (0, 64)"; now the vocab comes from token_embd.weight."""
    cfg, sd, _ = tiny
    path = tmp_path / "novocab.gguf"
    write_gguf(path, sd, cfg, skip_kv=("vocab_size",))
    assert _load(path).config.vocab_size == VOCAB


# ---- tensors: missing, unexpected, wrong shape, unknown quant -----------------------------

@pytest.mark.parametrize("name,shown", [
    ("model.layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"),
    ("model.layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight <- k_proj"),
    ("model.norm.weight", "norm.weight"),
])
def test_missing_tensor(hf_dir, name, shown):
    _edit_tensors(hf_dir, lambda sd: sd.pop(name))
    _raises(hf_dir, str(hf_dir), "missing tensors", shown, "1 in all")


def test_missing_tensor_gguf(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "missing.gguf"
    write_gguf(path, {k: v for k, v in sd.items() if k != "model.layers.1.mlp.gate_proj.weight"}, cfg)
    _raises(path, str(path), "missing tensors", "layers.1.mlp.gate_up_proj.weight <- gate_proj")


def test_unexpected_tensor(hf_dir):
    def add(sd):
        sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    _edit_tensors(hf_dir, add)
    _raises(hf_dir, str(hf_dir), "unexpected tensor", "'model.layers.0.mlp.extra_proj.weight'", "llama")


def test_unexpected_tensor_gguf(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "extra.gguf"
    write_gguf(path, sd, cfg, raw_tensors={"blk.0.attn_extra.weight": (np.zeros((4, 34), np.uint8), "Q8_0")})
    _raises(path, str(path), "unexpected GGUF tensor", "'blk.0.attn_extra.weight'")


def test_shape_mismatch(hf_dir):
    def shrink(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)
    _edit_tensors(hf_dir, shrink)
    _raises(hf_dir, str(hf_dir), "'model.layers.0.mlp.up_proj.weight'", "(96, 64)", "expected (128, 64)")


def test_shape_mismatch_gguf(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "badv.gguf"
    write_gguf(path, dict(sd, **{"model.layers.1.self_attn.v_proj.weight": torch.zeros(48, 64)}), cfg)
    _raises(path, str(path), "'model.layers.1.self_attn.v_proj.weight'", "(48, 64)", "expected (32, 64)")


def test_gguf_qk_rows_disagree_with_head_count(tiny, tmp_path):
    """head_count metadata that does not divide the q rows: was a raw reshape RuntimeError inside
    the q/k un-permute; now names the tensor and the head count."""
    cfg, sd, _ = tiny
    path = tmp_path / "heads.gguf"
    # 4 heads written (so the permute works), metadata then overwritten to 3 heads / 3 kv heads.
    write_gguf(path, sd, cfg, extra_kv={"llama.attention.head_count": 3, "llama.attention.head_count_kv": 3})
    _raises(path, str(path), "'blk.0.attn_q.weight'", "(64, 64)", "3 heads")


def test_unknown_quant_type(tiny, tmp_path):
    cfg, sd, _ = tiny
    path = tmp_path / "iq2.gguf"
    # IQ2_XXS: 256-element blocks of 66 bytes; ffn_up is [128, 64] so store a [128, 256] tensor raw.
    sd = {k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}
    write_gguf(path, sd, cfg, raw_tensors={"blk.0.ffn_up.weight": (np.zeros((128, 66), np.uint8), "IQ2_XXS")})
    _raises(path, str(path), "'blk.0.ffn_up.weight'", "IQ2_XXS", "not supported", "Q8_0", "Q4_K", "Q6_K")


# ---- unreadable files ---------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "header_only", "garbage", "empty"])
def test_corrupt_safetensors(hf_dir, damage):
    f = hf_dir / ST
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "header_only": data[:5],
                   "garbage": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\0" * 64, "empty": b""}[damage])
    _raises(hf_dir, f"cannot read safetensors file {f}", "corrupt or truncated")


@pytest.mark.parametrize("damage", ["truncated_data", "truncated_header", "bad_magic", "bad_version", "empty"])
def test_corrupt_gguf(tiny, tmp_path, damage):
    cfg, sd, _ = tiny
    good = tmp_path / "good.gguf"
    write_gguf(good, sd, cfg)
    data = good.read_bytes()
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes({"truncated_data": data[: len(data) - 1000], "truncated_header": data[:300],
                      "bad_magic": b"hello world" * 20, "bad_version": b"GGUF" + b"\xff" * 200,
                      "empty": b""}[damage])
    _raises(path, f"cannot read GGUF file {path}", "corrupt or truncated")


def test_invalid_config_json(hf_dir):
    (hf_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    _raises(hf_dir, str(hf_dir / "config.json"), "not valid JSON", "re-export")


def test_config_json_not_an_object(hf_dir):
    """Was a raw AttributeError ('list' object has no attribute 'get')."""
    (hf_dir / "config.json").write_text("[1, 2, 3]")
    _raises(hf_dir, str(hf_dir / "config.json"), "JSON list", "re-export")


def test_missing_config_json(hf_dir):
    (hf_dir / "config.json").unlink()
    _raises(hf_dir, str(hf_dir), "no config.json", ".gguf")


def test_no_safetensors_weights(hf_dir):
    (hf_dir / ST).rename(hf_dir / "pytorch_model.bin")
    _raises(hf_dir, str(hf_dir), "no *.safetensors", ".bin")


def test_index_lists_missing_shard(hf_dir):
    sd = load_file(str(hf_dir / ST))
    names = sorted(sd)
    (hf_dir / ST).unlink()
    save_file({k: sd[k] for k in names[:5]}, str(hf_dir / "model-00001-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors"
                  for i, k in enumerate(names)}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _raises(hf_dir, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "do not exist")


def test_sharded_checkpoint_loads(hf_dir):  # the positive twin of the test above
    sd = load_file(str(hf_dir / ST))
    names = sorted(sd)
    (hf_dir / ST).unlink()
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for f, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(hf_dir / f))
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    model = _load(hf_dir).model
    assert torch.equal(model.norm.weight, sd["model.norm.weight"])


def test_non_gguf_file_path(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    _raises(f, str(f), "not a .gguf file", "HF directory")


def test_nonexistent_path(tmp_path):
    p = tmp_path / "no-such-model"
    _raises(p, str(p), "does not exist", "never downloads")


# ---- engine settings ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float8", "int4", "fp64"])
def test_bad_dtype(hf_dir, dtype):
    with pytest.raises(ConfigError, match=re.escape(f"dtype={dtype!r} is not supported")) as ei:
        LLM(str(hf_dir), dtype=dtype, device="cpu", skip_tokenizer_init=True, progress=False)
    assert "float32" in str(ei.value) and "bfloat16" in str(ei.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda(hf_dir, device):
    with pytest.raises(ConfigError, match=re.escape(f"device={device!r} but CUDA is not available")) as ei:
        LLM(str(hf_dir), dtype="float32", device=device, skip_tokenizer_init=True, progress=False)
    assert "device='cpu'" in str(ei.value)


@pytest.mark.parametrize("device", ["tpu", "mps", "gpu"])
def test_unsupported_device(hf_dir, device):
    with pytest.raises(ConfigError, match=re.escape(f"device={device!r} is not supported")) as ei:
        LLM(str(hf_dir), dtype="float32", device=device, skip_tokenizer_init=True, progress=False)
    assert "cpu" in str(ei.value) and "cuda" in str(ei.value)


def test_max_model_len_beyond_model(hf_dir):
    with pytest.raises(ConfigError, match=re.escape("max_model_len=100000 exceeds")) as ei:
        LLM(str(hf_dir), dtype="float32", device="cpu", max_model_len=100000, skip_tokenizer_init=True,
            progress=False)
    assert "max_position_embeddings=256" in str(ei.value)


# ---- requests -----------------------------------------------------------------------------

MAX_LEN = 32


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[2]), dtype="float32", device="cpu", max_model_len=MAX_LEN, num_kv_blocks=8,
               skip_tokenizer_init=True, progress=False)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("bad", [VOCAB, -1, 10**6])
def test_prompt_ids_outside_vocab(llm, bad):
    with pytest.raises(ValueError) as ei:
        llm.generate([[1, 2, bad]], SamplingParams(max_tokens=2))
    msg = str(ei.value)
    assert f"[{bad}]" in msg and f"[0, {VOCAB})" in msg and "outside the vocabulary" in msg


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError) as ei:
        llm.generate([[5] * 40], SamplingParams(max_tokens=2))
    msg = str(ei.value)
    assert "40 tokens" in msg and f"max_model_len={MAX_LEN}" in msg and "shorten the prompt" in msg


def test_prompt_as_text_without_tokenizer(llm):
    with pytest.raises(ConfigError, match="no tokenizer; pass token ids"):
        llm.generate("hello", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("field,value,want", [
    ("temperature", -0.5, ">= 0"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "positive integer"),
    ("max_tokens", 0, ">= 1"),
    ("min_p", 2.0, "[0, 1]"),
    ("logprobs", 50, "[0, 20]"),
])
def test_bad_sampling_params(field, value, want):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**{field: value})
    msg = str(ei.value)
    assert f"SamplingParams.{field}={value!r}" in msg and want in msg


def test_engine_still_serves_after_rejected_requests(llm):
    """Rejected requests leave nothing behind: a valid one afterwards runs normally."""
    for bad in ([], [VOCAB], [5] * 40):
        with pytest.raises(ValueError):
            llm.engine.add_request(bad, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
