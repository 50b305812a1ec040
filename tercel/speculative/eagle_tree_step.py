"""The EAGLE-2 tree draft loop (topk K > 1) as a step kind of the one graph runner: every draft step of a
batch in one replay, the candidates' tokens, cumulative scores and parents left on the device for the host's
re-ranking (tree.select_tree_nodes) after the step's one copy back.

Static shapes: B requests x K leaves per step, S - 1 draft forwards. Each leaf attends over its request's
paged draft KV at positions < base (the prefix) and over the loop's own earlier leaves (a dense scratch under
an ancestor mask, never written to the paged cache). On a GPU the split-KV decode kernel reads each request's
own prefix from the paged cache and its partials merge with the scratch's by log-sum-exp (`PagedPrefix`), so one
graph serves every context length at the cost of the real prefix. Elsewhere the prefix is gathered: under
capture every position the block table can hold (masked past base), eagerly the batch's longest prefix; the
scratch comes first in the key order, so the real keys fall in the same places either way and the padding is a
masked tail.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.paged_merge import PagedPrefix, attend_paged_and_dense, draft_context
from ..attention.sdpa import sdpa
from ..forward_batch import CaptureHiddenMode
from ..graphs.buffers import BufferSpec, Pad, Per
from ..kernels import use_triton
from ..kv import PagedKVCache
from ..models.eagle3 import EagleDraftModel
from .eagle_steps import _DraftStep
from .tree import select_tree, top_k_probs

Pick = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class TreeDraftBatch:
    """Inputs of the tree draft loop for B requests."""
    logits: torch.Tensor  # [B, Vd] float32: the draft state's logits (the distribution after the root)
    hidden: torch.Tensor  # [B, H] the draft's pre-norm hidden state at position base - 1
    base: torch.Tensor  # [B] the root's position (num_computed_tokens): the prefix is positions < base
    block_tables: torch.Tensor  # [B, width] zero-padded
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.base.shape[0]


@dataclass(slots=True)
class TreeCandidates:
    """Every candidate of the loop, level by level (K, then K * K per further step): C = K + (S - 1) K^2, and
    the tree of the num_draft_tokens - 1 best (EAGLE-2 re-ranking, tree.select_tree_nodes_batched)."""
    tokens: torch.Tensor  # [B, C] target ids
    scores: torch.Tensor  # [B, C] cumulative draft probability
    parents: torch.Tensor  # [B, C] the parent's candidate index (-1: the root)
    tree_tokens: torch.Tensor  # [B, N - 1] the kept candidates' target ids (parents before children)
    tree_parents: torch.Tensor  # [B, N - 1] their parents as node ids (0: the root)


class DraftAttention:
    """Attention of B x W new draft rows over (a) this loop's dense scratch of earlier leaves under an ancestor
    mask and (b) each request's paged draft KV at the prefix slots. Keys are ordered scratch first, then the
    prefix (a padded prefix is a masked tail). With write_slots the new K/V are also written to the paged cache
    (draft_extend of prefill chunks; slot 0, the dummy block, for padding rows). With `paged` (and Triton) the
    prefix is not gathered: the split-KV decode kernel attends over it and its partial results are merged with
    the scratch's by log-sum-exp."""

    def __init__(self, cache: PagedKVCache, prefix_slots: torch.Tensor | None, prefix_valid: torch.Tensor | None,
                 capacity: int, scale: float, paged: PagedPrefix | None = None) -> None:
        self.cache = cache
        self.prefix_slots, self.prefix_valid = prefix_slots, prefix_valid
        self.paged = paged
        self.b = prefix_slots.shape[0] if prefix_slots is not None else paged.num_requests
        self.capacity = capacity
        self.scale = scale
        self.block_k: dict[int, torch.Tensor] = {}
        self.block_v: dict[int, torch.Tensor] = {}
        self.prefix_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries: torch.Tensor | None = None  # [W] scratch entries the new rows take (set per step)
        self.mask: torch.Tensor | None = None  # [B, W, capacity] which scratch entries each new row sees
        self.write_slots: torch.Tensor | None = None  # [B * W] paged slots to write, or None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.b
        w = q.shape[0] // b
        if self.write_slots is not None:
            self.cache.write(layer, self.write_slots, k, v)
        if layer not in self.block_k:
            shape = (b, self.capacity, k.shape[1], k.shape[2])
            self.block_k[layer] = k.new_zeros(shape)
            self.block_v[layer] = v.new_zeros(shape)
            if self.paged is None:
                self.prefix_kv[layer] = (self.cache.k[layer][self.prefix_slots],
                                         self.cache.v[layer][self.prefix_slots])
        bk, bv = self.block_k[layer], self.block_v[layer]
        bk[:, self.entries] = k.view(b, w, *k.shape[1:])
        bv[:, self.entries] = v.view(b, w, *v.shape[1:])
        if self.paged is not None:
            out = attend_paged_and_dense(q, self.cache.k[layer], self.cache.v[layer], self.paged, bk, bv, self.mask,
                                         self.scale)
            return out.reshape(b * w, -1)
        pk, pv = self.prefix_kv[layer]
        keys = torch.cat([bk, pk], dim=1).transpose(1, 2)  # [B, Hkv, C + P, D]
        values = torch.cat([bv, pv], dim=1).transpose(1, 2)
        mask = torch.cat([self.mask, self.prefix_valid[:, None, :].expand(b, w, -1)], dim=2)[:, None]
        qb = q.view(b, w, q.shape[1], q.shape[2]).transpose(1, 2)  # [B, H, W, D]
        out = sdpa(qb, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * w, -1)


