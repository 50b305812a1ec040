"""The Llama decoder family: Llama 2/3 (optional attention / MLP biases), Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm). Implements models.interface.TargetModel; registered in models.registry.

q/k/v and gate/up projections are fused into one matmul each (fewer launches per layer);
load_weights() maps HF tensor names onto the fused parameters.

Batch-1 decode on the GPU (one token, tuned GEMVs) runs each layer as about five launches: the RMSNorms
in the prologue of the qkv and gate_up GEMVs, SwiGLU in the prologue of the down GEMV, the residual
adds in the epilogues of the o and down GEMVs, RoPE + K/V store + attention in one kernel. The residual
stream is then materialised after every sub-layer instead of flowing into the next norm's add; the
values are the same (each op rounds where its unfused kernel does), except where the tuner kept a
norm_after RMSNorm role (the rms applied to the fp32 product: closer to exact, not bit-equal). The final
norm may fold into the lm_head GEMV, which stores the fp32 logits. A role whose fused GEMV the tuner
did not keep (tercel.kernels.gemv_tune) runs its unfused ops inside the same structure.
Forwards of 2..32 rows (a verify of t tokens, a draft step, a small batch) take the same structure with
the small-M GEMMs (tercel.kernels.gemm_small: the weights read once for all rows, every fusion per row),
by the configs the tuner kept for their row bucket (2, 4, 8, 16, 32). The choice depends on the row count
only, so an eager forward and a graph replay of the same rows run the same kernels, and each row's values
do not depend on the others; a graph padded into another row bucket may (as cuBLAS may pick another
algorithm for a padded M).
With those off (the default past one row) the unfused forwards on the GPU take the norms folded into copies of
the qkv and gate_up weights (fold_norms: 8 launches a layer instead of 10); the norm's rounding then differs
(the weight x norm weight product rounded once, the 1/rms applied after the GEMM), within the dtype's precision.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ConfigError, ModelConfig
from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..kernels import SMALL_M_ROWS, fused_decode_enabled, row_bucket, small_m_enabled, use_triton
from ..kv import PagedKVCache
from .cpu_fused import CpuFusedLayers
from .cpu_linear import CpuPackedLinear, PackedInt4, Q4Blocks, Q8Blocks
from .cpu_pack import pack_head, pack_linear
from .cpu_q8 import PackedQ4Q8, PackedQ8
from .linear import Linear, linear
from .rope import RotaryEmbedding, apply_rope


def fused_config(single, by_bucket: dict, m: int):
    """A role's fused GEMV config for m rows: the batch-1 one, or the one tuned for m's row bucket
    (None: that role runs its unfused ops)."""
    return single if m == 1 else by_bucket.get(row_bucket(m))


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] times the norm weight [K] along K, in fp32, rounded once to the weight's dtype."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype).contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x, self.weight):
            from ..kernels.fused import rms_norm
            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the formula below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like HF, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on the GPU."""
        if use_triton(x, residual, self.weight):
            from ..kernels.fused import add_rms_norm
            return add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self.forward(residual), residual  # .forward: no hooks here, skip the module-call overhead


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # batch-1 decode GEMVs with their neighbours folded in (set by tercel.models.gemv_tuning; None: unfused)
        self.qkv_fused = None  # GemvConfig: input RMSNorm in the prologue
        self.o_fused = None  # GemvConfig: residual add in the epilogue
        self.qkv_fused_rows: dict = {}  # row bucket -> GemvConfig of the small-M GEMM (absent: unfused)
        self.o_fused_rows: dict = {}
        self.qkv_folded: torch.Tensor | None = None  # qkv weight x input norm weight (LlamaForCausalLM.fold_norms)

    def _attend(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend,
                batch: ForwardBatch, meta: object, kv: PagedKVCache,
                norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """norm_of: (residual, eps) when qkv came from qkv_folded: the RoPE + store kernel finishes the norm."""
        t, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        # q and k sit side by side in qkv: rotate them with one RoPE application
        qk = qkv[:, :self.q_size + self.kv_size].view(t, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        if backend.fuses_rope:  # RoPE and the K/V store in one kernel; o_proj's weight streams into L2 meanwhile
            return backend.forward_rope(self.layer, qk, v, cos_sin, batch, meta, kv, prefetch=self.o_proj.weight,
                                        norm_of=norm_of)
        qk = apply_rope(qk, *cos_sin)
        return backend.forward(self.layer, qk[:, :self.num_heads], qk[:, self.num_heads:], v, batch, meta, kv)

    def fused_configs(self, m: int) -> tuple:
        return fused_config(self.qkv_fused, self.qkv_fused_rows, m), fused_config(self.o_fused, self.o_fused_rows, m)

    def forward_fused(self, residual: torch.Tensor, norm: RMSNorm, cos_sin: tuple[torch.Tensor, torch.Tensor],
                      backend: AttentionBackend, batch: ForwardBatch, meta: object,
                      kv: PagedKVCache) -> torch.Tensor:
        """Decode / small M: residual + attn(norm(residual)), the norm and the add folded into the GEMVs."""
        from ..kernels.gemv import gemv

        qkv_c, o_c = self.fused_configs(residual.shape[0])
        if qkv_c is not None:
            qkv = gemv(residual, self.qkv_proj.weight, qkv_c, norm_weight=norm.weight, eps=norm.eps)
        else:
            qkv = linear(norm.forward(residual), self.qkv_proj.weight, self.qkv_proj.gemv, self.qkv_proj.bias)
        out = self._attend(qkv, cos_sin, backend, batch, meta, kv)
        if o_c is not None:
            return gemv(out, self.o_proj.weight, o_c, residual=residual)
        return residual + linear(out, self.o_proj.weight, self.o_proj.gemv, self.o_proj.bias)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend, batch: ForwardBatch, meta: object, kv: PagedKVCache) -> torch.Tensor:
        # linear() on the modules' tensors, not the modules: the same matmul without the module-call
        # overhead, which is a visible share of a CPU decode step (hundreds of calls per token)
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.gemv, self.qkv_proj.bias)
        out = self._attend(qkv, cos_sin, backend, batch, meta, kv)
        return linear(out, self.o_proj.weight, self.o_proj.gemv, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_fused = None  # GemvConfig: post-attention RMSNorm in the prologue (tercel.kernels.gemv_tune)
        self.down_fused = None  # GemvConfig: SwiGLU in the prologue, residual add in the epilogue
        self.gate_up_fused_rows: dict = {}  # row bucket -> GemvConfig of the small-M GEMM (absent: unfused)
        self.down_fused_rows: dict = {}
        self.gate_up_folded: torch.Tensor | None = None  # gate_up weight x post-attention norm weight (fold_norms)

    def fused_configs(self, m: int) -> tuple:
        return (fused_config(self.gate_up_fused, self.gate_up_fused_rows, m),
                fused_config(self.down_fused, self.down_fused_rows, m))

    def forward_fused(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Decode / small M: residual + mlp(norm(residual)), norm, SwiGLU and add folded into the GEMVs."""
        from ..kernels.gemv import gemv

        gate_up_c, down_c = self.fused_configs(residual.shape[0])
        if gate_up_c is not None:
            gate_up = gemv(residual, self.gate_up_proj.weight, gate_up_c, norm_weight=norm.weight, eps=norm.eps)
        else:
            gate_up = linear(norm.forward(residual), self.gate_up_proj.weight, self.gate_up_proj.gemv,
                             self.gate_up_proj.bias)
        if down_c is not None:
            return gemv(gate_up, self.down_proj.weight, down_c, silu=True, residual=residual)
        from ..kernels.fused import silu_mul
        return residual + linear(silu_mul(gate_up), self.down_proj.weight, self.down_proj.gemv, self.down_proj.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + mlp(x), the add inside the down product on the GPU (cuBLAS addmm, or the tuned batch-1 GEMV's
        residual epilogue): one launch fewer than the add after it."""
        if self.down_proj.bias is not None or x.dim() != 2 or not use_triton(x, residual) or not fused_decode_enabled():
            return residual + self.forward(x)
        from ..kernels.fused import silu_mul
        from ..kernels.gemv import GemvConfig, gemv

        act = silu_mul(linear(x, self.gate_up_proj.weight, self.gate_up_proj.gemv, self.gate_up_proj.bias))
        config = self.down_proj.gemv
        if isinstance(config, GemvConfig) and act.shape[0] == 1 and residual.is_contiguous():
            return gemv(act, self.down_proj.weight, config, residual=residual)
        return torch.addmm(residual, act, self.down_proj.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # modules bypassed: see Attention
        gate_up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.gemv, self.gate_up_proj.bias)
        if use_triton(gate_up):
            from ..kernels.fused import silu_mul
            return linear(silu_mul(gate_up), self.down_proj.weight, self.down_proj.gemv, self.down_proj.bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(F.silu(gate).mul_(up), self.down_proj.weight, self.down_proj.gemv, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 attn_backend: AttentionBackend | None = None, aux_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config = cfg
        self.max_positions = max_positions
        self.rope_dtype = dtype
        # no random init (load_weights fills every parameter): on the meta device normal_'s first call costs
        # seconds of lazy torch imports at every start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head_gemv = None  # tied head: GEMV config set by tercel.models.gemv_tuning
        self.lm_head_fused = None  # GemvConfig: final RMSNorm in the lm_head GEMV's prologue (batch-1 decode)
        self.lm_head_fused_rows: dict = {}  # row bucket -> GemvConfig: the same for small-M forwards
        # built on the meta device by the loader, the table comes from init_buffers on the real one: a meta
        # arange costs seconds of lazy torch imports at every start
        self.rope = None if torch.empty(0).is_meta else RotaryEmbedding(cfg, max_positions, dtype)
        if attn_backend is None:
            from ..attention.torch_ref import TorchAttentionBackend

            attn_backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        self.attn_backend = attn_backend
        self.aux_layer_ids: tuple[int, ...] = ()
        self.set_aux_layers(aux_layer_ids)
        # tensor parallelism (tercel.distributed.layers.TensorParallel): this model then holds one rank's
        # shard and forwards through _forward_tp; None (one process) leaves every path below unchanged
        self.tp = None
        # CPU: the decoder layers as one C++ call each (models.cpu_fused), decided once the linears are packed:
        # by the engine at start (AUTO depends on it), else at the first CPU forward; False until then
        self.cpu_fused: CpuFusedLayers | None | bool = False

    def init_buffers(self, device: torch.device) -> None:
        """The RoPE tables, computed on device (after a meta-device build and `to_empty`)."""
        self.rope = RotaryEmbedding(self.config, self.max_positions, self.rope_dtype).to(device)

    def set_aux_layers(self, layer_ids: Iterable[int]) -> None:
        """Fix which layer outputs a hidden capture returns (must happen before any graph capture).
        Id L is the OUTPUT of layer L (HF hidden_states[L + 1])."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.config.num_layers]
        if bad:
            raise ConfigError(
                f"aux hidden layer ids {bad} are out of range for a {self.config.num_layers}-layer target "
                f"(valid: 0..{self.config.num_layers - 1})."
            )
        self.aux_layer_ids = ids

    @property
    def logits_exact_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype every logit's value is exact in (each head kernel rounds its product to the model's
        dtype before widening to float32, as an op in that dtype rounds), or None (a float32 model, or the CPU's packed
        heads): a GPU sort may take the logits in it, half the radix passes for the same order."""
        w = self.lm_head_weight
        return w.dtype if w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) else None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def lm_head_config(self):
        """The head's kernel choice (GemvConfig / CpuPackedLinear / None), tied or not."""
        return self.lm_head_gemv if self.lm_head is None else self.lm_head.gemv

    def compute_logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return linear(normed_hidden, self.lm_head_weight, self.lm_head_config, out_dtype=torch.float32)

    def _fused_head(self, h: torch.Tensor, want_normed: bool, batch: ForwardBatch,
                    every_row: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fused forward: (fp32 logits, final-normed hidden or None), the final RMSNorm folded into the
        lm_head GEMV when the tuner kept that and every row wants logits (the normed rows are then made
        only if a capture needs them); otherwise the norm, and the head on the logits rows."""
        config = fused_config(self.lm_head_fused, self.lm_head_fused_rows, h.shape[0]) if every_row else None
        if config is None:
            normed = self.norm.forward(h)
            return self.compute_logits(normed if every_row else normed[batch.logits_indices]), normed
        from ..kernels.gemv import gemv

        logits = gemv(h, self.lm_head_weight, config, norm_weight=self.norm.weight, eps=self.norm.eps,
                      out_dtype=torch.float32)
        return logits, self.norm.forward(h) if want_normed else None

    def _fused_rows(self, h: torch.Tensor) -> bool:
        """1..SMALL_M_ROWS rows on the GPU, and the tuner kept a fused GEMV for that row count in some role
        of every layer. Depends on the shape only (and the switches), never on the values."""
        m = h.shape[0] if h.dim() == 2 else 0
        if not 1 <= m <= SMALL_M_ROWS or not h.is_contiguous() or not use_triton(h) or not fused_decode_enabled():
            return False
        if m > 1 and not small_m_enabled():  # tuned at load; TERCEL_SMALL_M=0 at capture keeps an engine unfused
            return False
        return all(any(c is not None for c in layer.self_attn.fused_configs(m) + layer.mlp.fused_configs(m))
                   for layer in self.layers)

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, input_embeds: torch.Tensor | None = None,
                attn_meta: object | None = None) -> ModelOutput:
        """attn_meta: metadata prepared by the caller (graph capture: attn_backend.capture_metadata)."""
        if self.tp is not None:
            return self._forward_tp(batch, kv, input_embeds, attn_meta)
        if batch.input_ids.device.type == "cpu":
            if self.cpu_fused is False:
                self.cpu_fused = CpuFusedLayers.build(self)
            if self.cpu_fused is not None and self.cpu_fused.unsupported(batch) is None:
                return self.cpu_fused.forward(self, batch, kv, input_embeds)
        meta = attn_meta if attn_meta is not None else self.attn_backend.prepare(batch, kv.block_size)
        h = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        mode = batch.capture_hidden_mode
        aux_ids = self.aux_layer_ids if mode != CaptureHiddenMode.NULL else ()
        cos_sin = self.rope.lookup(batch.positions)
        aux: list[torch.Tensor] = []
        # logits of every row (decode, verify): no gather. The rows are sorted and distinct, so as many
        # as there are tokens means all of them.
        every_row = batch.logits_indices.shape[0] == h.shape[0]
        if self._fused_rows(h):  # see the module docstring: ~5 launches per layer
            for i, layer in enumerate(self.layers):
                h = layer.self_attn.forward_fused(h, layer.input_layernorm, cos_sin, self.attn_backend, batch,
                                                  meta, kv)
                h = layer.mlp.forward_fused(h, layer.post_attention_layernorm)
                if i in aux_ids:
                    aux.append(h)
            logits, normed = self._fused_head(h, mode != CaptureHiddenMode.NULL and not self.aux_layer_ids, batch,
                                              every_row)
            return ModelOutput(logits=logits, hidden_states=self._hidden(mode, aux, normed, batch, every_row))
        else:
            normed = self._layers(h, cos_sin, batch, meta, kv, aux_ids, aux)
        logits = self.compute_logits(normed if every_row else normed[batch.logits_indices])
        return ModelOutput(logits=logits, hidden_states=self._hidden(mode, aux, normed, batch, every_row))

    def _layers(self, h: torch.Tensor, cos_sin, batch: ForwardBatch, meta: object, kv: PagedKVCache,
                aux_ids, aux: list[torch.Tensor], reduce=None) -> torch.Tensor:
        """The unfused layer loop; returns the final normed hidden and appends the aux layers' outputs to aux.
        reduce: tensor parallelism's all-reduce of each attention and MLP output (a rank's partial sums)."""
        if reduce is None and self._folds(h, meta):
            return self._layers_folded(h, cos_sin, batch, meta, kv, aux_ids, aux)
        # Residual stream h_i = h_(i-1) + attn + mlp; each add is fused into the norm that follows it,
        # so h_i materialises as `residual` at the start of layer i + 1 (and at the final norm).
        residual, delta = h, None
        for i, layer in enumerate(self.layers):
            if delta is None:
                x = layer.input_layernorm.forward(residual)
            else:
                x, residual = layer.input_layernorm.add_forward(delta, residual)
                if i - 1 in aux_ids:
                    aux.append(residual)
            # .forward, not __call__: these modules carry no hooks, and the call overhead adds up per token
            attn = layer.self_attn.forward(x, cos_sin, self.attn_backend, batch, meta, kv)
            x, residual = layer.post_attention_layernorm.add_forward(attn if reduce is None else reduce(attn),
                                                                     residual)
            delta = layer.mlp.forward(x)
            if reduce is not None:
                delta = reduce(delta)
        normed, h = self.norm.add_forward(delta, residual)
        if len(self.layers) - 1 in aux_ids:
            aux.append(h)
        return normed

    def fold_norms(self) -> bool:
        """Fold each layer's two RMSNorm weights into copies of its qkv and gate_up weights (W * g, column by
        column), for the unfused GPU forwards: RMSNorm(x) @ W^T = (x @ (W * g)^T) / rms(x), so the GEMM takes the
        residual as it is and the RoPE + store and SwiGLU kernels scale each row by its 1/rms; the residual adds ride
        in the o / down GEMMs (addmm). A verify layer then launches 8 kernels instead of 10. Not for biased
        projections, q/k norms or tensor parallelism; TERCEL_FOLD_NORMS (auto: while the copies take <= 1 GiB).
        Returns whether the copies exist. Idempotent: a model shared by several engines folds once."""
        from ..kernels import FOLD_NORMS_AUTO_BYTES, fold_norms_mode

        cfg, mode = self.config, fold_norms_mode()
        if mode == "0" or self.tp is not None or not self.layers:
            return False
        if cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias or cfg.qk_norm:
            return False
        if self.layers[0].self_attn.qkv_folded is not None:
            return True
        size = sum(w.numel() * w.element_size() for layer in self.layers
                   for w in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight))
        if mode == "auto" and size > FOLD_NORMS_AUTO_BYTES:
            return False
        with torch.no_grad():
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                attn.qkv_folded = fold_norm_weight(attn.qkv_proj.weight, layer.input_layernorm.weight)
                mlp.gate_up_folded = fold_norm_weight(mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight)
        return True

    def _folds(self, h: torch.Tensor, meta: object) -> bool:
        """This unfused forward runs with the norms folded: the copies exist, the switch allows it, and the attention
        backend runs RoPE + store as its own kernel for this batch (TERCEL_FUSED_DECODE=0, the unfused reference,
        turns it off too). Depends on the shapes and switches only."""
        if self.layers[0].self_attn.qkv_folded is None or not use_triton(h) or not fused_decode_enabled():
            return False
        from ..kernels import fold_norms_mode

        return fold_norms_mode() != "0" and self.attn_backend.stores_rope_apart(meta, h)

    def _layers_folded(self, h: torch.Tensor, cos_sin, batch: ForwardBatch, meta: object, kv: PagedKVCache,
                       aux_ids, aux: list[torch.Tensor]) -> torch.Tensor:
        """_layers with the norms folded (fold_norms): per layer qkv GEMM, RoPE + store (finishing the input norm),
        attention, o GEMM + residual, gate_up GEMM, SwiGLU (finishing the post-attention norm), down GEMM + residual."""
        from ..kernels.fused import silu_mul

        residual = h if h.is_contiguous() else h.contiguous()
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(residual, attn.qkv_folded)
            out = attn._attend(qkv, cos_sin, self.attn_backend, batch, meta, kv,
                               norm_of=(residual, layer.input_layernorm.eps))
            residual = torch.addmm(residual, out.reshape(residual.shape[0], -1), attn.o_proj.weight.t())
            act = silu_mul(F.linear(residual, mlp.gate_up_folded), norm_of=(residual,
                                                                              layer.post_attention_layernorm.eps))
            residual = torch.addmm(residual, act, mlp.down_proj.weight.t())
            if i in aux_ids:
                aux.append(residual)
        return self.norm.forward(residual)

    def _forward_tp(self, batch: ForwardBatch, kv: PagedKVCache, input_embeds: torch.Tensor | None,
                    attn_meta: object | None) -> ModelOutput:
        """One rank's share of a tensor-parallel forward (docs/parallel.md): the unfused layer loop on this
        rank's heads and MLP columns, the attention and MLP outputs summed over ranks, vocab-parallel
        embedding and head. Rank 0 first sends the batch to the followers (tp.mirror), who run the same."""
        tp = self.tp
        if tp.mirror is not None:
            tp.mirror(batch, input_embeds)
        meta = attn_meta if attn_meta is not None else self.attn_backend.prepare(batch, kv.block_size)
        h = tp.embed(batch.input_ids, self.embed_tokens.weight) if input_embeds is None else input_embeds
        mode = batch.capture_hidden_mode
        aux_ids = self.aux_layer_ids if mode != CaptureHiddenMode.NULL else ()
        cos_sin = self.rope.lookup(batch.positions)
        aux: list[torch.Tensor] = []
        every_row = batch.logits_indices.shape[0] == h.shape[0]
        # the residual stream is whole after each all-reduce: aux capture works as on one rank
        normed = self._layers(h, cos_sin, batch, meta, kv, aux_ids, aux, reduce=tp.all_reduce)
        logits = tp.gather_logits(self.compute_logits(normed if every_row else normed[batch.logits_indices]))
        return ModelOutput(logits=logits, hidden_states=self._hidden(mode, aux, normed, batch, every_row))

    def _hidden(self, mode: CaptureHiddenMode, aux: list[torch.Tensor], normed: torch.Tensor | None,
                batch: ForwardBatch, every_row: bool) -> torch.Tensor | None:
        """What the capture-hidden mode asks for: the aux layers concatenated (EAGLE-3), else the final
        normed hidden; FULL: every token's row, LAST: the logits rows'."""
        if mode == CaptureHiddenMode.NULL:
            return None
        full = torch.cat(aux, dim=-1) if self.aux_layer_ids else normed
        return full if mode == CaptureHiddenMode.FULL or every_row else full[batch.logits_indices]

    # ---- weights -------------------------------------------------------------------------
    def pack_cpu_linears(self, q4: dict[str, Q4Blocks | Q8Blocks]) -> None:
        """bf16 on CPU: give every linear a prepacked kernel (models.cpu_linear). A fused projection
        whose HF parts all came as GGUF 4-bit blocks (`q4`, by HF name) stays 4-bit, and its dense
        copy is dropped; a head that came as Q8_0 blocks stays 8-bit; the rest are packed dense."""
        def pack(module: Linear, parts: list[str], head: bool = False) -> CpuPackedLinear:
            blocks = [q4.get(p) for p in parts]
            if head:
                packed = pack_head(module.weight, blocks[0])
            else:
                whole = all(isinstance(b, Q4Blocks) for b in blocks)
                packed = pack_linear(module.weight, Q4Blocks.cat(blocks) if whole else None)
            if isinstance(packed, (PackedInt4, PackedQ4Q8, PackedQ8)):
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            return packed

        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj.gemv = pack(attn.qkv_proj, [f"{pre}self_attn.{p}_proj.weight" for p in "qkv"])
            attn.o_proj.gemv = pack(attn.o_proj, [f"{pre}self_attn.o_proj.weight"])
            mlp.gate_up_proj.gemv = pack(mlp.gate_up_proj, [f"{pre}mlp.{p}_proj.weight" for p in ("gate", "up")])
            mlp.down_proj.gemv = pack(mlp.down_proj, [f"{pre}mlp.down_proj.weight"])
        if self.lm_head is None:  # tied: the embedding table stays for lookups, the head gets its own packing
            self.lm_head_gemv = pack_head(self.embed_tokens.weight, q4.get("model.embed_tokens.weight"))
        else:
            self.lm_head.gemv = pack(self.lm_head, ["lm_head.weight"], head=True)

    _FUSED = {  # HF name piece -> (fused parameter piece, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Load HF-named tensors ('model.layers.3.self_attn.q_proj.weight', ...); checks names and shapes."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        q, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shard_rows = {"qkv_proj": [q, kvs, kvs], "gate_up_proj": [cfg.intermediate_size] * 2}
        for name, tensor in tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            local = name.removeprefix("model.")
            if local == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store a copy
            shard = None
            for piece, (fused, idx) in self._FUSED.items():
                if f".{piece}." in local:
                    local, shard = local.replace(f".{piece}.", f".{fused}."), (fused, idx, piece)
                    break
            if local not in params:
                raise ConfigError(f"{source}: unexpected tensor {name!r} "
                                  f"(no such parameter in a {cfg.architecture} model).")
            param = params[local]
            if shard is None:
                target = param.data
            else:
                fused, idx, piece = shard
                rows = shard_rows[fused]
                start = sum(rows[:idx])
                target = param.data[start:start + rows[idx]]
                loaded_key = f"{local}#{piece}"
            if tuple(target.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} "
                    f"for this config."
                )
            target.copy_(tensor.to(target.dtype))
            loaded.add(loaded_key if shard is not None else local)
        expected: set[str] = set()
        for pname in params:
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in pname), None)
            if fused is None:
                expected.add(pname)
                continue
            pieces = ["q_proj", "k_proj", "v_proj"] if fused == "qkv_proj" else ["gate_proj", "up_proj"]
            expected.update(f"{pname}#{p}" for p in pieces)
        missing = sorted(expected - loaded)
        if missing:
            shown = [m.replace("#", " <- ") for m in missing[:5]]
            raise ConfigError(f"{source}: missing tensors {shown}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} in all).")
