"""Resolve a model argument, read its config, build the model on the target device and load weights."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..config import DTYPE_NAMES, ConfigError, ModelConfig
from ..kernels import triton_enabled
from ..models.cpu_linear import CpuBf16Support, cpu_bf16_support, wants_cpu_packing
from ..models.interface import TargetModel
from ..models.registry import model_class
from . import cache, gguf_file, hf
from .paths import DEFAULT_MODEL_PACKAGE, default_model_path, resolve_model_path  # noqa: F401 (re-exported)
from .prepared import load_prepared, prepared_file, save_prepared
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from ..distributed.shard import TPShard

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: TargetModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a model runs in and, for dtype="auto", the start line saying what was picked and why."""

    dtype: torch.dtype
    note: str | None = None


# dtype="auto" keeps a GGUF's 4-bit matrices (bf16 activations) when at least this share of its matrix
# elements is Q4_0 / Q4_1: a decode step is bound by the weight bytes it reads, so the 4-bit matrices must
# carry most of them for the int4 path to beat fp32 where the dense rest runs unpacked bf16 (AVX2).
AUTO_Q4_SHARE = 0.5
FP32_HINT = "--dtype float32 (dtype='float32') for exact fp32"


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype without a checkpoint at hand (auto: as for a dense checkpoint); see resolve_dtype."""
    return resolve_dtype(dtype, device).dtype


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint: Checkpoint | None = None,
                  dequantize_gguf: bool = False) -> DtypeChoice:
    """The dtype to run. "auto": bf16 on a GPU; on the CPU the fastest path this CPU has (cpu_auto_dtype)."""
    if isinstance(dtype, torch.dtype):
        return DtypeChoice(dtype)
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}.")
    if dtype != "auto":
        return DtypeChoice(getattr(torch, DTYPE_NAMES[dtype]))
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, f"dtype auto -> bfloat16 on GPU; {FP32_HINT}")
    share, kinds = (0.0, ())
    if checkpoint is not None and checkpoint.is_gguf and not dequantize_gguf:
        share, kinds = checkpoint.q4
    return cpu_auto_dtype(share, kinds, cpu_bf16_support())


def draft_dtype(target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a dense draft model runs in beside a target in target_dtype: the target's, except bf16 on a
    CPU where oneDNN cannot pack bf16 weights (the target's bf16 there is the 4-bit GGUF path): a dense bf16
    F.linear would re-lay its weight out on every call, so the draft runs fp32, which is faster there."""
    if device.type == "cpu" and target_dtype == torch.bfloat16 and not cpu_bf16_support().dense_packing:
        return torch.float32
    return target_dtype


def cpu_auto_dtype(q4_share: float, q4_kinds: tuple[str, ...], cpu: CpuBf16Support) -> DtypeChoice:
    """dtype="auto" on the CPU. bf16 activations (the weights packed once, models.cpu_linear) where that is
    the faster path, else fp32:
      - a GGUF whose matrices are mostly Q4_0 / Q4_1, on a CPU where torch's int4 matmul is vectorised
        (AVX2 / AVX-512): the matrices stay 4-bit, as llama.cpp runs them (SmolLM2 Q4_1, 2 AVX2 cores:
        65 tok/s against 15 in fp32, without any bf16 hardware);
      - any checkpoint (safetensors bf16 / fp16 / fp32, a dequantized GGUF) on a CPU where oneDNN packs bf16
        weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, so every CPU with avx512_bf16 / amx_bf16): half of
        fp32's bytes a step. The stored dtype is not consulted, as on the GPU: an fp32 checkpoint runs
        rounded to bf16 there too, and fp32 is one flag away.
    Elsewhere (e.g. dense weights on an AVX2-only CPU, where bf16 F.linear re-lays its weight out on every
    call) bf16 would be slower than fp32, so auto stays fp32."""
    kept = "/".join(q4_kinds)
    if q4_share >= AUTO_Q4_SHARE and cpu.int4_matmul:
        return DtypeChoice(torch.bfloat16, f"dtype auto -> bfloat16 on CPU (bf16 activations, {kept} matrices "
                                           f"kept 4-bit; CPU {cpu.describe()}); {FP32_HINT}")
    if cpu.dense_packing:
        return DtypeChoice(torch.bfloat16, f"dtype auto -> bfloat16 on CPU (bf16 activations, oneDNN-packed bf16 "
                                           f"weights; CPU {cpu.describe()}); {FP32_HINT}")
    why = ("no vectorised int4 matmul" if q4_share >= AUTO_Q4_SHARE else "dense weights") + \
        " and oneDNN cannot pack bf16 weights here, so bf16 would be slower"
    return DtypeChoice(torch.float32, f"dtype auto -> float32 on CPU ({why}; CPU {cpu.describe()}); "
                                      f"--dtype bfloat16 to force bf16")


