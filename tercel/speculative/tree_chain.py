"""The whole EAGLE / EAGLE-3 tree step (topk > 1) as one step kind, like the greedy chain's (chain.py): the tree
draft loop with its EAGLE-2 re-ranking, the tree verify, acceptance, the KV compaction of the accepted path and
draft_extend, all on the device, the request state carried in the graph's own buffers.

Per request the state is (root token, the draft's logits and hidden state after the root, base = the root's
position). One replay:
  draft         EagleTreeDraftStep.body: the K-wide draft loop and the re-ranking into N - 1 nodes (parents as
                node ids, parents before children)
  tree layout   node 0 is the root; the ancestor-or-self masks by doubling the parent relation (log2 of the
                depth matrix products instead of a walk per node), depth = ancestors - 1
  verify        N rows per request: node j at KV slot base + j, RoPE position base + depth[j], under its mask
                (FULL hidden capture for draft_extend)
  accept        accept_greedy_batched over the tree (at T > 0 each node's target token is the plain sampler's
                draw of output token draws + depth), then the path from the root to the deepest accepted node
  compaction    the target's KV of path node i moves from slot base + path[i] to base + i (reads before writes,
                one gather and one scatter over every layer)
  draft_extend  the root and the accepted path (rows past k write the dummy slot), whose last row is the next
                state; the root and base move on in place
The host reads the path's tokens ([B, N]: root, the k accepted drafts, then padding), k and the bonus, exactly
what it reads from a chain step, so the chain loop (chain_loop.py) runs both. On a GPU the layout and the
acceptance are one Triton launch each (kernels/tree_accept.py) instead of ~50 torch ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch
from ..graphs.buffers import BufferSpec, Pad, Per
from ..graphs.runner import StepKind
from ..kernels import use_triton
from ..kv import PagedKVCache
from .chain import ChainOutputs, ChainSampling, sampling_buffers, verify_targets
from .eagle_steps import ChainPositions, DraftExtendBatch, EagleExtendStep
from .eagle_tree_step import EagleTreeDraftStep, TreeDraftBatch
from .verify import accept_greedy_batched


@dataclass(slots=True)
class TreeChainBatch:
    """The state a tree chain step starts from, for B requests (updated in place by the step)."""
    roots: torch.Tensor  # [B] the last sampled token
    logits: torch.Tensor  # [B, Vd] float32: the draft's distribution of the token after the root
    hidden: torch.Tensor  # [B, H] the draft's pre-norm hidden state at position base - 1
    base: torch.Tensor  # [B] the root's position
    block_tables: torch.Tensor  # [B, width] zero-padded; cover base + N (and, chained, the next step's N)
    live: torch.Tensor  # [B] 1 for a real request (padding rows: 0)
    sampling: ChainSampling | None = None  # the sampled step's per-request settings (None: greedy)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.roots.shape[0]


@dataclass(slots=True)
class TreeLayout:
    """A batch of device trees of N nodes each, node 0 the root, parents before children."""
    tokens: torch.Tensor  # [B, N] target ids
    parents: torch.Tensor  # [B, N] parent node (-1: the root)
    depth: torch.Tensor  # [B, N]
    masks: torch.Tensor  # [B, N, N] bool: node i sees node j iff j is i or one of its ancestors


def tree_layout(roots: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                max_depth: int) -> TreeLayout:
    """roots [B]; tree_tokens, tree_parents [B, N - 1] (parents as node ids, 0 = the root); max_depth: the
    deepest a node can sit (the draft loop's steps)."""
    if use_triton(tree_tokens) and tree_tokens.is_contiguous() and tree_parents.is_contiguous():
        from ..kernels.tree_accept import tree_layout_rows

        return TreeLayout(*tree_layout_rows(roots.contiguous(), tree_tokens, tree_parents, max_depth))
    n, m = tree_tokens.shape
    w = m + 1
    dev = roots.device
    parents = torch.cat([torch.full((n, 1), -1, dtype=torch.long, device=dev), tree_parents], dim=1)
    # reach[i, j] = 1 when j is i or i's parent; squaring it t times reaches ancestors up to 2^t edges up
    reach = torch.eye(w, device=dev).expand(n, w, w).clone()
    reach[:, 1:].scatter_(2, tree_parents[..., None], 1.0)
    for _ in range(math.ceil(math.log2(max(max_depth, 1)))):
        reach = (torch.bmm(reach, reach) > 0).float()
    masks = reach > 0
    depth = masks.sum(-1) - 1
    return TreeLayout(torch.cat([roots[:, None], tree_tokens], dim=1), parents, depth, masks)


@dataclass(slots=True)
class TreeAccepted:
    path_tokens: torch.Tensor  # [B, N] the root, the k accepted drafts, then the root again
    accepted: torch.Tensor  # [B] k
    bonus: torch.Tensor  # [B]
    src: torch.Tensor  # [B * (N - 1)] the target KV slots to move (0 -> 0 where nothing moves)
    dst: torch.Tensor  # [B * (N - 1)]
    ext_ids: torch.Tensor  # [B * N] draft_extend's token per row
    ext_rows: torch.Tensor  # [B * N] the verify row whose hidden state each draft_extend row reads
    ext_slots: torch.Tensor  # [B * N] its draft KV slot (0: the dummy slot)
    ext_seq_lens: torch.Tensor  # [B] the old base + N


def tree_accept(targets: torch.Tensor, tree: TreeLayout, slots: torch.Tensor, base: torch.Tensor,
                live: torch.Tensor, roots: torch.Tensor) -> TreeAccepted:
    """targets [B, N]: the target's token at each node; slots [N, B]: the KV slots of positions base + j
    (ChainPositions.slots). Updates roots and base in place (live rows: root = bonus, base += k + 1; padding
    rows: base = 0)."""
    if use_triton(targets) and targets.is_contiguous():
        from ..kernels.tree_accept import tree_accept_rows

        return TreeAccepted(*tree_accept_rows(targets, tree.tokens, tree.parents, tree.depth, tree.masks, slots, base,
                                              live.long(), roots))
    n, w = tree.tokens.shape
    dev = targets.device
    j = torch.arange(w, device=dev)
    best, bonus = accept_greedy_batched(targets, tree.tokens, torch.full((n,), w, device=dev), tree.parents,
                                        tree.depth, tree.masks)
    k = tree.depth.gather(1, best[:, None])  # [B, 1]
    on_path = tree.masks[torch.arange(n, device=dev), best]  # [B, N]: best and its ancestors
    # path[d] = the node at depth d on the path (d <= k; the root past it); off-path nodes land in column N
    path = torch.zeros(n, w + 1, dtype=torch.long, device=dev)
    path.scatter_(1, torch.where(on_path, tree.depth, w), j.expand(n, w))
    path = path[:, :w]
    path_tokens = tree.tokens.gather(1, path)
    here = slots.t()  # [B, N] the slot of position base + j
    on = (j <= k) & live.bool()[:, None]
    move = on & (path != j)
    src = torch.where(move, here.gather(1, path), 0)[:, 1:]
    dst = torch.where(move, here, 0)[:, 1:]
    # draft_extend: row j < k reads accepted token j + 1, row k the bonus; its hidden state is path node j's
    shifted = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)
    ext_ids = torch.where(j < k, shifted, torch.where(j == k, bonus[:, None], 0))
    ext_rows = torch.arange(n, device=dev)[:, None] * w + torch.where(j <= k, path, 0)
    ext_slots = torch.where(j <= k, here, 0)
    ext_seq = base + w
    is_live = live.bool()
    roots.copy_(torch.where(is_live, bonus, roots))
    base.copy_(torch.where(is_live, base + k[:, 0] + 1, 0))
    return TreeAccepted(path_tokens, k[:, 0], bonus, src.reshape(-1), dst.reshape(-1), ext_ids.reshape(-1),
                        ext_rows.reshape(-1), ext_slots.reshape(-1), ext_seq)


