"""GGUF files: config from metadata, tensors dequantized with the `gguf` package into HF names.

llama.cpp stores Llama q/k projections with rows permuted for its interleaved RoPE; we undo that
so the weights match HF's rotate-half layout.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ConfigError
from ..models.cpu_linear import Q4Blocks, Q8Blocks

# GGUF architecture -> HF architecture
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                    "Q5_K", "Q6_K")

_LAYER_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a declared dependency
        raise ConfigError("loading a .gguf file needs the `gguf` package: pip install gguf") from e
    return gguf


def open_reader(path: Path):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on corrupt files
        raise ConfigError(f"cannot read GGUF file {path}: {e} (the file is corrupt or truncated; "
                          f"re-download or re-convert it).") from e


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, path: Path) -> dict[str, Any]:
    """Render GGUF metadata as an HF config dict."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHS)}.")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"{path}: GGUF metadata lacks {arch}.{key}.")
        return v

    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError(f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported yet; "
                          f"use the HF safetensors checkpoint of this model.")
    # Vocab size: the metadata key, else the tokenizer's token list, else the embedding's row count
    # (GGUF shapes are reversed: token_embd is [hidden, vocab]).
    vocab = _field(reader, f"{arch}.vocab_size") or len(tokens)
    if not vocab:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ConfigError(f"{path}: GGUF file has no {arch}.vocab_size, no tokenizer.ggml.tokens and no "
                              f"token_embd.weight, so its vocabulary size is unknown.")
        vocab = int(embd.shape[-1])
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHS[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length") or 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ConfigError(f"{path}: GGUF metadata sets {arch}.rope.scaling.type={scaling!r} but lacks "
                              f"{arch}.rope.scaling.factor.")
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
    sliding = _field(reader, f"{arch}.attention.sliding_window")
    if sliding:
        cfg["sliding_window"] = int(sliding)
    return cfg


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: interleaved RoPE rows -> rotate-half rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_MAP:
        return _TOP_MAP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def iter_gguf_tensors(reader, path: Path, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    gguf = _gguf()
    permute = cfg["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM")
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(f"{path}: unexpected GGUF tensor {t.name!r}; is this a plain decoder checkpoint?")
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_QUANTS:
            raise ConfigError(f"{path}: tensor {t.name!r} uses quant type {qtype}, not supported; "
                              f"supported: {', '.join(SUPPORTED_QUANTS)}.")
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = gguf.quants.dequantize(t.data, t.tensor_type) if qtype not in ("F32", "F16") else t.data
        tensor = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            if tensor.ndim != 2 or tensor.shape[0] % (2 * heads):
                raise ConfigError(
                    f"{path}: tensor {t.name!r} has shape {shape}, which does not split into {heads} heads of "
                    f"even size (metadata head_count{'' if 'q_proj' in name else '_kv'}={heads}); the file's "
                    f"metadata and tensors disagree.")
            tensor = _unpermute(tensor, heads)
        yield name, tensor


def _q4_blocks(t, qtype: str, shape: tuple[int, ...]) -> Q4Blocks:
    """A Q4_0 / Q4_1 tensor's raw blocks as (q, scale, min), without dequantizing: each block of 32
    weights is fp16 d (Q4_1: then fp16 m) and 16 bytes of nibbles, low nibbles first."""
    n, k = shape
    width = 20 if qtype == "Q4_1" else 18
    raw = np.ascontiguousarray(t.data).reshape(n * k // 32, width)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32) if qtype == "Q4_1" else -8.0 * d
    nib = raw[:, width - 16:]
    q = np.concatenate([nib & 0xF, nib >> 4], axis=1)
    return Q4Blocks(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d.reshape(n, k // 32)),
                    torch.from_numpy(np.ascontiguousarray(m).reshape(n, k // 32)))


def iter_q4_weights(reader, cfg: dict[str, Any]) -> Iterator[tuple[str, Q4Blocks]]:
    """(HF name, Q4Blocks) for every Q4_0 / Q4_1 matrix, rows in HF order like iter_gguf_tensors.
    The caller has loaded the file through iter_gguf_tensors, which checked names and shapes."""
    gguf = _gguf()
    permute = cfg["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM")
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        name = hf_name(t.name)
        if qtype not in ("Q4_0", "Q4_1") or name is None or len(t.shape) != 2:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        blocks = _q4_blocks(t, qtype, shape)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            blocks = blocks.rows(_unpermute(torch.arange(shape[0]), heads))
        yield name, blocks


HEAD_NAMES = ("model.embed_tokens.weight", "lm_head.weight")  # the head, or the tied embedding serving as it


def iter_q8_head_weights(reader) -> Iterator[tuple[str, Q8Blocks]]:
    """(HF name, Q8Blocks) of the head's matrix (lm_head, or the tied embedding) when it is stored Q8_0: each
    block of 32 weights is fp16 d and 32 int8 values. No other tensor is read."""
    gguf = _gguf()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name not in HEAD_NAMES or gguf.GGMLQuantizationType(t.tensor_type).name != "Q8_0" or len(t.shape) != 2:
            continue
        n, k = (int(d) for d in reversed(t.shape))
        raw = np.ascontiguousarray(t.data).reshape(n * k // 32, 34)
        d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = raw[:, 2:].copy().view(np.int8)
        yield name, Q8Blocks(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d.reshape(n, k // 32)))


def q4_share(reader) -> tuple[float, tuple[str, ...]]:
    """(the share of the model's matrix elements stored Q4_0 / Q4_1, those types present), from the header
    only: dtype="auto" asks it before any weight is read."""
    gguf = _gguf()
    total = q4 = 0
    kinds: set[str] = set()
    for t in reader.tensors:
        if len(t.shape) != 2 or hf_name(t.name) is None:
            continue
        n = int(t.n_elements)
        total += n
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if qtype in ("Q4_0", "Q4_1"):
            q4 += n
            kinds.add(qtype)
    return (q4 / total if total else 0.0), tuple(sorted(kinds))
