"""CPU decode and verify steps as one C++ call per decoder layer (cpu_layer_kernel.cpp).

On the CPU with a GGUF's 4-bit matrices on the Q4 x Q8 kernel (bf16, the default there), an eager Llama layer is
~60 torch ops and the Python between them: at a 135M model's size most of a token's time. CpuFusedLayers runs
each layer of a step of few rows (decode, a chain verify, a short prefill chunk) as one op instead; the
embedding, the final norm and the head stay torch ops. The residual stream stays fp32 through the layers (the
eager bf16 path rounds it to bf16 after every op), K/V go to the paged cache in its dtype, and the layer outputs
an EAGLE-3 drafter reads (aux layers) are handed over in the model's dtype.

What it does not take runs the eager layer loop: tree masks (custom attention masks), more than MAX_ROWS rows
(prefill: SDPA's blocked attention wins there), torch.compile tracing (--cpu-compile), tensor parallelism.
TERCEL_CPU_FUSED=0 keeps the eager loop for every step (side-by-side measurements); TERCEL_CPU_FUSED=fp32 also
runs an fp32 model's layers through the op, with exact fp32 matmuls on its dense weights: its greedy tokens then
equal the eager fp32 forward's (tests/test_cpu_fused.py), the check of the layer's logic on the real model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..dev_overrides import env
from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..kv import PagedKVCache
from . import cpu_q8
from .cpu_q8 import PackedQ4Q8

log = logging.getLogger(__name__)

MAX_ROWS = 64  # rows per step the fused layer takes; longer prefill chunks keep the eager loop


def mode() -> str:
    value = env("TERCEL_CPU_FUSED")
    if value not in ("0", "1", "fp32"):
        raise ValueError(f"TERCEL_CPU_FUSED={value!r}: use 1 (default), 0 (the eager layer loop) or fp32 (fp32 models "
                         f"too)")
    return value


def _f32(t: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if t is None else t.detach().float().contiguous()


def _proj(linear) -> list[torch.Tensor]:
    """The op's four tensors of a projection: Q4 x Q8 (qs, d, m) or a dense fp32 weight, then the bias."""
    packed = linear.gemv
    if packed is None:
        return [linear.weight.detach().contiguous(), torch.empty(0), torch.empty(0), _f32(linear.bias)]
    return [packed.qs, packed.d, packed.m, _f32(linear.bias)]


def _dense_fp32(linear) -> bool:
    return linear.gemv is None and linear.weight.dtype == torch.float32 and linear.weight.numel() > 0


@dataclass(slots=True)
class StepRows:
    """What the layers need to know of a step's rows, made once per forward."""
    slots: torch.Tensor  # [M] int64: the KV slot each row's K/V is stored to
    req: torch.Tensor  # [M] int64: the row's request (its block table row)
    kv_len: torch.Tensor  # [M] int64: keys the row sees (its own included)
    tables: torch.Tensor  # [B, W] int64 block tables
    cos_sin: torch.Tensor  # [M, 2 * head_dim] fp32 rotary rows

    @classmethod
    def of(cls, batch: ForwardBatch, rope_table: torch.Tensor) -> "StepRows":
        qlens, seqs = batch.query_lens, batch.seq_lens_cpu
        if all(q == 1 for q in qlens):  # decode: row i is request i, seeing its whole sequence
            req = torch.arange(len(qlens))
            kv_len = batch.seq_lens
        else:  # row o of a request with q new tokens sees its prefix and new tokens 0..o (causal), as eager
            req = torch.tensor([r for r, q in enumerate(qlens) for _ in range(q)])
            kv_len = torch.tensor([s - q + o + 1 for q, s in zip(qlens, seqs) for o in range(q)])
        return cls(batch.out_cache_loc.contiguous(), req, kv_len.contiguous(), batch.block_tables.contiguous(),
                   rope_table.index_select(0, batch.positions).float())


class CpuFusedLayers:
    """The model's decoder layers as C++ calls; `build` says whether the model can take them."""

    def __init__(self, model) -> None:
        cfg = model.config  # the model itself is not kept (it holds this object: no reference cycle)
        self.dtype = model.embed_tokens.weight.dtype
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(cfg.head_dim) ** -0.5
        self.dims = [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     cfg.sliding_window or 0]
        self.weights: list[list[torch.Tensor]] = []
        for layer in model.layers:  # the order of cpu_layer_kernel.cpp's Slot enum
            attn, mlp = layer.self_attn, layer.mlp
            self.weights.append([
                _f32(layer.input_layernorm.weight), *_proj(attn.qkv_proj),
                _f32(None if attn.q_norm is None else attn.q_norm.weight),
                _f32(None if attn.k_norm is None else attn.k_norm.weight), *_proj(attn.o_proj),
                _f32(layer.post_attention_layernorm.weight), *_proj(mlp.gate_up_proj), *_proj(mlp.down_proj)])
        self.final_norm = _f32(model.norm.weight)
        self.op = torch.ops.tercel_cpu_q8.decoder_layer

    @classmethod
    def build(cls, model) -> "CpuFusedLayers | None":
        """The fused layers when every layer's projections are on the Q4 x Q8 kernel, else None (logged once)."""
        switch = mode()
        if switch == "0" or model.tp is not None or model.config.head_dim % 2:
            return None
        linears = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        q4 = all(isinstance(lin.gemv, PackedQ4Q8) for lin in linears)
        if not q4 and not (switch == "fp32" and all(_dense_fp32(lin) for lin in linears)):
            return None
        if not q4 and cpu_q8.kernel_error() is not None:  # the op is built with the Q4 x Q8 kernel
            return None
        log.info("CPU decode and verify steps: one fused C++ call per decoder layer%s (TERCEL_CPU_FUSED=0: the "
                 "eager layer loop)", "" if q4 else ", exact fp32 matmuls")
        return cls(model)

    def unsupported(self, batch: ForwardBatch) -> str | None:
        if batch.custom_masks is not None and any(m is not None for m in batch.custom_masks):
            return "tree masks"
        if batch.input_ids.shape[0] > MAX_ROWS:
            return f"more than {MAX_ROWS} rows"
        if torch.compiler.is_compiling():
            return "traced by torch.compile"
        return None

    def forward(self, model, batch: ForwardBatch, kv: PagedKVCache, input_embeds: torch.Tensor | None) -> ModelOutput:
        """The model's forward of this batch (the model these layers were built from)."""
        embeds = model.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        h = embeds.float().contiguous()  # a copy for fp32 tensors too: the layers update it in place
        if h.data_ptr() == embeds.data_ptr():
            h = h.clone()
        rows = StepRows.of(batch, model.rope.cos_sin)
        capture = batch.capture_hidden_mode
        aux_ids = model.aux_layer_ids if capture != CaptureHiddenMode.NULL else ()
        aux: list[torch.Tensor] = []
        for i, weights in enumerate(self.weights):
            self.op(h, weights, self.dims, self.eps, self.scale, kv.k_layers[i], kv.v_layers[i], rows.slots,
                    rows.req, rows.kv_len, rows.tables, rows.cos_sin, kv.block_size)
            if i in aux_ids:
                aux.append(h.to(self.dtype, copy=True))
        normed = F.rms_norm(h, self.final_norm.shape, self.final_norm, self.eps).to(self.dtype)
        every_row = batch.logits_indices.shape[0] == h.shape[0]
        logits = model.compute_logits(normed if every_row else normed[batch.logits_indices])
        return ModelOutput(logits=logits, hidden_states=model._hidden(capture, aux, normed, batch, every_row))
