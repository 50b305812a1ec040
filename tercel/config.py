"""Model and engine configuration dataclasses.

ModelConfig is normalised from a HF config.json (or GGUF metadata rendered into the same keys),
so the rest of the engine never looks at raw dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> our family tag. All four are the Llama decoder with small variations.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A checkpoint or engine setting Tercel cannot serve; the message names the value and the fix."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
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
    attention_bias: bool  # Qwen2: biases on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = d.get("model_type")
            by_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
            arch = by_type.get(model_type) if not archs else None
            if arch is None:
                raise ConfigError(
                    f"{source}: unsupported architecture {archs or model_type!r}; Tercel serves "
                    f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type llama/mistral/qwen2/qwen3)."
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
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


@dataclass(slots=True)
class EngineConfig:
    """Engine-level knobs (vLLM names where they exist)."""

    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int | None = None  # derived from kv_cache_memory when None
    kv_cache_memory: int | None = None  # bytes for the KV pool (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.85  # fraction of free GPU memory for the KV pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget for chunked prefill
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1].")
