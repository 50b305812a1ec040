"""What the engine, the speculative drafters (tercel.speculative), the graph runners (tercel.graphs) and the
loader use of a target model: a family's model class implements this and registers in models.registry.

Constructor: cls(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, attn_backend: AttentionBackend),
called on the meta device; the attention backend is given (the loader picks it per device), never patched in.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from ..attention.base import AttentionBackend
    from ..config import ModelConfig
    from ..forward_batch import ForwardBatch, ModelOutput
    from ..kv import PagedKVCache
    from .cpu_linear import Q4Blocks, Q8Blocks


@runtime_checkable
class TargetModel(Protocol):
    config: ModelConfig
    max_positions: int  # positions the RoPE tables cover: the engine's default max_model_len
    attn_backend: AttentionBackend  # graphs call its capture_metadata / prepare_replay; EAGLE copies its type
    embed_tokens: nn.Embedding  # EAGLE / DFlash drafts embed with the target's table
    norm: nn.Module  # the final RMSNorm (draft training copies its weight)
    aux_layer_ids: tuple[int, ...]  # layers whose outputs a hidden capture returns (EAGLE-3, DFlash)
    # tensor parallelism (tercel.distributed.layers.TensorParallel, set by the engine after loading a shard):
    # None runs the single-process forward; a family without TP support keeps it None (tp_size 1 only)
    tp: object | None

    def __call__(self, batch: ForwardBatch, kv: PagedKVCache, input_embeds: torch.Tensor | None = None,
                 attn_meta: object | None = None) -> ModelOutput:
        """One forward over a flat batch: logits of batch.logits_indices (fp32), hidden states as
        batch.capture_hidden_mode asks. attn_meta: metadata prepared by a graph capture."""
        ...

    def compute_logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from final-normed hidden states (drafts that share the target's head)."""
        ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    @property
    def logits_exact_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype every fp32 logit's value is exact in (None: not known to be)."""
        ...

    def set_aux_layers(self, layer_ids: Iterable[int]) -> None:
        """Fix aux_layer_ids (before any graph capture); out-of-range ids raise ConfigError."""
        ...

    # ---- loading (tercel.loader.model_loader) ----
    def init_buffers(self, device: torch.device) -> None:
        """Compute the non-persistent buffers (RoPE tables) on device after `to_empty`."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Load HF-named tensors; unknown, missing or misshapen ones raise ConfigError naming `source`."""
        ...

    def pack_cpu_linears(self, q4: dict[str, Q4Blocks | Q8Blocks]) -> None:
        """bf16 on CPU: prepack the linears (GGUF 4-bit blocks by HF name stay 4-bit, a Q8_0 head 8-bit)."""
        ...