class EagleTreeDraftStep(_DraftStep):
    name = "draft_tree"
    tokens_per_request = 1

    def __init__(self, model: EagleDraftModel, kv: PagedKVCache, backend, max_blocks: int, max_position: int,
                 num_steps: int, topk: int, num_draft_tokens: int, scale: float) -> None:
        super().__init__(model, kv, backend, max_blocks, max_position)
        self.num_steps, self.topk, self.scale = num_steps, topk, scale
        self.num_nodes = num_draft_tokens - 1  # drafts kept in the tree (the root is the request's last token)

    def buffer_specs(self) -> list[BufferSpec]:
        return [
            BufferSpec("logits", Per.REQUEST, torch.float32, Pad.ZERO, shape=(self.model.vocab_size,)),
            BufferSpec("hidden", Per.REQUEST, self.model.fc.weight.dtype, Pad.ZERO, shape=(self.model.hidden_size,)),
            BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),  # a padded request has no prefix
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
        ]

    def unsupported(self, batch: TreeDraftBatch) -> str | None:
        if batch.logits.shape[1] != self.model.vocab_size:
            return f"draft logits of width {batch.logits.shape[1]}, captured {self.model.vocab_size}"
        return self._width_reason(batch.block_tables)

    def live_inputs(self, batch: TreeDraftBatch) -> dict[str, torch.Tensor]:
        return {"logits": batch.logits, "hidden": batch.hidden, "base": batch.base,
                "block_tables": batch.block_tables}

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,
                     mode: CaptureHiddenMode) -> TreeDraftBatch:
        return TreeDraftBatch(views["logits"], views["hidden"], views["base"], views["block_tables"])

    def forward(self, static: TreeDraftBatch) -> TreeCandidates:
        return self.body(static, static.block_tables.shape[1] * self.kv.block_size)

    def eager(self, batch: TreeDraftBatch, prefix_len: int | None = None,
              pick: "Pick | None" = None) -> TreeCandidates:
        """prefix_len: the batch's longest prefix (default: what its block tables hold); pick: see body."""
        width = batch.block_tables.shape[1] * self.kv.block_size
        return self.body(batch, width if prefix_len is None else prefix_len, pick)

    def live_outputs(self, out: TreeCandidates, num_live: int, mode: CaptureHiddenMode) -> TreeCandidates:
        return TreeCandidates(*(t[:num_live] for t in (out.tokens, out.scores, out.parents, out.tree_tokens,
                                                        out.tree_parents)))

    def body(self, b: TreeDraftBatch, prefix_len: int, pick: "Pick | None" = None) -> TreeCandidates:
        """Step 0 takes the top K of the state's logits; each further step runs the K current leaves through
        the draft at once and expands each into its top K children, keeping the K best by cumulative
        probability as the next leaves. pick(logits [B, K', Vd], step): (scores, draft ids) [B, K', K] in
        place of the top K (an unchained sampled chain draws its rows; eager only)."""
        pick = pick or self._top_k
        model, k, steps = self.model, self.topk, self.num_steps
        n, dev = b.base.shape[0], b.base.device
        cap = max(1, (steps - 1) * k)
        prefix_slots, prefix_valid, paged = draft_context(b.block_tables, b.base, prefix_len, k, self.kv, b.hidden)
        attn = DraftAttention(self.kv, prefix_slots, prefix_valid, cap, self.scale, paged)
        fused = use_triton(b.logits)
        # every candidate of the loop, level by level (K, then K * K per further step), and the scratch entries'
        # ancestor-or-self rows: the expansion writes each draft step's rows before the next step reads them
        n_cand = k + (steps - 1) * k * k
        cand = (torch.empty(n, n_cand, dtype=torch.long, device=dev),
                torch.empty(n, n_cand, dtype=torch.float32, device=dev),
                torch.empty(n, n_cand, dtype=torch.long, device=dev))
        ancestors = (torch.empty if fused else torch.zeros)(n, cap, cap, dtype=torch.bool, device=dev)
        entries = torch.arange(cap, device=dev)  # scratch entry of every draft step's leaves: step s takes a slice
        # every draft step's RoPE position at once: step s's leaves sit at base + s - 1
        positions = (b.base[:, None] + torch.arange(steps, device=dev)).clamp(max=self.max_position)
        expand = _expand_fused if fused else self._expand_torch
        scores, ids = pick(b.logits[:, None], 0)  # [B, 1, K]
        leaves = expand(scores, ids, None, self._map(), b.hidden[:, None] if steps > 1 else None,
                        ancestors if steps > 1 else None, cand, 0, 0, 0)
        for step in range(1, steps):
            e0 = (step - 1) * k
            attn.entries, attn.mask = entries[e0:e0 + k], ancestors[:, e0:e0 + k]
            pos = positions[:, step - 1, None].expand(n, k)
            h_out = model(leaves.tokens.reshape(-1), leaves.hidden.reshape(n * k, -1), pos.reshape(-1), attn,
                          from_target=False).view(n, k, -1)
            scores, ids = pick(model.compute_logits(h_out), step)  # [B, K, K]
            last = step == steps - 1  # no next draft step: its leaves' hidden states and ancestors are not needed
            leaves = expand(scores, ids, leaves, self._map(), None if last else h_out.contiguous(),
                            None if last else ancestors, cand, k + e0 * k, e0, step * k)
        tree_tokens, tree_parents = select_tree(cand[1], cand[2], cand[0], min(self.num_nodes, n_cand))
        return TreeCandidates(*cand, tree_tokens, tree_parents)

    def _map(self) -> torch.Tensor | None:
        return self.model.draft_to_target if self.model.maps_vocab else None

    @staticmethod
    def _expand_torch(scores: torch.Tensor, ids: torch.Tensor, leaves: "_Leaves | None", vocab_map: torch.Tensor | None,
                      hidden: torch.Tensor | None, ancestors: torch.Tensor | None,
                      cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], off: int, e_prev: int,
                      e_next: int) -> "_Leaves":
        """kernels/tree_draft.tree_expand in torch ops (its contract; the next leaves in topk's order)."""
        n, p, k = scores.shape
        dev = scores.device
        tokens = (vocab_map[ids] if vocab_map is not None else ids).view(n, p * k)
        if leaves is None:
            cum = scores.view(n, k)
            parents = torch.full((n, k), -1, dtype=torch.long, device=dev)
        else:
            cum = (leaves.scores[:, :, None] * scores).view(n, p * k)
            parents = leaves.cand[:, :, None].expand(n, p, k).reshape(n, p * k)
        for slab, t in zip(cand, (tokens, cum, parents)):
            slab[:, off:off + p * k] = t
        # [B, K]: the next leaves (the root's children: the pick's own order)
        best = torch.arange(k, device=dev).expand(n, k) if leaves is None else cum.topk(k, dim=-1).indices
        parent = best // k  # the leaf each came from
        rows = torch.arange(n, device=dev)[:, None]
        if ancestors is not None:
            if leaves is not None:
                ancestors[:, e_next:e_next + k] = ancestors[rows, e_prev + parent]
            ancestors[:, e_next:e_next + k, e_next:e_next + k].diagonal(dim1=1, dim2=2).fill_(True)
        return _Leaves(tokens.gather(1, best), cum.gather(1, best), off + best,
                       None if hidden is None else hidden[rows, parent])

    def _top_k(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k_probs(logits, self.topk)


@dataclass(slots=True)
class _Leaves:
    """The tree draft loop's current leaves, K per request, best first."""
    tokens: torch.Tensor  # [B, K] target ids
    scores: torch.Tensor  # [B, K] cumulative draft probability
    cand: torch.Tensor  # [B, K] candidate index
    hidden: torch.Tensor | None  # [B, K, H] the draft output each grew from (what the next draft step reads)


def _expand_fused(scores: torch.Tensor, ids: torch.Tensor, leaves: _Leaves | None, vocab_map: torch.Tensor | None,
                  hidden: torch.Tensor | None, ancestors: torch.Tensor | None,
                  cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], off: int, e_prev: int, e_next: int) -> _Leaves:
    from ..kernels.tree_draft import tree_expand

    return _Leaves(*tree_expand(scores.contiguous(), ids.contiguous(), None if leaves is None else leaves.scores,
                                None if leaves is None else leaves.cand, vocab_map, hidden, ancestors, cand, off,
                                e_prev, e_next))