def attention_backend(cfg: ModelConfig, device: torch.device):
    """The attention implementation for this model on this device, handed to the model's constructor."""
    if device.type == "cuda" and triton_enabled() and cfg.head_dim & (cfg.head_dim - 1) == 0:
        from ..attention.triton_backend import TritonAttentionBackend  # GPU: Triton paged attention, fused RoPE

        return TritonAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
    from ..attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)


def build_model(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> TargetModel:
    """The registered family's model for cfg, on device with uninitialised weights (load_weights fills them)."""
    cls = model_class(cfg.architecture)
    # Build on the meta device so an 8B model never materialises in fp32 on the host; the RoPE tables are
    # computed, not loaded, so they are built on the device itself.
    with torch.device("meta"):
        model = cls(cfg, max_positions, dtype, attention_backend(cfg, device))
    model = model.to(dtype).to_empty(device=device)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)


DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint's location and config, read without its weights (cheap: done before loading), once per
    process: the command lines pass it on to the engine."""

    path: Path
    is_gguf: bool
    config: ModelConfig
    raw: dict  # the HF config dict (GGUF: rendered from its metadata)
    q4: tuple[float, tuple[str, ...]] = (0.0, ())  # GGUF: share of matrix elements in Q4_0 / Q4_1, those types
    cache: Path | None = None  # GGUF: its load cache entry (tercel.loader.cache); None: not cached
    _reader: object | None = None  # GGUF: the open reader, opened when tensors are first needed

    @property
    def reader(self):
        """GGUF: the gguf package's reader (parsing the header costs seconds: opened only to read weights)."""
        if self._reader is None and self.is_gguf:
            self._reader = gguf_file.open_reader(self.path)
        return self._reader


def read_checkpoint(model: str | Path | None, use_cache: bool = True) -> Checkpoint:
    """The checkpoint's config; a GGUF's rendered metadata comes from the load cache after the first read."""
    path = resolve_model_path(model)
    if path.is_file():
        entry = cache.entry_dir(path) if use_cache else None
        meta = cache.read_json(entry / "metadata.json") if entry is not None else None
        reader = None
        if meta is None:
            reader = gguf_file.open_reader(path)
            meta = {"config": gguf_file.gguf_config(reader, path), "q4_share": gguf_file.q4_share(reader)}
            if entry is not None:
                cache.write_json(entry / "metadata.json", meta)
        raw = meta["config"]
        share, kinds = meta["q4_share"]
        return Checkpoint(path, True, ModelConfig.from_hf_dict(raw, source=str(path)), raw, (share, tuple(kinds)),
                          entry, reader)
    raw = hf.hf_config(path)
    return Checkpoint(path, False, ModelConfig.from_hf_dict(raw, source=str(path / "config.json")), raw)


