"""Random-weight checkpoints of named model shapes (Llama-3.1-8B, Qwen3-8B, ...), built in-process.

Weights are seeded normal (std 0.02; norms 1) and go through the model's own `load_weights`, the path real
checkpoints take, so an 8B-shaped model measures bandwidth and overhead at scale without 16 GB of files.
Numbers from these models are labelled "random weights": their text is noise and drafts accept little."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(slots=True, frozen=True)
class Shape:
    name: str
    hf_config: dict = field(hash=False)  # config.json as the HF checkpoint would have it

    @property
    def label(self) -> str:
        return f"{self.name} shape, random weights (seeded normal std 0.02)"


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("llama-3.1-8b", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "rope_scaling": _LLAMA3_ROPE, "bos_token_id": 128000,
        "eos_token_id": [128001, 128009]}),
    Shape("qwen3-8b", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}),
    Shape("smollm2-135m", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}),
    Shape("llama-tiny", {  # for tests: loads in a blink
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}),
)}


def shape_by_name(name: str) -> Shape | None:
    return SHAPES.get(name.lower())


def target_shape(model: str | None) -> Shape | None:
    """The named shape when `model` names one (and no such path exists), else None."""
    return shape_by_name(model) if model and not Path(model).exists() else None


def hf_tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes, read from the transformers model built on the meta device (no memory);
    tied heads appear once, as the embedding."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**shape.hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def random_tensors(shape: Shape, dtype: torch.dtype, device: torch.device,
                   seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    # generated on the target device: an 8B model never passes through host memory
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, dims in hf_tensor_shapes(shape):
        if "norm" in name:
            yield name, torch.ones(dims, dtype=dtype, device=device)
        else:
            yield name, torch.empty(dims, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)


def random_loaded(shape: Shape | str, max_model_len: int, dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0):
    """A LoadedModel (no tokenizer) of the shape with random weights, ready for LLMEngine(loaded=...)."""
    from ..config import ModelConfig
    from ..loader.model_loader import LoadedModel, build_model

    if isinstance(shape, str):
        found = shape_by_name(shape)
        if found is None:
            raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = found
    device = torch.device(device)
    cfg = ModelConfig.from_hf_dict(shape.hf_config, source=f"{shape.name} shape (random weights)")
    model = build_model(cfg, max_model_len, dtype, device)
    model.load_weights(random_tensors(shape, dtype, device, seed), source="random weights")
    return LoadedModel(model, cfg, None, Path(f"random-{shape.name}"), cfg.eos_token_ids)
