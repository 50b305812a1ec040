"""Token bitmasks from grammar states, applied to logits on their device.

A bitmask row is int32 words, bit t % 32 of word t // 32 set when token t is allowed (xgrammar's layout).
Rows are filled on the host (the matchers live there), uploaded in one copy, and unpacked and applied on the
logits' device: disallowed tokens get -inf, so greedy argmax, the sampler's filters and the speculative
acceptance rules all choose among allowed tokens only.
"""
from __future__ import annotations

import torch

from .backend import GrammarState

ALL_ALLOWED = -1  # an int32 word with every bit set


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the host, every token allowed."""
    return torch.full((rows, -(-vocab // 32)), ALL_ALLOWED, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with the disallowed tokens of bitmask [N, ceil(V / 32)] (host or device) set to -inf;
    a new tensor on logits' device."""
    v = logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[..., None] >> shifts) & 1).bool().reshape(words.shape[0], -1)[:, :v]
    return logits.masked_fill(~allowed, float("-inf"))


def mask_rows(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """A plain step: row i masked by states[i]'s next-token set (rows without a state untouched).
    Returns logits itself when no row has a state."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    bitmask = new_bitmask(len(rows), logits.shape[-1])
    for k, i in enumerate(rows):
        states[i].fill(bitmask, k)
    idx = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, idx, apply_bitmask(logits.index_select(0, idx), bitmask))


def fill_tree(state: GrammarState, tokens: list[int], children: list[list[int]], bitmask: torch.Tensor,
              row0: int) -> None:
    """Masks of a draft tree's verify rows: row row0 + j gets the tokens allowed after node j, the grammar
    state once the drafts on the path root -> j are accepted (the root is the request's last token, already
    accepted). The matcher advances down each path and rolls back, so it ends where it started. A node whose
    token the grammar rejects is unreachable (its parent's row masks it out), so its subtree keeps the
    all-allowed rows."""
    state.fill(bitmask, row0)
    stack = [(c, 0) for c in reversed(children[0])]  # (node, depth of its parent)
    depth = 0  # drafts the matcher has accepted
    while stack:
        node, parent_depth = stack.pop()
        state.rollback(depth - parent_depth)
        depth = parent_depth
        if state.terminated or not state.accept(tokens[node]):
            continue
        depth += 1
        state.fill(bitmask, row0 + node)
        stack.extend((c, depth) for c in reversed(children[node]))
    state.rollback(depth)


def mask_verify_rows(logits: torch.Tensor, states: list[GrammarState | None], trees: list, width: int) -> torch.Tensor:
    """A speculative verify batch (request i's nodes at rows i * width + j): every node's row masked by the
    grammar state along its draft path. Returns logits itself when no request has a state."""
    reqs = [i for i, s in enumerate(states) if s is not None]
    if not reqs:
        return logits
    bitmask = new_bitmask(len(reqs) * width, logits.shape[-1])
    for k, i in enumerate(reqs):
        fill_tree(states[i], trees[i].tokens, trees[i].children, bitmask, k * width)
    rows = torch.tensor([i * width + j for i in reqs for j in range(width)], device=logits.device)
    return logits.index_copy(0, rows, apply_bitmask(logits.index_select(0, rows), bitmask))