def verify_tree(target: torch.nn.Module, kv: PagedKVCache, tree: TreeLayout, at: ChainPositions,
                s: "TreeChainBatch | object", sp: ChainSampling | None) -> tuple[object, TreeAccepted]:
    """A chained tree step's verify, acceptance and compaction (EAGLE trees and DDTREE alike): node j at KV slot
    base + j, RoPE position base + depth[j], under its ancestor mask, FULL hidden capture; then tree_accept (root
    and base of s move on in place) and the accepted path's target KV moved to base + 1 .. base + k. s: the step's
    state (base, block_tables, live, roots); at: the positions base + j. Returns (the target's output, accepted)."""
    n, w = tree.tokens.shape
    bs = kv.block_size
    fb = ForwardBatch(input_ids=tree.tokens.reshape(-1), positions=(s.base[:, None] + tree.depth).reshape(-1),
                      out_cache_loc=at.request_major(at.slots), seq_lens=at.seq_lens[w - 1],
                      block_tables=s.block_tables, logits_indices=torch.arange(n * w, device=s.base.device),
                      query_lens=[w] * n, seq_lens_cpu=[w] * n, custom_masks=list(tree.masks.unbind(0)),
                      capture_hidden_mode=CaptureHiddenMode.FULL)
    out = target(fb, kv, attn_meta=target.attn_backend.capture_metadata(fb, bs, w))
    targets = verify_targets(out.logits, sp, tree.depth,  # sampled node j: the draw of draws + depth[j]
                             target.logits_exact_dtype)
    acc = tree_accept(targets, tree, at.slots, s.base, s.live, s.roots)
    kv.copy_slots(acc.src, acc.dst)
    return out, acc


