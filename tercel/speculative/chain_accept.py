"""Greedy acceptance of a chained step and the request state it leaves, on the device with no host sync.

From the target's token at each of a request's W rows (root + W - 1 drafts) and the drafted tokens: k, the
accepted drafts (the run of leading drafts equal to the target's token before them), the bonus (the target's
token after them), draft_extend's inputs (row j < k reads accepted draft j + 1, row k the bonus; rows past k
write the dummy slot 0), and, in place, the next step's root and base for live requests (padding requests
keep base 0). On a GPU one Triton launch (kernels/chain_accept.py) instead of ~30 small torch ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import use_triton
from .verify import accept_greedy_batched


@dataclass(slots=True)
class ChainAccepted:
    accepted: torch.Tensor  # [B] k
    bonus: torch.Tensor  # [B]
    ext_ids: torch.Tensor  # [B * W] draft_extend's token per row
    ext_slots: torch.Tensor  # [B * W] its KV slot (0: the dummy slot)
    ext_seq_lens: torch.Tensor  # [B] the old base + W


def chain_accept(targets: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, base: torch.Tensor,
                 live: torch.Tensor, roots: torch.Tensor) -> ChainAccepted:
    """targets, tokens [B, W]; slots [W, B] (ChainPositions.slots); base, live, roots [B] int64, base and roots
    updated in place (live rows: root = bonus, base += k + 1; padding rows: base = 0)."""
    if use_triton(tokens) and targets.is_contiguous() and tokens.is_contiguous():
        from ..kernels.chain_accept import chain_accept_rows

        return ChainAccepted(*chain_accept_rows(targets, tokens, slots, base, live.long(), roots))
    n, w = tokens.shape
    j = torch.arange(w, device=tokens.device)
    k, bonus = accept_greedy_batched(targets, tokens, torch.full((n,), w, device=tokens.device))
    kk = k[:, None]
    shifted = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    ids = torch.where(j < kk, shifted, torch.where(j == kk, bonus[:, None], torch.zeros_like(shifted)))
    ext_slots = torch.where(j <= kk, slots.t(), torch.zeros_like(tokens))
    ext_seq = base + w
    is_live = live.bool()
    roots.copy_(torch.where(is_live, bonus, roots))
    base.copy_(torch.where(is_live, base + k + 1, torch.zeros_like(base)))
    return ChainAccepted(k, bonus, ids.reshape(-1), ext_slots.reshape(-1), ext_seq)
