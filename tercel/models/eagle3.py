"""EAGLE-3 draft head (SpecForge / SGLang export format) and EAGLE (v1/v2) heads, loaded from safetensors.

EAGLE-3: the target's hidden states of a few layers (low / mid / high) are concatenated and projected
by `fc` (n_aux * H_target -> H). One decoder layer (`midlayer`) takes [input_layernorm(embedding) ;
hidden_norm(hidden)] (2H wide) into attention; its residual stream starts at `hidden`. The pre-norm
output is the hidden state of the next draft step (no fc then); `norm` + `lm_head` give logits over
the draft vocabulary, mapped to target ids by `d2t` (draft id -> target id offset).
EAGLE (v1/v2): `fc` (with bias) over [embedding ; hidden] with the target's final normed hidden
state, Llama layers (layer 0 without input_layernorm), logits from the target's lm_head, no norm.

Checkpoint tensors (optionally prefixed with "model."):
  EAGLE-3: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
           midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
           norm.weight, lm_head.weight (absent when tie_word_embeddings), d2t, t2d, [embed_tokens.weight]
           A checkpoint without lm_head.weight (and no d2t) whose config omits draft_vocab_size uses the
           TARGET's lm_head over the full vocabulary, as SGLang's load_lm_head_from_target does.
  EAGLE:   fc.weight, fc.bias, layers.N.{self_attn,mlp,post_attention_layernorm,input_layernorm (N>0)}.*,
           [embed_tokens.weight], [lm_head.weight: ignored, the target's head is used]
Layer ids follow the convention of tercel.models.llama: id L is the OUTPUT of target layer L.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..kernels import SMALL_M_ROWS, fused_decode_enabled, small_m_enabled, use_triton
from ..kv import KVCacheSpec
from .linear import Linear, prepack_for_cpu
from .llama import MLP, Attention, RMSNorm
from .rope import RotaryEmbedding, apply_rope

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3",)
EAGLE_ARCHS = ("LlamaForCausalLMEagle",)

# attention callback: (layer index, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H * D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_eagle3_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """SGLang's default capture (no ids in the config): the streams ENTERING layers 2, L // 2 and
    L - 3, i.e. the outputs of layers 1, L // 2 - 1 and L - 4."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


@dataclass(slots=True, frozen=True)
class EagleDraftConfig:
    kind: str  # "eagle3" | "eagle"
    layers: ModelConfig  # the draft decoder layers' shapes and RoPE
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE-3 only; EAGLE reads the target's final normed hidden
    tie_word_embeddings: bool

    @property
    def fc_in(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)

    @classmethod
    def from_dict(cls, d: dict[str, Any], target: ModelConfig, source: str) -> "EagleDraftConfig":
        archs = d.get("architectures") or []
        if any(a in EAGLE3_ARCHS for a in archs):
            kind = "eagle3"
        elif any(a in EAGLE_ARCHS for a in archs):
            kind = "eagle"
        else:
            raise ConfigError(f"{source}: architectures={archs!r} is not an EAGLE draft; expected "
                              f"{EAGLE3_ARCHS[0]!r} (EAGLE-3) or {EAGLE_ARCHS[0]!r} (EAGLE).")
        layers = ModelConfig.from_hf_dict(dict(d, architectures=["LlamaForCausalLM"]), source)
        vocab = int(d["vocab_size"])
        if vocab != target.vocab_size:
            raise ConfigError(f"{source}: draft vocab_size={vocab} but the target's vocabulary has "
                              f"{target.vocab_size} tokens; this draft was trained for another target.")
        target_hidden = int(d.get("target_hidden_size") or layers.hidden_size)
        if target_hidden != target.hidden_size:
            raise ConfigError(f"{source}: the draft expects target hidden size {target_hidden} "
                              f"({'target_hidden_size' if 'target_hidden_size' in d else 'hidden_size'}), but the "
                              f"target's hidden_size is {target.hidden_size}; "
                              "this draft was trained for another target.")
        tie = bool(d.get("tie_word_embeddings", False))
        if kind == "eagle":
            return cls(kind, layers, vocab, target_hidden, (), tie)
        if layers.num_layers != 1:
            raise ConfigError(f"{source}: num_hidden_layers={layers.num_layers}; only single-layer EAGLE-3 drafts "
                              f"(one midlayer) are supported.")
        draft_vocab = int(d.get("draft_vocab_size") or vocab)
        if not 0 < draft_vocab <= vocab:
            raise ConfigError(f"{source}: draft_vocab_size={draft_vocab} must be in 1..{vocab} "
                              "(the target vocabulary).")
        eagle_cfg = d.get("eagle_config") or {}
        ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        ids = tuple(int(i) for i in ids) if ids else default_eagle3_layer_ids(target.num_layers)
        bad = [i for i in ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids {bad} are out of range for a "
                              f"{target.num_layers}-layer target (valid 0..{target.num_layers - 1}); this draft was "
                              f"trained for another target.")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids {list(ids)} repeat a layer (for a "
                              f"{target.num_layers}-layer target the default low/mid/high ids collide; give distinct "
                              f"ids in eagle_config).")
        return cls(kind, layers, draft_vocab, target_hidden, ids, tie)


