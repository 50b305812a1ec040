"""Rank 0 -> followers: the op and the ForwardBatch of every target forward, as tensors (no pickles).

One fixed-size int64 header (op code and the shapes), then one int64 payload with every index tensor
and the host lists laid end to end, then (tree verify only) one uint8 tensor with the custom masks.
Three broadcasts per forward at most; the followers rebuild the same ForwardBatch and run the same
forward on their shard, in the same order as rank 0, which is what keeps the collectives matched.
The followers never see sampled tokens: the next forward's input ids arrive in its batch.
"""
from __future__ import annotations

import enum

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch
from .parallel_state import TPGroup

HEADER_LEN = 8  # op, T, B, block-table width, logits rows, capture mode, mask bytes, spare


class Op(enum.IntEnum):
    FORWARD = 1
    SHUTDOWN = 2


def send_op(group: TPGroup, op: Op) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.long)
    header[0] = int(op)
    group.broadcast(header.to(group.device))


def send_forward(group: TPGroup, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> None:
    """Rank 0, just before running batch: the followers run it too."""
    if input_embeds is not None:
        raise NotImplementedError("tensor parallelism: a target forward from input embeddings is not mirrored")
    dev = group.device
    t, b, w = batch.input_ids.shape[0], len(batch.query_lens), batch.block_tables.shape[1]
    masks = batch.custom_masks
    mask_bytes = None
    if masks is not None:  # per request: its [q, q] mask, or all-ones standing for None (causal)
        flat = [torch.ones(q * q, dtype=torch.uint8, device=dev) if m is None else m.reshape(-1).to(dev, torch.uint8)
                for m, q in zip(masks, batch.query_lens)]
        flags = [0 if m is None else 1 for m in masks]
        mask_bytes = torch.cat(flat + [torch.tensor(flags, dtype=torch.uint8, device=dev)])
    header = torch.tensor([int(Op.FORWARD), t, b, w, batch.logits_indices.shape[0], int(batch.capture_hidden_mode),
                           -1 if mask_bytes is None else mask_bytes.numel(), 0], dtype=torch.long)
    host = torch.tensor(batch.query_lens + batch.seq_lens_cpu, dtype=torch.long).to(dev)
    payload = torch.cat([batch.input_ids.to(dev), batch.positions.to(dev), batch.out_cache_loc.to(dev),
                         batch.seq_lens.to(dev), batch.block_tables.reshape(-1).to(dev),
                         batch.logits_indices.to(dev), host])
    group.broadcast(header.to(dev))
    group.broadcast(payload)
    if mask_bytes is not None:
        group.broadcast(mask_bytes)


def recv(group: TPGroup) -> ForwardBatch | None:
    """Followers: the next forward's batch, or None when rank 0 shuts down."""
    dev = group.device
    header = group.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long, device=dev)).tolist()
    op, t, b, w, n_logits, mode, n_mask = header[:7]
    if op == Op.SHUTDOWN:
        return None
    payload = group.broadcast(torch.empty(3 * t + b + b * w + n_logits + 2 * b, dtype=torch.long, device=dev))
    ids, pos, slots, seq_lens, tables, logits, host = payload.split([t, t, t, b, b * w, n_logits, 2 * b])
    host = host.tolist()
    query_lens, seq_lens_cpu = host[:b], host[b:]
    masks = None
    if n_mask >= 0:
        raw = group.broadcast(torch.empty(n_mask, dtype=torch.uint8, device=dev))
        flags = raw[n_mask - b:].tolist()
        parts = raw[:n_mask - b].split([q * q for q in query_lens])
        masks = [p.view(q, q).bool() if f else None for p, q, f in zip(parts, query_lens, flags)]
    return ForwardBatch(input_ids=ids, positions=pos, out_cache_loc=slots, seq_lens=seq_lens,
                        block_tables=tables.view(b, w), logits_indices=logits, query_lens=query_lens,
                        seq_lens_cpu=seq_lens_cpu, custom_masks=masks, capture_hidden_mode=CaptureHiddenMode(mode))