class EagleTreeChainStep(StepKind):
    name = "spec_tree_chain"
    tokens_per_request = 1  # every buffer is per request

    def __init__(self, target: torch.nn.Module, kv: PagedKVCache, tree: EagleTreeDraftStep, extend: EagleExtendStep,
                 max_blocks: int, sampled: bool = False) -> None:
        """sampled: the step of batches with sampled (T > 0) requests: each node's target token is the plain
        sampler's draw for its output position (the drafts stay the top-K tree); greedy rows take the argmax."""
        self.target, self.kv = target, kv
        self.tree, self.extend = tree, extend
        self.sampled = sampled
        if sampled:
            self.name = "spec_tree_chain_sampled"
        self.width = extend.tokens_per_request  # N = num_draft_tokens
        self.max_blocks = max_blocks
        if tree.num_nodes + 1 != self.width:
            raise ValueError(f"tree chain step: {tree.num_nodes} draft nodes but extend width {self.width}.")

    def buffer_specs(self) -> list[BufferSpec]:
        model = self.tree.model
        return [
            BufferSpec("roots", Per.REQUEST, torch.long, Pad.ZERO),
            BufferSpec("logits", Per.REQUEST, torch.float32, Pad.ZERO, shape=(model.vocab_size,)),
            BufferSpec("hidden", Per.REQUEST, model.fc.weight.dtype, Pad.ZERO, shape=(model.hidden_size,)),
            BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
            BufferSpec("live", Per.REQUEST, torch.long, Pad.ZERO),
        ] + (sampling_buffers() if self.sampled else [])

    def unsupported(self, batch: TreeChainBatch) -> str | None:
        if batch.block_tables.shape[1] > self.max_blocks:
            return f"block table of width {batch.block_tables.shape[1]} exceeds the captured {self.max_blocks}"
        if batch.logits.shape[1] != self.tree.model.vocab_size:
            return f"draft logits of width {batch.logits.shape[1]}, captured {self.tree.model.vocab_size}"
        if self.sampled != (batch.sampling is not None):
            return "a batch of the other kind (greedy / sampled)"
        return None

    def live_inputs(self, batch: TreeChainBatch) -> dict[str, torch.Tensor]:
        out = {"roots": batch.roots, "logits": batch.logits, "hidden": batch.hidden, "base": batch.base,
               "block_tables": batch.block_tables, "live": batch.live}
        if batch.sampling is not None:
            out.update({f: getattr(batch.sampling, f) for f in ChainSampling.FIELDS})
        return out

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,
                     mode: CaptureHiddenMode) -> TreeChainBatch:
        sampling = ChainSampling(*(views[f] for f in ChainSampling.FIELDS)) if self.sampled else None
        return TreeChainBatch(views["roots"], views["logits"], views["hidden"], views["base"], views["block_tables"],
                              views["live"], sampling)

    def forward(self, static: TreeChainBatch) -> ChainOutputs:
        return self._step(static)

    def eager(self, batch: TreeChainBatch) -> ChainOutputs:
        return self._step(batch)

    def live_outputs(self, out: ChainOutputs, num_live: int, mode: CaptureHiddenMode) -> ChainOutputs:
        return ChainOutputs(*(t[:num_live] for t in (out.tokens, out.accepted, out.bonus, out.logits, out.first,
                                                     out.hidden)))

    def _step(self, s: TreeChainBatch) -> ChainOutputs:
        n, w, bs = s.roots.shape[0], self.width, self.kv.block_size
        sp = s.sampling
        # draft: the re-ranked tree, its prefix read as far as the block tables reach (the same shape eagerly)
        cand = self.tree.body(TreeDraftBatch(s.logits, s.hidden, s.base, s.block_tables),
                              s.block_tables.shape[1] * bs)
        tree = tree_layout(s.roots, cand.tree_tokens, cand.tree_parents, self.tree.num_steps)
        at = ChainPositions.of(s.base, s.block_tables, bs, w, self.tree.max_position)
        out, acc = verify_tree(self.target, self.kv, tree, at, s, sp)
        ext = self.extend.body(DraftExtendBatch(acc.ext_ids, out.hidden_states[acc.ext_rows],
                                                at.request_major(at.positions), acc.ext_slots, acc.ext_seq_lens,
                                                s.block_tables, acc.accepted, [w] * n), graph=True)
        if sp is not None:
            sp.advance(s.live, acc.accepted)
        s.logits.copy_(ext.logits)
        s.hidden.copy_(ext.hidden)
        return ChainOutputs(acc.path_tokens, acc.accepted, acc.bonus, ext.logits, ext.first, ext.hidden)