def attention(attn: Attention, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
              attend: AttendFn) -> torch.Tensor:
    """One attention block of a draft layer: fused qkv, RoPE, the caller's attention over its KV, o_proj. An
    attend with a `rope` method (the target's attention backend) rotates and stores in its own kernels."""
    qkv = attn.qkv_proj(x)
    t, heads = qkv.shape[0], attn.num_heads + attn.num_kv_heads
    qk = qkv[:, :attn.q_size + attn.kv_size].view(t, heads, attn.head_dim)
    v = qkv[:, attn.q_size + attn.kv_size:].view(t, attn.num_kv_heads, attn.head_dim)
    rope = getattr(attend, "rope", None)
    if rope is not None:
        return attn.o_proj(rope(attn.layer, qk, v, cos_sin))
    qk = apply_rope(qk, *cos_sin)
    return attn.o_proj(attend(attn.layer, qk[:, :attn.num_heads], qk[:, attn.num_heads:], v))


def _mlp_fused(mlp: MLP, h: torch.Tensor) -> bool:
    """The draft MLP's fused GEMVs serve h's rows: the GPU's kernels, and the tuner (gemv_tuning.tune_draft) kept
    both of its roles for that row count."""
    m = h.shape[0] if h.dim() == 2 else 0
    if not (1 <= m <= SMALL_M_ROWS and use_triton(h) and fused_decode_enabled()) or (m > 1 and not small_m_enabled()):
        return False
    return all(c is not None for c in mlp.fused_configs(h.shape[0]))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size), 0)  # q/k/v read 2H
        self.self_attn.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class EagleDraftModel(nn.Module):
    """Both EAGLE kinds behind one interface: forward(ids, hidden, positions, attend, from_target)
    returns the pre-norm hidden states; compute_logits gives draft-vocabulary logits; draft_to_target
    maps draft ids to target ids (None: the draft vocabulary is the target's)."""

    def __init__(self, cfg: EagleDraftConfig, max_positions: int, dtype: torch.dtype, has_embed: bool,
                 has_head: bool = True) -> None:
        """has_head=False (EAGLE-3, untied): logits come from the target's lm_head (share_target)."""
        super().__init__()
        self.config = cfg
        lc = cfg.layers
        self.hidden_size = lc.hidden_size
        self.embed_tokens = nn.Embedding(lc.vocab_size, lc.hidden_size) if has_embed else None
        self._target_embed: torch.Tensor | None = None
        self._target_head: torch.Tensor | None = None
        self._target_head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_from_target = False
        if cfg.kind == "eagle3":
            self.fc = Linear(cfg.fc_in, lc.hidden_size, bias=False)
            self.midlayer = Eagle3Layer(lc)
            self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
            own_head = has_head and not cfg.tie_word_embeddings
            self.lm_head = Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False) if own_head else None
            self.head_from_target = not has_head and not cfg.tie_word_embeddings
        else:
            from .llama import DecoderLayer

            self.fc = Linear(2 * lc.hidden_size, lc.hidden_size, bias=True)
            self.layers = nn.ModuleList(DecoderLayer(lc, i) for i in range(lc.num_layers))
            self.layers[0].input_layernorm = None  # EAGLE skips the first layer's input norm
        # on the meta device (load_eagle_draft) both come after to_empty: a meta arange costs seconds of lazy
        # torch imports at every start
        on_meta = torch.empty(0).is_meta
        self.register_buffer("draft_to_target", torch.empty(cfg.draft_vocab_size, dtype=torch.long) if on_meta
                             else torch.arange(cfg.draft_vocab_size), persistent=False)
        self.rope = None if on_meta else RotaryEmbedding(lc, max_positions, dtype)
        self.hot_head: Linear | None = None  # restrict_vocab: the head rows of the hot tokens only
        self.head_q: tuple[torch.Tensor, torch.Tensor] | None = None  # quantize_head: (int8 rows, fp32 scales)

    @property
    def num_layers(self) -> int:
        return 1 if self.config.kind == "eagle3" else len(self.layers)

    @property
    def maps_vocab(self) -> bool:
        return self.hot_head is not None or self.config.draft_vocab_size != self.config.layers.vocab_size

    @property
    def vocab_size(self) -> int:
        """Entries of compute_logits' last dimension (draft ids; draft_to_target maps them)."""
        return self.draft_to_target.numel()

    def _head_weight(self) -> torch.Tensor:
        """The [draft vocab, H] matrix compute_logits multiplies by (before any restriction)."""
        if self.config.kind == "eagle" or self.head_from_target:
            return self._target_head
        if self.lm_head is not None:
            return self.lm_head.weight
        return self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed

    def restrict_vocab(self, hot_ids: torch.Tensor) -> int:
        """Draft only the target ids in hot_ids (a token map; call after share_target): the head keeps
        their rows, so a draft step's head product shrinks with the map. Returns the kept count."""
        if self._target_head is None:
            raise RuntimeError("restrict_vocab needs share_target first (the head may be the target's).")
        ids = self.draft_to_target
        keep = torch.isin(ids, hot_ids.to(ids.device))
        n = int(keep.sum())
        if n == 0:
            raise ConfigError(f"the token map ({hot_ids.numel()} ids) shares no token with this draft's "
                              f"vocabulary ({ids.numel()} ids); it was made for another model.")
        full = self._head_weight()
        w = full[keep.to(full.device)].to(self.fc.weight.dtype)  # the draft's dtype, even from the target's head
        head = Linear(w.shape[1], n, bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
        head.weight.copy_(w)
        prepack_for_cpu(head, w.device, w.dtype)
        self.hot_head = head
        self.draft_to_target = ids[keep]
        return n

    def quantize_head(self) -> None:
        """The head product over int8 rows with a per-row scale (after share_target and any restrict_vocab):
        half the bytes of a bf16 head, so a draft step reads less and, at SmolLM2's size, the GPU's L2 holds it.
        Only the draft's proposals can change; the target's own head is untouched."""
        if self._target_head is None:
            raise RuntimeError("quantize_head needs share_target first (the head may be the target's).")
        from ..kernels.gemv_q8 import quantize_rows_int8

        w = self.hot_head.weight if self.hot_head is not None else self._head_weight()
        self.head_q = quantize_rows_int8(w.detach())

    def kv_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        lc = self.config.layers
        return KVCacheSpec(self.num_layers, lc.num_kv_heads, lc.head_dim, block_size, dtype)

    def share_target(self, embed: torch.Tensor, lm_head: torch.Tensor,
                     head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Use the target's embedding (when the checkpoint has none) and, for EAGLE and head-less EAGLE-3,
        its lm_head; head_fn (normed hidden -> float logits, e.g. the target's compute_logits) takes
        the target's tuned head kernel."""
        # detached: a Parameter assigned to a module would become one of the draft's parameters
        self._target_embed = embed.detach()
        self._target_head = lm_head.detach()
        self._target_head_fn = head_fn

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding table: the draft's own or the target's."""
        return self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                from_target: bool) -> torch.Tensor:
        """ids, positions: [N]; hidden: [N, fc_in] target aux states (from_target, EAGLE-3) or [N, H]."""
        cos_sin = self.rope.lookup(positions)
        dtype = self.fc.weight.dtype  # a draft may run wider than its target (speculative/eagle.py)
        hidden = hidden.to(dtype)
        if self.config.kind == "eagle3":
            h = self.fc(hidden) if from_target else hidden
            layer = self.midlayer
            x = self._layer_input(ids, h)
            a = attention(layer.self_attn, x, cos_sin, attend)
            if _mlp_fused(layer.mlp, h):  # the norm, SwiGLU and residual add in the MLP's two GEMVs
                return layer.mlp.forward_fused(a + h, layer.post_attention_layernorm)
            # the residual adds ride in the norm's launch and the down product on a GPU
            x, h = layer.post_attention_layernorm.add_forward(a, h)
            return layer.mlp.forward_add(x, h)
        emb = self.embed(ids).to(dtype)
        h = self.fc(torch.cat([emb, hidden], dim=-1))
        for layer in self.layers:
            x = h if layer.input_layernorm is None else layer.input_layernorm(h)
            x, h = layer.post_attention_layernorm.add_forward(attention(layer.self_attn, x, cos_sin, attend), h)
            h = h + layer.mlp(x)
        return h

    def _layer_input(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's layer input [input_layernorm(embed(ids)) ; hidden_norm(h)]: one kernel on the GPU
        (kernels.fused.embed_norms) where the embedding table has the draft's dtype, else four ops."""
        layer = self.midlayer
        ln, hn = layer.input_layernorm, layer.hidden_norm
        table = self.embed_weight
        if (h.dim() == 2 and ids.dim() == 1 and table.dtype == h.dtype and ln.eps == hn.eps and fused_decode_enabled()
                and use_triton(h, ln.weight, hn.weight, table)):
            from ..kernels.fused import embed_norms

            return embed_norms(ids, table, h if h.stride(-1) == 1 else h.contiguous(), ln.weight, hn.weight, ln.eps)
        return torch.cat([ln(self.embed(ids).to(h.dtype)), hn(h)], dim=-1)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) from pre-norm hidden states."""
        if self.head_q is not None:
            from ..kernels import use_triton
            from ..kernels.gemv_q8 import gemv_q8, gemv_q8_reference

            x = h if self.config.kind == "eagle" else self.norm(h)
            x = x.reshape(-1, x.shape[-1]).contiguous()
            q, scale = self.head_q
            out = gemv_q8(x, q, scale) if use_triton(x) else gemv_q8_reference(x, q, scale)
            return out.reshape(*h.shape[:-1], q.shape[0])
        if self.hot_head is not None:
            return self.hot_head(h if self.config.kind == "eagle" else self.norm(h)).float()
        if self.config.kind == "eagle":
            return F.linear(h.to(self._target_head.dtype), self._target_head).float()
        if self.lm_head is not None:
            return self.lm_head(self.norm(h)).float()
        if self.head_from_target:
            if self._target_head_fn is not None:
                return self._target_head_fn(self.norm(h).to(self._target_head.dtype))
            return F.linear(self.norm(h).to(self._target_head.dtype), self._target_head).float()
        head = self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed
        return F.linear(self.norm(h).to(head.dtype), head).float()

    # ---- weights -------------------------------------------------------------------------
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        cfg, lc = self.config, self.config.layers
        params = dict(self.named_parameters())
        q, kvs = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
        rows = {"qkv_proj": [q, kvs, kvs], "gate_up_proj": [lc.intermediate_size] * 2}
        loaded: set[str] = set()
        d2t = t2d = None
        for name, t in tensors:
            local = name.removeprefix("model.")
            if local == "d2t":
                d2t = t
                continue
            if local == "t2d":
                t2d = t
                continue
            if cfg.kind == "eagle" and local in ("lm_head.weight", "layers.0.input_layernorm.weight"):
                continue  # EAGLE uses the target's head and skips the first layer's input norm
            shard = None
            for piece, (fused, idx) in self._FUSED.items():
                if f".{piece}." in local:
                    local, shard = local.replace(f".{piece}.", f".{fused}."), (fused, idx, piece)
                    break
            if local not in params:
                raise ConfigError(f"{source}: unexpected tensor {name!r} for an {cfg.kind.upper()} draft "
                                  f"(no such parameter).")
            target = params[local].data
            key = local
            if shard is not None:
                fused, idx, piece = shard
                start = sum(rows[fused][:idx])
                target = target[start:start + rows[fused][idx]]
                key = f"{local}#{piece}"
            if tuple(target.shape) != tuple(t.shape):
                hint = ""
                if local == "fc.weight" and cfg.kind == "eagle3":
                    hint = (f" (fc reads {len(cfg.aux_layer_ids)} aux layers x target hidden "
                            f"{cfg.target_hidden_size} = {cfg.fc_in}: the draft and target do not match)")
                raise ConfigError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(target.shape)}{hint}.")
            target.copy_(t.to(target.dtype))
            loaded.add(key)
        expected = set()
        for p in params:
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in p), None)
            if fused is None:
                expected.add(p)
            else:
                pieces = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
                expected.update(f"{p}#{x}" for x in pieces)
        missing = sorted(expected - loaded)
        if missing:
            raise ConfigError(f"{source}: missing tensors {[m.replace('#', ' <- ') for m in missing[:5]]} "
                              f"({len(missing)} in all).")
        if cfg.kind == "eagle3":
            self._load_vocab_map(d2t, t2d, source)

    def _load_vocab_map(self, d2t: torch.Tensor | None, t2d: torch.Tensor | None, source: str) -> None:
        cfg = self.config
        vd, v = cfg.draft_vocab_size, cfg.layers.vocab_size
        if d2t is None:
            if vd != v:
                raise ConfigError(f"{source}: draft_vocab_size={vd} < vocab_size={v} but there is no 'd2t' tensor "
                                  f"(draft id -> target id offsets).")
            return
        if tuple(d2t.shape) != (vd,):
            raise ConfigError(f"{source}: 'd2t' has shape {tuple(d2t.shape)}, expected ({vd},) (draft_vocab_size).")
        ids = d2t.long() + torch.arange(vd)
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ConfigError(f"{source}: 'd2t' maps draft ids outside the target vocabulary [0, {v}).")
        if t2d is not None and tuple(t2d.shape) != (v,):
            raise ConfigError(f"{source}: 't2d' has shape {tuple(t2d.shape)}, expected ({v},) (the target vocabulary).")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))