def checked_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence served: as asked (at most the model's max_position_embeddings), by default
    min(model's, DEFAULT_MAX_MODEL_LEN)."""
    if max_model_len is None:
        return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings}; lower it.")
    return max_model_len


def load_model(model: str | Path | None, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
               load_tokenizer_too: bool = True, progress: bool = True, dequantize_gguf: bool = False,
               tokenizer: Tokenizer | None = None, shard: "TPShard | None" = None,
               checkpoint: Checkpoint | None = None, use_cache: bool = True) -> LoadedModel:
    """max_model_len: longest sequence served (sizes the RoPE table); default min(model's, 8192).
    tokenizer: one already loaded (else loaded here when load_tokenizer_too, before the weights, so a
    broken tokenizer fails fast).
    bf16 on CPU: linears are prepacked for oneDNN, and a GGUF's Q4_0 / Q4_1 matrices stay 4-bit
    unless dequantize_gguf (models.cpu_linear); fp32 and GPU models run dense weights.
    shard: tensor parallelism (tercel.distributed): build and load only this rank's slice; the returned
    config stays the whole model's.
    checkpoint: `model` already read by read_checkpoint (the engine does, to resolve dtype="auto").
    use_cache: a GGUF prepared for the CPU (bf16, packed) is restored from / saved to its load cache."""
    ckpt = checkpoint if checkpoint is not None else read_checkpoint(model, use_cache)
    path, is_gguf, cfg, raw = ckpt.path, ckpt.is_gguf, ckpt.config, ckpt.raw
    max_model_len = checked_max_model_len(cfg, max_model_len)
    if tokenizer is None and load_tokenizer_too:
        tokenizer = load_tokenizer(path, is_gguf, ckpt.cache if use_cache else None)
    net = build_model(cfg if shard is None else shard.local_config(cfg), max_model_len, dtype, device)
    packing = wants_cpu_packing(device, dtype)
    keep_q4 = is_gguf and not dequantize_gguf and shard is None  # a shard's 4-bit blocks are not kept (yet)
    prepared = (prepared_file(ckpt.cache, dtype, keep_q4)
                if packing and is_gguf and shard is None and use_cache and ckpt.cache is not None else None)
    if prepared is not None and load_prepared(net, prepared):
        log.debug("restored %s as prepared in %s", path.name, prepared)
    else:
        net.load_weights(_device_tensors(ckpt, shard, device, progress), source=str(path))
        if packing:
            blocks = dict(gguf_file.iter_q4_weights(ckpt.reader, raw)) | dict(
                gguf_file.iter_q8_head_weights(ckpt.reader)) if keep_q4 else {}
            net.pack_cpu_linears(blocks)
        if prepared is not None and save_prepared(net, prepared):
            log.info("kept %s as prepared for the CPU in %s: later starts skip the conversion", path.name,
                     prepared.parent)
    eos = set(cfg.eos_token_ids)
    if not is_gguf and (path / "generation_config.json").is_file():
        gen_eos = hf.read_json(path / "generation_config.json").get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(net, cfg, tokenizer, path, tuple(sorted(eos)))


def _device_tensors(ckpt: Checkpoint, shard: "TPShard | None", device: torch.device, progress: bool):
    """The checkpoint's tensors by HF name (a TP rank's slices under `shard`), on `device`, with a progress bar."""
    path, raw = ckpt.path, ckpt.raw
    if shard is not None:
        from ..distributed.loader import iter_gguf_shard, iter_safetensors_shard

        tensors = (iter_gguf_shard(ckpt.reader, path, raw, shard) if ckpt.is_gguf
                   else iter_safetensors_shard(hf.safetensors_files(path), shard))
        total = len(ckpt.reader.tensors) if ckpt.is_gguf else hf.count_tensors(hf.safetensors_files(path))
    elif ckpt.is_gguf:
        tensors = gguf_file.iter_gguf_tensors(ckpt.reader, path, raw)
        total = len(ckpt.reader.tensors)
    else:
        files = hf.safetensors_files(path)
        tensors = hf.iter_safetensors(files)
        total = hf.count_tensors(files)
    bar = tqdm(tensors, total=total, desc=f"Loading {path.name}", unit="tensor", disable=not progress, leave=False)
    return ((n, t.to(device)) for n, t in bar)
