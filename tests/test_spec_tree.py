"""EAGLE-2 re-ranking on the device (tree.select_tree_nodes_batched) against the host's select_tree_nodes:
the same kept candidates and the same tree, for candidate sets built as the draft loop builds them, ties
included (quantized probabilities make equal cumulative scores common)."""
from __future__ import annotations

import pytest
import torch

from tercel.speculative.tree import DraftTree, select_tree_nodes, select_tree_nodes_batched, tree_masks


def _candidates(g: torch.Generator, b: int, k: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores / parents [B, C] as EagleTreeDraftStep lays them out: K roots' children, then K * K per step,
    each the child of one of the previous step's K best."""
    def probs(*shape):  # multiples of 1/8: ties between siblings and cousins
        return (torch.randint(1, 9, shape, generator=g) / 8.0).sort(dim=-1, descending=True).values

    leaf_scores = probs(b, k)
    scores, parents = [leaf_scores], [torch.full((b, k), -1)]
    leaf_cand, n_cand = torch.arange(k).expand(b, k), k
    for _ in range(1, steps):
        cum = (leaf_scores[:, :, None] * probs(b, k, k)).view(b, k * k)
        scores.append(cum)
        parents.append(leaf_cand[:, :, None].expand(b, k, k).reshape(b, k * k))
        best = cum.topk(k, dim=-1).indices
        leaf_scores, leaf_cand = cum.gather(1, best), n_cand + best
        n_cand += k * k
    return torch.cat(scores, 1), torch.cat(parents, 1)


@pytest.mark.parametrize("k,steps,nodes", [(4, 4, 15), (2, 5, 8), (3, 3, 30), (1, 5, 5), (4, 2, 1)])
def test_batched_re_ranking_keeps_the_hosts_tree(k, steps, nodes):
    g = torch.Generator().manual_seed(k * 100 + steps)
    scores, parents = _candidates(g, 16, k, steps)
    nodes = min(nodes, scores.shape[1])
    kept, tree_parents = select_tree_nodes_batched(scores, parents, nodes)
    for i in range(scores.shape[0]):
        want_kept, want_parents = select_tree_nodes(scores[i], parents[i], nodes)
        assert kept[i].tolist() == want_kept and tree_parents[i].tolist() == want_parents, i
        DraftTree([0] + kept[i].tolist(), [-1] + tree_parents[i].tolist())  # a valid tree: parents come first



def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node of a tree (node 0 the root) as its token path from below the root."""
    tree = DraftTree(tokens, parents)
    return {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}


@pytest.mark.parametrize("depth,k,budget", [(15, 4, 16), (7, 4, 8), (15, 4, 64), (3, 2, 2), (2, 3, 9), (5, 1, 5)])
def test_the_device_ddtree_takes_the_hosts_nodes(depth, k, budget):
    """ddtree_chain.ddtree_nodes (a beam per depth, the budget best of all beams) builds build_ddtree's tree:
    the same nodes (as token paths), parents before children, for random block marginals without ties."""
    from tercel.speculative.ddtree_chain import ddtree_nodes
    from tercel.speculative.dflash import build_ddtree

    g = torch.Generator().manual_seed(depth * 1000 + k * 10 + budget)
    b, vocab = 8, 50
    lp, tk = torch.randn(b, depth, vocab, generator=g).mul(2).log_softmax(-1).topk(k, dim=-1)
    tokens, parents = ddtree_nodes(lp, tk, budget)
    assert tokens.shape == parents.shape == (b, budget)
    for i in range(b):
        host = build_ddtree(lp[i], tk[i], 0, budget)
        dev_tokens, dev_parents = [0] + tokens[i].tolist(), [-1] + parents[i].tolist()
        assert _paths(dev_tokens, dev_parents) == _paths(host.tokens, host.parents), i


def test_batched_tree_masks_are_each_nodes_ancestors_and_padding_sees_itself():
    """tree_masks builds a verify batch's masks for every request at once (it was a per-node assignment loop per
    request on the host, 4 ms for 64 16-node trees): random trees of 1..W nodes, padded to W with parent -1."""
    g = torch.Generator().manual_seed(5)
    b, w = 32, 16
    trees, parents = [], []
    for _ in range(b):
        n = int(torch.randint(1, w + 1, (1,), generator=g))
        par = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, n)]
        trees.append(DraftTree(list(range(n)), par))
        parents += par + [-1] * (w - n)
    masks = tree_masks(torch.tensor(parents).view(b, w))
    for i, t in enumerate(trees):
        for node in range(w):
            sees = set(t.path_to(node)) if node < len(t) else {node}  # the root path, or a padding row alone
            assert set(masks[i, node].nonzero().flatten().tolist()) == sees, (i, node)
    chain = DraftTree.chain(0, [1, 2, 3])
    assert torch.equal(chain.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
