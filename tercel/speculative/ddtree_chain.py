"""The whole DDTREE step as one step kind: DFlash's block forward, the tree built from the block's marginals, the
tree verify, acceptance, the accepted path's KV compaction and the context injection, all on the device, under
the chain loop (chain_loop.py) like the DFLASH and EAGLE steps.

The tree (build_ddtree's, on the device with static shapes): a node at depth d has the top-K candidates of block
position d + 1 as children, its score the sum of the log-probabilities on its path, and the tree is the `budget`
best nodes. Children score no higher than their parents, so the best nodes of depth d are children of the best of
depth d - 1: a beam of `budget` nodes per depth (the top `budget` of the previous beam's children) holds every
node the tree can take, and the tree is the `budget` best of all beams (a stable order: a parent ranks before a
child of equal score), numbered depth by depth so that parents come before children. build_ddtree pops the same
nodes best first; only exact ties (and float32 against float64 sums) may pick another node of equal score. On a
GPU the beams are one Triton launch (kernels/ddtree_beams.py) instead of ~7 torch launches per depth.
"""
from __future__ import annotations

import torch

from ..kernels import use_triton
from .dflash_chain import DFlashChainBatch, DFlashChainOutputs, DFlashChainStep
from .eagle_steps import ChainPositions
from .tree import select_tree, top_k_probs
from .tree_chain import tree_layout, verify_tree


def beam_sizes(depth: int, topk: int, budget: int) -> list[int]:
    """The beam width of each depth (1..depth): min(budget, what the previous beam's children number)."""
    sizes, width = [], 1
    for _ in range(depth):
        width = min(budget, width * topk)
        sizes.append(width)
    return sizes


def ddtree_nodes(logprobs: torch.Tensor, tokens: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs, tokens [B, D, K] (block position d + 1's top-K, best first) -> (tree tokens, tree parents)
    [B, budget], parents as node ids (0: the root), parents before children. Needs sum(beam_sizes) >= budget."""
    b, d, k = logprobs.shape
    if use_triton(logprobs):
        from ..kernels.ddtree_beams import ddtree_beams

        scores, parents, toks = ddtree_beams(logprobs.contiguous(), tokens.contiguous(), budget,
                                             beam_sizes(d, k, budget))
        return select_tree(scores, parents, toks, budget)
    scores, toks, parents = [], [], []
    beam = logprobs[:, 0, :budget]  # depth 1: the root's children, best first
    width = beam.shape[1]
    scores.append(beam)
    toks.append(tokens[:, 0, :width])
    parents.append(torch.full((b, width), -1, dtype=torch.long, device=logprobs.device))
    offset = 0  # the candidate index of the current beam's first node
    for depth in range(1, d):
        children = (beam[:, :, None] + logprobs[:, depth, None, :]).reshape(b, width * k)
        beam, idx = children.topk(min(budget, width * k), dim=-1)  # sorted, best first
        scores.append(beam)
        toks.append(tokens[:, depth].gather(1, idx % k))
        parents.append(offset + idx // k)
        offset += width
        width = beam.shape[1]
    return select_tree(torch.cat(scores, 1), torch.cat(parents, 1), torch.cat(toks, 1), budget)


class DDTreeChainStep(DFlashChainStep):
    """DFlashChainStep's state and buffers; the block's drafts become a tree of `budget` nodes."""

    def __init__(self, target: torch.nn.Module, kv, draft, cache, block: int, max_blocks: int, budget: int,
                 topk: int, sampled: bool = False) -> None:
        super().__init__(target, kv, draft, cache, block, max_blocks, sampled)
        self.name = "ddtree_chain_sampled" if sampled else "ddtree_chain"
        self.budget, self.topk = budget, topk
        self.width = budget + 1  # N: root + the tree's nodes, all verified
        if sum(beam_sizes(block - 1, topk, budget)) < budget:
            raise ValueError(f"ddtree chain step: a block of {block} with top-{topk} candidates holds fewer than "
                             f"{budget} nodes.")

    def _step(self, s: DFlashChainBatch) -> DFlashChainOutputs:
        w, bs = self.width, self.kv.block_size
        sp = s.sampling
        # the positions base + j of the tree's rows (the RoPE table is not read here: no clamp), and of the block's
        at = ChainPositions.of(s.base, s.block_tables, bs, w, s.block_tables.shape[1] * bs)
        block_pos = (at.positions[:self.block].t() if w >= self.block
                     else s.base[:, None] + torch.arange(self.block, device=s.base.device))
        logits = self._draft_block(s, block_pos)  # [B, S - 1, V]
        lp, tk = top_k_probs(logits, self.topk, log=True)
        tree = tree_layout(s.roots, *ddtree_nodes(lp, tk, self.budget), self.block - 1)
        out, acc = verify_tree(self.target, self.kv, tree, at, s, sp)
        # the context grows by the root and the accepted path (the other rows write the dummy slot 0)
        self.draft.inject_context(out.hidden_states[acc.ext_rows], at.request_major(at.positions), acc.ext_slots,
                                  self.cache)
        if sp is not None:
            sp.advance(s.live, acc.accepted)
        return DFlashChainOutputs(acc.path_tokens, acc.accepted, acc.bonus)
