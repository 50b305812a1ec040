"""Draft trees: the candidates one request sends to verify, and EAGLE-2 re-ranking.

Node 0 is the root: the request's last sampled token, whose KV is not yet in the cache. Every
other node is a draft token; parents come before children (topological order), so a verify batch
can place node j at KV slot `root_pos + j` while its RoPE position is `root_pos + depth[j]`.
A chain is the tree where parents[j] = j - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import TOPK_ROWS_MAX_K, use_triton


@dataclass(slots=True)
class DraftTree:
    tokens: list[int]  # [n] target-vocabulary ids; tokens[0] is the root
    parents: list[int]  # [n] parents[0] == -1, parents[j] < j
    depth: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or self.parents[0] != -1:
            raise ValueError("a draft tree needs one parent per node and parents[0] == -1")
        self.depth = [0] * n
        self.children = [[] for _ in range(n)]
        for j in range(1, n):
            p = self.parents[j]
            if not 0 <= p < j:
                raise ValueError(f"node {j} has parent {p}: parents must come before children")
            self.depth[j] = self.depth[p] + 1
            self.children[p].append(j)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        return cls([root, *drafts], list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def truncated(self, n: int) -> "DraftTree":
        """The first n nodes (still a tree: parents come first)."""
        if n >= len(self):
            return self
        return DraftTree(self.tokens[:n], self.parents[:n])

    def attention_mask(self) -> torch.Tensor:
        """[n, n] bool: node i sees node j iff j is i or an ancestor of i (the tree attention mask)."""
        return tree_masks(torch.tensor([self.parents]))[0]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included (the retrieve indices of that path)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def tree_masks(parents: torch.Tensor) -> torch.Tensor:
    """[B, W, W] bool tree attention masks from parents [B, W] (-1: a root, or a padding row that sees only
    itself): row i sees i and its ancestors. One pass per tree level for the whole batch (0.6 ms for 64 random
    16-node trees on the CI host, where an assignment per request and node took 4 ms)."""
    b, w = parents.shape
    masks = torch.eye(w, dtype=torch.bool).repeat(b, 1, 1)
    rows = torch.arange(b).unsqueeze(1).expand(b, w)
    nodes = torch.arange(w).unsqueeze(0).expand(b, w)
    anc = parents.long()
    for _ in range(w - 1):  # anc: each node's ancestor one level further up (-1 past the root)
        live = anc >= 0
        if not bool(live.any()):
            break
        masks[rows[live], nodes[live], anc[live]] = True
        anc = torch.where(live, parents.gather(1, anc.clamp(min=0)), anc)
    return masks


def select_tree_nodes(scores: torch.Tensor, parents: torch.Tensor, num_nodes: int) -> tuple[list[int], list[int]]:
    """EAGLE-2 re-ranking: keep the `num_nodes` candidates with the highest cumulative probability.

    scores: [C] cumulative draft probability of every candidate; parents: [C] the candidate index of
    each candidate's parent (-1: the root), parents before children. A child's score is its parent's
    times a probability <= 1, so a stable descending sort ranks every parent before its children and
    the kept set is closed under taking parents. Returns (kept candidate indices in ascending order,
    their parents as positions in that kept list + 1, i.e. tree node ids with 0 = root).
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:num_nodes]
    kept = sorted(order.tolist())
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    par = parents.tolist()
    tree_parents = []
    for c in kept:
        p = par[c]
        tree_parents.append(0 if p < 0 else node_of[p])  # KeyError here would mean a broken score order
    return kept, tree_parents


def select_tree_nodes_batched(scores: torch.Tensor, parents: torch.Tensor,
                              num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_tree_nodes for a batch, on the device and with static shapes (graph-safe): scores / parents
    [B, C] -> (kept [B, num_nodes] candidate indices in ascending order, their tree parents [B, num_nodes]
    as node ids, 0 = the root). The same stable descending order as the host's, so the same trees."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :num_nodes]
    kept = torch.sort(order, dim=-1).values
    b, c = scores.shape
    node_of = torch.zeros(b, c, dtype=torch.long, device=scores.device)
    node_of.scatter_(1, kept, torch.arange(1, num_nodes + 1, device=scores.device).expand(b, -1))
    par = parents.gather(1, kept)
    return kept, torch.where(par < 0, torch.zeros_like(par), node_of.gather(1, par.clamp(min=0)))


def select_tree(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor,
                num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_tree_nodes_batched, then the kept candidates' tokens: (tree tokens, tree parents) [B, num_nodes]. On a
    GPU one Triton launch (kernels/tree_draft.py) instead of two sorts, a scatter and ~9 more."""
    if use_triton(scores) and num_nodes <= scores.shape[1]:
        from ..kernels.tree_draft import TREE_SELECT_MAX_CANDIDATES, tree_select

        if scores.shape[1] <= TREE_SELECT_MAX_CANDIDATES:
            return tree_select(scores.float().contiguous(), parents.contiguous(), tokens.contiguous(),
                               num_nodes)
    kept, tree_parents = select_tree_nodes_batched(scores, parents, num_nodes)
    return tokens.gather(1, kept), tree_parents


def top_k_probs(logits: torch.Tensor, k: int, log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of logits [..., V]: (probabilities, or log-probabilities with log, float32,
    largest first; ids), as `logits.float().softmax(-1).topk(k)`. A tree draft's expansion: on a GPU two Triton
    launches (kernels/topk_rows.py) instead of a softmax and a radix select over the vocabulary."""
    if use_triton(logits) and k <= TOPK_ROWS_MAX_K and logits.shape[-1] >= k and logits.numel():
        from ..kernels.topk_rows import softmax_topk_rows

        flat = logits.reshape(-1, logits.shape[-1])
        values, ids = softmax_topk_rows(flat if flat.stride(-1) == 1 else flat.contiguous(), k, log)
        return values.view(*logits.shape[:-1], k), ids.view(*logits.shape[:-1], k)
    x = logits.float()
    return (x.log_softmax(-1) if log else x.softmax(-1)).topk(k, dim=-1)
