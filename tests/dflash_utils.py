"""Write random-weight DFlash drafts (z-lab format) for tests, without the reference package."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_random_dflash(out: Path, *, vocab: int, hidden: int, num_target_layers: int, block_size: int,
                        mask_token_id: int, target_layer_ids: list[int], layers: int = 1, heads: int = 4,
                        kv_heads: int = 2, head_dim: int = 16, intermediate: int = 96, std: float = 0.2,
                        seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 4096, "num_target_layers": num_target_layers, "rope_theta": 10000.0,
           "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                             "target_layer_ids": target_layer_ids}}
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    sd = {"fc.weight": w(hidden, hidden * len(target_layer_ids)), "hidden_norm.weight": torch.ones(hidden),
          "norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                   p + "self_attn.q_norm.weight": torch.ones(head_dim),
                   p + "self_attn.k_norm.weight": torch.ones(head_dim),
                   p + "mlp.gate_proj.weight": w(intermediate, hidden),
                   p + "mlp.up_proj.weight": w(intermediate, hidden),
                   p + "mlp.down_proj.weight": w(hidden, intermediate),
                   p + "input_layernorm.weight": torch.ones(hidden),
                   p + "post_attention_layernorm.weight": torch.ones(hidden)})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out
