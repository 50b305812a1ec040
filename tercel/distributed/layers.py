"""The parallel pieces of a decoder forward, for a model that holds one rank's shard (shard.TPShard).

Column-parallel linears (qkv, gate_up) and row-parallel ones (o, down) need no code of their own: each
rank's Linear holds its slice (the loader cut it), so a column-parallel output is this rank's heads /
columns, and a row-parallel output is a partial sum, made whole by `all_reduce` (one after the attention
output projection, one after the MLP down projection). Row-parallel biases live on rank 0 only, so the
sum adds them once.

Logits: each rank's lm_head rows give a vocabulary slice; rank 0 gathers the slices into full logits.
Full logits (not a TP-aware argmax of (max, index) pairs) because rank 0's sampler, penalties, logprobs
and speculative rejection sampling all read the whole distribution; the gather is one [rows, V] fp32
transfer per forward, small next to the weights each step reads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .parallel_state import TPGroup
from .shard import TPShard


@dataclass(slots=True)
class TensorParallel:
    """What a sharded model needs at forward time. mirror: rank 0 only, sends each forward's batch to
    the followers before running it (comm.send_forward); None on the followers."""

    group: TPGroup
    shard: TPShard
    mirror: Callable | None = None

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial.contiguous())

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's slice are zero here and filled by another rank."""
        start, end = self.shard.vocab
        inside = (ids >= start) & (ids < end)
        h = F.embedding((ids - start) * inside, weight)
        h = h * inside.unsqueeze(-1).to(h.dtype)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, V / size] on every rank -> [rows, V] on rank 0 (the followers' result is unused)."""
        return self.group.gather_cat(local, dim=-1)


class ReplicatedHead:
    """Rank 0's whole embedding and lm_head, for drafts (EAGLE / EAGLE-3 / DFlash), which run on rank 0
    alone, unsplit: a one-layer draft's step is tiny, and two all-reduces per draft layer per draft step
    would cost more than splitting it saves. Offers what a draft reads of a target (models.interface):
    embed_tokens, lm_head_weight, compute_logits."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head_weight = head

    @classmethod
    def load(cls, model, cfg, dtype: torch.dtype, device: torch.device) -> "ReplicatedHead":
        from ..loader.model_loader import read_checkpoint
        from .loader import read_full

        names = ("model.embed_tokens.weight",) + (() if cfg.tie_word_embeddings else ("lm_head.weight",))
        full = {k: v.to(device, dtype) for k, v in read_full(read_checkpoint(model), names).items()}
        embed = full["model.embed_tokens.weight"]
        return cls(embed, embed if cfg.tie_word_embeddings else full["lm_head.weight"])

    def compute_logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(normed_hidden, self.lm_head_weight).float()
