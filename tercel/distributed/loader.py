"""Each rank reads only its shard of the weights: safetensors through safe_open + get_slice, GGUF by
slicing the memory-mapped tensor before dequantizing. No rank materialises a full matrix it splits.

GGUF quantized matrices are stored row by row in blocks along K (the input dim): a column-parallel
slice (output rows) is a slice of whole rows; a row-parallel slice (input columns) is a slice of
each row's blocks when K / tp_size falls on block boundaries, else the covering blocks are
dequantized and trimmed. llama.cpp's q/k row permutation is per head, so it is undone on the slice.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..loader import gguf_file, hf
from .shard import TPShard


def _cut(full_shape: tuple[int, ...], how) -> tuple[slice, ...]:
    dim, start, end = how
    return tuple(slice(start, end) if d == dim else slice(None) for d in range(len(full_shape)))


def iter_safetensors_shard(files: list[Path], shard: TPShard) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    how = shard.slice_of(name)
                    if how is None:
                        yield name, st.get_tensor(name)
                        continue
                    piece = st.get_slice(name)
                    shape = tuple(piece.get_shape())
                    if how == "rank0":
                        yield name, piece[:] if shard.rank == 0 else torch.zeros(shape)
                    else:
                        yield name, piece[_cut(shape, how)]
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read safetensors file {f}: {e}") from e


def _gguf_piece(t, shape: tuple[int, ...], how, qtype: str) -> np.ndarray:
    """The float32 slice `how` of GGUF tensor t (HF shape `shape`), dequantizing only what it covers."""
    import gguf

    dense = qtype in ("F32", "F16")
    if len(shape) == 1 or dense:
        arr = np.asarray(t.data).reshape(shape) if dense else np.asarray(
            gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)
        return np.array(arr[_cut(shape, how)], dtype=np.float32)
    block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    raw = np.asarray(t.data).reshape(shape[0], -1)  # [rows, bytes per row]
    dim, start, end = how
    if dim == 0:
        return np.array(gguf.quants.dequantize(raw[start:end], t.tensor_type), dtype=np.float32).reshape(
            end - start, shape[1])
    lo, hi = start // block, -(-end // block)  # the blocks covering [start, end) of each row
    dq = np.asarray(gguf.quants.dequantize(np.ascontiguousarray(raw[:, lo * type_size:hi * type_size]),
                                           t.tensor_type)).reshape(shape[0], (hi - lo) * block)
    return np.array(dq[:, start - lo * block:end - lo * block], dtype=np.float32)


def iter_gguf_shard(reader, path: Path, cfg: dict, shard: TPShard) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        name = gguf_file.hf_name(t.name)
        if name is None:
            raise ConfigError(f"{path}: unexpected GGUF tensor {t.name!r}; is this a plain decoder checkpoint?")
        yield name, _gguf_shard(t, name, path, cfg, shard)


def _gguf_shard(t, name: str, path: Path, cfg: dict, shard: TPShard) -> torch.Tensor:
    """This rank's piece of GGUF tensor t (HF name `name`), as float32 in HF layout."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.tensor_type).name
    if qtype not in gguf_file.SUPPORTED_QUANTS:
        raise ConfigError(f"{path}: tensor {t.name!r} uses quant type {qtype}, not supported.")
    shape = tuple(int(d) for d in reversed(t.shape))
    how = shard.slice_of(name)
    if how == "rank0" and shard.rank != 0:
        return torch.zeros(shape)
    how = (0, 0, shape[0]) if how in (None, "rank0") else how
    tensor = torch.from_numpy(_gguf_piece(t, shape, how, qtype))
    if cfg["architectures"][0] in ("LlamaForCausalLM", "MistralForCausalLM") and name.endswith(
            ("q_proj.weight", "k_proj.weight")):
        tensor = gguf_file._unpermute(tensor, tensor.shape[0] // shard.head_dim)  # whole heads: per-head permute
    return tensor


def read_full(ckpt, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named HF tensors whole (rank 0's replicated copies for the drafts: embedding, lm_head)."""
    out: dict[str, torch.Tensor] = {}
    if ckpt.is_gguf:
        whole = TPShard.of(ckpt.config, 0, 1)
        for t in ckpt.reader.tensors:
            name = gguf_file.hf_name(t.name)
            if name in names:
                out[name] = _gguf_shard(t, name, ckpt.path, ckpt.raw, whole)
        return out
    from safetensors import safe_open

    for f in hf.safetensors_files(ckpt.path):
        with safe_open(str(f), framework="pt") as st:
            for name in names:
                if name in st.keys():
                    out[name] = st.get_tensor(name)
    return out
