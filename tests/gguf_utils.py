"""Write tiny GGUF files from an HF state dict + config, the way llama.cpp's convert script does.

Independent of tercel.loader.gguf_file on purpose (own name table, own permute), so a naming or
permutation bug in the loader cannot cancel out against the same bug here.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# llama.cpp tensor names for the HF parameter names of the Llama family.
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp permutes q/k rows only for these


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.(weight|bias)
    assert parts[:2] == ["model", "layers"], hf_name
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_LAYER[module]}.{parts[-1]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute: rotate-half rows -> interleaved RoPE rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def qtype_of(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def quant_roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a tensor stored as `qtype` reads back as: dequantize(quantize(w)) in fp32."""
    t = qtype_of(qtype)
    q = gguf.quants.quantize(w.detach().float().numpy(), t)
    return torch.from_numpy(np.array(gguf.quants.dequantize(q, t), dtype=np.float32).reshape(w.shape))


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def write_gguf(path: str | Path, state_dict: Mapping[str, torch.Tensor], config: Any, arch: str = "llama",
               qtype: str = "F32", *, vector_qtype: str = "F32", qtypes: Mapping[str, str] | None = None,
               extra_kv: Mapping[str, Any] | None = None, skip_kv: tuple[str, ...] = (),
               raw_tensors: Mapping[str, tuple[np.ndarray, str]] | None = None) -> dict[str, torch.Tensor]:
    """Write `state_dict` (HF names, torch tensors) as a GGUF file of architecture `arch`.

    qtype: storage type of 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...); vector_qtype: of 1-D
    tensors (norms, biases), F32 as llama.cpp keeps them. qtypes: per-HF-name overrides.
    extra_kv: more metadata (key -> str/int/float/bool, written with the matching type);
    skip_kv: metadata keys (without the "{arch}." prefix) to leave out.
    raw_tensors: GGUF name -> (uint8 bytes shaped [rows, row_bytes], quant type name), stored raw.
    Returns the tensors a correct loader must produce: HF names, quantize->dequantize round trip, fp32.
    """
    path = Path(path)
    heads = int(_cfg(config, "num_attention_heads"))
    kv_heads = int(_cfg(config, "num_key_value_heads") or heads)
    hidden = int(_cfg(config, "hidden_size"))
    head_dim = int(_cfg(config, "head_dim") or hidden // heads)
    rope = _cfg(config, "rope_parameters") or {}
    theta = float(rope.get("rope_theta", _cfg(config, "rope_theta", 10000.0)))

    w = gguf.GGUFWriter(str(path), arch)
    kv: dict[str, Any] = {
        "block_count": int(_cfg(config, "num_hidden_layers")),
        "context_length": int(_cfg(config, "max_position_embeddings", 2048)),
        "embedding_length": hidden,
        "feed_forward_length": int(_cfg(config, "intermediate_size")),
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.freq_base": theta,
        "attention.layer_norm_rms_epsilon": float(_cfg(config, "rms_norm_eps", 1e-6)),
        "vocab_size": int(_cfg(config, "vocab_size")),
    }
    if head_dim != hidden // heads:
        kv["attention.key_length"] = head_dim
        kv["attention.value_length"] = head_dim
    for key, val in kv.items():
        if key in skip_kv:
            continue
        if isinstance(val, float):
            w.add_float32(f"{arch}.{key}", val)
        else:
            w.add_uint32(f"{arch}.{key}", val)
    for key, val in (extra_kv or {}).items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_string(key, str(val))

    expected: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if "rotary_emb" in name:
            continue
        t = tensor.detach().float().cpu()
        qt = (qtypes or {}).get(name, qtype if t.ndim == 2 else vector_qtype)
        expected[name] = quant_roundtrip(t, qt)
        arr = t.numpy()
        if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = llamacpp_permute(arr, heads if "q_proj" in name else kv_heads)
        arr = np.ascontiguousarray(arr)
        if qt in ("F32", "F16"):
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype_of(qt)))
        else:  # BF16 and block quants come back as uint8 rows; the writer converts the byte shape
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype_of(qt)), raw_dtype=qtype_of(qt))
    for gname, (data, qt) in (raw_tensors or {}).items():
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.uint8), raw_dtype=qtype_of(qt))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


TINY_LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=True)


def tiny_q4_gguf(directory: Path) -> Path:
    """A tiny Llama with random weights (seed 0) as a Q4_1 GGUF (its embedding Q8_0) in directory."""
    import transformers

    cfg = transformers.LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = Path(directory) / "tiny-Q4_1.gguf"
    write_gguf(path, sd, cfg, "llama", "Q4_1", qtypes={"model.embed_tokens.weight": "Q8_0"})
    return path
