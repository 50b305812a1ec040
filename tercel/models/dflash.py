"""DFlash block-diffusion draft (z-lab format).

A few Qwen3-style layers that predict a whole block in ONE forward: the block is
[last verified token, mask x (block_size - 1)], attended non-causally. The target's hidden states
from several layers are concatenated, projected (fc -> hidden_norm) and injected into every draft
layer as extra K/V ("context"); the context is written once into the draft's paged cache, at the
same slots the target uses for those positions, and never re-run. Embedding and lm_head are the
target's (shared, not copied).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..attention.paged_merge import PagedPrefix, attend_paged_and_dense
from ..attention.sdpa import sdpa
from ..config import ConfigError, ModelConfig
from ..kernels import use_triton
from ..kv import KVCacheSpec, PagedKVCache
from .linear import Linear
from .llama import MLP, RMSNorm
from .rope import RotaryEmbedding, apply_rope


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Spread between layer 1 and L - 3 (the reference's choice when the config gives none)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(slots=True, frozen=True)
class DFlashConfig:
    layers: ModelConfig  # the draft layers' shapes (Qwen3-style, q/k norms)
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any], target: ModelConfig, source: str) -> "DFlashConfig":
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise ConfigError(f"{source}: no 'dflash_config' object; a DFlash draft config needs "
                              f"dflash_config {{block_size, mask_token_id, target_layer_ids}}.")
        if "conv_kernel_size" in dc or "selector_rank" in dc:
            raise ConfigError(f"{source}: DFlash-2 drafts (convolutions, candidate selector) are not supported; "
                              f"use a DFlash (v1) draft.")
        layer_types = set(d.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ConfigError(f"{source}: layer_types {sorted(layer_types)} not supported (only full_attention).")
        layers = ModelConfig.from_hf_dict(dict(d, architectures=["Qwen3ForCausalLM"]), source)
        if layers.hidden_size != target.hidden_size:
            raise ConfigError(f"{source}: draft hidden_size={layers.hidden_size} != target hidden_size="
                              f"{target.hidden_size}; this draft was trained for another target.")
        n_target = int(d.get("num_target_layers", target.num_layers))
        if n_target != target.num_layers:
            raise ConfigError(f"{source}: num_target_layers={n_target} but the target has {target.num_layers} layers.")
        mask = dc.get("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
            raise ConfigError(f"{source}: mask_token_id={mask!r} is outside the target vocabulary "
                              f"[0, {target.vocab_size}).")
        ids = tuple(int(i) for i in (dc.get("target_layer_ids") or
                                     default_target_layer_ids(n_target, layers.num_layers)))
        bad = [i for i in ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"{source}: target_layer_ids {bad} out of range for a {target.num_layers}-layer "
                              f"target (valid 0..{target.num_layers - 1}).")
        block = int(dc.get("block_size", d.get("block_size", 16)))
        if block < 2:
            raise ConfigError(f"{source}: block_size={block} must be >= 2.")
        return cls(layers, n_target, block, mask, ids, float(dc.get("input_embedding_scale", 1.0)),
                   float(dc.get("output_multiplier", 1.0)))


def _norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(norm(x), cos, sin) for heads x [N, H, D]: one kernel on the GPU instead of the norm and ~5
    elementwise launches of the rotation."""
    d = x.shape[-1]
    if use_triton(x, norm.weight) and d & (d - 1) == 0 and x.stride(-1) == 1:
        from ..kernels.fused import rms_norm_rope

        return rms_norm_rope(x, norm.weight, norm.eps, cos, sin)
    return apply_rope(norm(x), cos, sin)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.h * self.d, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.hkv * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V for rows x: [N, H] -> [N, Hkv, D] each."""
        k = _norm_rope(self.k_norm, self.k_proj(x).view(-1, self.hkv, self.d), cos, sin)
        return k, self.v_proj(x).view(-1, self.hkv, self.d)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        q = _norm_rope(self.q_norm, self.q_proj(x).view(b * s, self.h, self.d), cos, sin)
        return (q, *self.kv(x.reshape(b * s, -1), cos, sin))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, paged: PagedPrefix,
                      block_mask: torch.Tensor | None = None) -> torch.Tensor:
        """forward with the context read from the paged cache by the split-KV kernel (GPU): cache_k / cache_v this
        layer's [slots, Hkv, D], each request's context its first paged.seq_lens positions."""
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        seen = (x.new_ones(b, s, dtype=torch.bool) if block_mask is None else block_mask)[:, None, :].expand(b, s, s)
        out = attend_paged_and_dense(q, cache_k, cache_v, paged, k.view(b, s, self.hkv, self.d),
                                     v.view(b, s, self.hkv, self.d), seen, self.d ** -0.5)
        return self.o_proj(out.reshape(b, s, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor, block_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, H] block rows; ctx_k/v: [B, C, Hkv, D] gathered context; ctx_mask: [B, C] valid;
        block_mask: [B, S] block rows that exist as keys (None: all)."""
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        # the block's keys first: a context padded past its length (a graph's) is a masked tail, so the real
        # keys fall in the same places whatever the padding
        keys = torch.cat([k.view(b, s, self.hkv, self.d), ctx_k], dim=1).transpose(1, 2)
        values = torch.cat([v.view(b, s, self.hkv, self.d), ctx_v], dim=1).transpose(1, 2)
        block_mask = ctx_mask.new_ones(b, s) if block_mask is None else block_mask
        mask = torch.cat([block_mask, ctx_mask], dim=1)[:, None, None, :]  # non-causal block
        out = sdpa(q.view(b, s, self.h, self.d).transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        lc = cfg.layers
        self.fc = Linear(len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(lc, i) for i in range(lc.num_layers))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.rope = RotaryEmbedding(lc, max_positions, dtype)

    def kv_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec.for_model(self.config.layers, block_size, dtype)

    def inject_context(self, target_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       cache: PagedKVCache) -> None:
        """Project target hidden states of committed positions and write every layer's context K/V.
        target_hidden: [N, n_aux * H_target] (the chosen target layers' outputs, concatenated)."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            cache.write(i, slots, k, v)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, ctx_slots: torch.Tensor | None,
                ctx_mask: torch.Tensor | None, cache: PagedKVCache, block_lens: torch.Tensor | None = None,
                paged: PagedPrefix | None = None) -> torch.Tensor:
        """block_embeds: [B, S, H] (target embeddings x input_embedding_scale); positions: [B, S];
        ctx_slots / ctx_mask: [B, C] cache slots of each request's context and their validity (gathered), or
        paged: where the split-KV kernel finds each request's context (tercel.attention.paged_merge);
        block_lens: [B] a shorter block per request (the rows past it are neither keys nor used), as
        the reference drafts near the end of a request. Returns the normed hidden states [B, S, H];
        logits come from the target's lm_head."""
        b, s, _ = block_embeds.shape
        block_mask = None if block_lens is None else \
            torch.arange(s, device=block_embeds.device)[None, :] < block_lens.to(block_embeds.device)[:, None]
        cos, sin = self.rope.lookup(positions.reshape(-1))
        h = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            if paged is not None:
                h = h + layer.self_attn.forward_paged(x, cos, sin, cache.k[i], cache.v[i], paged, block_mask)
            else:
                ctx_k, ctx_v = cache.k[i][ctx_slots], cache.v[i][ctx_slots]
                h = h + layer.self_attn(x, cos, sin, ctx_k, ctx_v, ctx_mask, block_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def forward_dense(self, target_hidden: torch.Tensor, anchors: torch.Tensor, block_embeds: torch.Tensor
                      ) -> torch.Tensor:
        """Training form, no cache: N sequences' contexts and m blocks each, at once.
        target_hidden: [N, T, n_aux * H] for positions 0..T-1; anchors: [N, m] block start positions
        (a block sees its sequence's context before its anchor, and its own block non-causally);
        block_embeds: [N, m, S, H]. Returns the normed hidden states [N, m, S, H]."""
        n, m, s, hsz = block_embeds.shape
        t = target_hidden.shape[1]
        dev = block_embeds.device
        ctx = self.hidden_norm(self.fc(target_hidden)).reshape(n * t, hsz)
        ctx_cos, ctx_sin = self.rope.lookup(torch.arange(t, device=dev).repeat(n))
        positions = anchors[..., None] + torch.arange(s, device=dev)  # [N, m, S]
        cos, sin = self.rope.lookup(positions.reshape(-1))
        ctx_mask = (torch.arange(t, device=dev) < anchors[..., None]).reshape(n * m, t)
        h = block_embeds.reshape(n * m, s, hsz)
        for layer in self.layers:
            k, v = layer.self_attn.kv(ctx, ctx_cos, ctx_sin)  # [N*T, Hkv, D]
            shape = (n, 1, t) + k.shape[1:]
            ctx_k = k.view(shape).expand(n, m, *shape[2:]).reshape(n * m, t, *k.shape[1:])
            ctx_v = v.view(shape).expand(n, m, *shape[2:]).reshape(n * m, t, *v.shape[1:])
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, ctx_k, ctx_v, ctx_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).view(n, m, s, hsz)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, t in tensors:
            local = name
            for piece, fused_idx in (("gate_proj", 0), ("up_proj", 1)):
                if f".mlp.{piece}." in name:
                    local = name.replace(f".mlp.{piece}.", ".mlp.gate_up_proj.")
                    rows = self.config.layers.intermediate_size
                    target = params[local].data[fused_idx * rows:(fused_idx + 1) * rows] if local in params else None
                    break
            else:
                target = params[local].data if local in params else None
            if target is None:
                raise ConfigError(f"{source}: unexpected tensor {name!r} in a DFlash draft.")
            if tuple(target.shape) != tuple(t.shape):
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(target.shape)}.")
            target.copy_(t.to(target.dtype))
            seen.add(name)
        expected = set()
        for p in params:
            if ".gate_up_proj." in p:
                expected |= {p.replace("gate_up_proj", "gate_proj"), p.replace("gate_up_proj", "up_proj")}
            else:
                expected.add(p)
        missing = sorted(expected - seen)
        if missing:
            raise ConfigError(f"{source}: missing tensors {missing[:5]} ({len(missing)} in all).")


def sort_target_layers(model: DFlashDraftModel) -> None:
    """The target returns aux hidden states in ascending layer order; if the checkpoint lists its
    target layers otherwise, permute fc's input column blocks to match."""
    ids = model.config.target_layer_ids
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    if order == list(range(len(ids))):
        return
    h = model.config.layers.hidden_size
    w = model.fc.weight.data.view(h, len(ids), -1)
    model.fc.weight.data.copy_(w[:, order].reshape(h, -1))
    model.config = replace(model.config, target_layer_ids=tuple(ids[i] for i in order))
