"""A model as the CPU runs it (its parameters and packed linears), saved once and restored on later starts.

Preparing a GGUF for the CPU dequantizes every tensor and packs its 4-bit matrices for the int4 kernel:
seconds for a small model, far more than reading the result back. The saved file holds the parameters
after packing (a 4-bit matrix's dense copy is already dropped) and each packed linear's tensors; it is
memory-mapped on load. Its name carries what the packing depends on (dtype, 4-bit kept or not, torch
version, CPU capability), inside the checkpoint's load cache entry (tercel.loader.cache)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..models.cpu_linear import CpuPackedLinear, PackedDense, PackedInt4, UnpackedDense, cpu_bf16_support, pack_dense
from ..models.cpu_q8 import LAYOUT, PackedQ4Q8, PackedQ8, q8_available
from .cache import CACHE_FORMAT, write_atomically

log = logging.getLogger(__name__)

_KINDS: dict[str, type[CpuPackedLinear]] = {"int4": PackedInt4, "q4q8": PackedQ4Q8, "q8": PackedQ8,
                                            "dense": UnpackedDense, "onednn": PackedDense}


def prepared_file(entry: Path, dtype: torch.dtype, keep_q4: bool) -> Path:
    cpu = cpu_bf16_support()
    # which 4-bit kernel packed it (Q4 x Q8 or torch's int4) is part of the name: TERCEL_CPU_Q8 picks the file
    q4 = 'dense' if not keep_q4 else f'q4q8v{LAYOUT}' if dtype == torch.bfloat16 and q8_available() else 'q4'
    tag = f"{str(dtype).removeprefix('torch.')}-{q4}-torch{torch.__version__}-" \
          f"{cpu.capability}{'-onednn' if cpu.dense_packing else ''}"
    return entry / f"prepared-{''.join(c if c.isalnum() or c in '.-_' else '_' for c in tag)}.pt"


def packed_linears(model: nn.Module) -> dict[str, CpuPackedLinear]:
    """Every packed linear the model holds, by 'module.path.attribute'."""
    out = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, CpuPackedLinear):
                out[f"{name}.{attr}" if name else attr] = value
    return out


def save_prepared(model: nn.Module, path: Path) -> bool:
    """Write the prepared model; False when one of its linears has no saved form (e.g. oneDNN-packed)."""
    kinds = {cls: kind for kind, cls in _KINDS.items()}
    linears = {}
    for key, lin in packed_linears(model).items():
        kind = kinds.get(type(lin))
        if kind is None:
            log.info("no prepared-weight cache for this model on this CPU (%s has no saved form)", type(lin).__name__)
            return False
        linears[key] = (kind, lin.tensors())
    state = {"format": CACHE_FORMAT, "params": {n: p.detach() for n, p in model.named_parameters()},
             "linears": linears}
    return write_atomically(path, lambda target: torch.save(state, target))


def _owner(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent, _, leaf = dotted.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def load_prepared(model: nn.Module, path: Path) -> bool:
    """Fill `model` (as build_model made it: right shapes, no weights) from a prepared file; False (model
    untouched) when there is none or it does not fit this model."""
    if not path.is_file():
        return False
    try:
        state = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # a truncated or foreign file: prepare from scratch (and overwrite it)
        log.warning("ignoring the unreadable prepared-weight cache %s (%s)", path, e)
        return False
    params = dict(model.named_parameters())
    saved = state.get("params", {}) if isinstance(state, dict) else {}
    if state.get("format") != CACHE_FORMAT or set(saved) != set(params) or any(
            t.numel() and t.shape != params[n].shape for n, t in saved.items()):
        log.warning("ignoring the prepared-weight cache %s: it does not fit this model", path)
        return False
    unknown = sorted({kind for kind, _ in state["linears"].values()} - set(_KINDS))
    if unknown:
        log.warning("ignoring the prepared-weight cache %s: linears of kinds %s this version does not know", path,
                    unknown)
        return False
    for name, tensor in saved.items():
        owner, leaf = _owner(model, name)
        setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
    for key, (kind, tensors) in state["linears"].items():
        owner, attr = _owner(model, key)
        # a dense bf16 weight is packed as this process's CPU takes it now (oneDNN, or F.linear)
        setattr(owner, attr, pack_dense(tensors["weight"]) if kind in ("dense", "onednn")
                else _KINDS[kind].from_tensors(tensors))
    return True
