"""Write an EAGLE-3 draft in the SpecForge / SGLang export format (config.json + model.safetensors),
the format tercel.models.eagle3 loads. Fused q/k/v and gate/up parameters are split back into the
checkpoint's separate tensors; the embedding is left out (the target's is used)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig


def eagle3_config_dict(target: ModelConfig, *, draft_vocab_size: int | None, aux_layer_ids: tuple[int, ...],
                       intermediate_size: int | None = None, num_heads: int | None = None,
                       num_kv_heads: int | None = None, max_position_embeddings: int | None = None) -> dict[str, Any]:
    heads = num_heads or target.num_heads
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads or target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": max_position_embeddings or target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    if draft_vocab_size is None:  # the full vocabulary through the target's lm_head (none exported)
        del d["draft_vocab_size"]
    if target.rope_scaling:
        d["rope_scaling"] = dict(target.rope_scaling)
    return d


def eagle3_tensors(model: torch.nn.Module, draft_ids: torch.Tensor | None, vocab_size: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of an EagleDraftModel (kind eagle3); draft_ids: [Vd] target id of each draft
    id, or None for a draft over the full vocabulary (no d2t / t2d)."""
    lc = model.config.layers
    q, kvs = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        t = p.detach().to("cpu", dtype)
        if ".qkv_proj." in name:
            for piece, chunk in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kvs, kvs])):
                out[name.replace("qkv_proj", piece)] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            for piece, chunk in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", piece)] = chunk.contiguous()
        else:
            out[name] = t.contiguous()
    if draft_ids is None:
        return out
    draft_ids = draft_ids.to("cpu", torch.long)
    out["d2t"] = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    return out


def save_eagle3(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    return out


def random_eagle3(out_dir: str | Path, target: ModelConfig, *, draft_vocab_size: int | None = None,
                  aux_layer_ids: tuple[int, ...] | None = None, seed: int = 0, std: float = 0.02,
                  intermediate_size: int | None = None, dtype: torch.dtype = torch.float32,
                  head_from_target: bool = False) -> Path:
    """A random-weight EAGLE-3 draft for `target` (tests: losslessness must not depend on the weights).
    head_from_target: no lm_head / d2t exported, the target's head serves the full vocabulary."""
    from ..models.eagle3 import EagleDraftConfig, EagleDraftModel, default_eagle3_layer_ids

    vd = target.vocab_size if head_from_target else draft_vocab_size or target.vocab_size
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_eagle3_layer_ids(target.num_layers)
    cfg_dict = eagle3_config_dict(target, draft_vocab_size=None if head_from_target else vd, aux_layer_ids=ids,
                                  intermediate_size=intermediate_size)
    cfg = EagleDraftConfig.from_dict(cfg_dict, target, "random")
    model = EagleDraftModel(cfg, 16, torch.float32, has_embed=False, has_head=not head_from_target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    draft_ids = None if head_from_target else torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    return save_eagle3(out_dir, cfg_dict, eagle3_tensors(model, draft_ids, target.vocab_size, dtype))
