"""Acceptance rules for verify: which draft tokens the target keeps, and the token after them.

At every node the target picks the token plain decoding would emit there; the drafts are kept while they
carry it, and the target's token where they stop is the bonus. Greedy: the argmax. Sampling (T > 0): the
plain sampler's own draw, the exponential race argmax p / E, where E is the noise of the request's
counter-based stream for that output position (draw r.draws + depth, tercel.sampling). So a seeded
request gets exactly the tokens plain sampling gives it, whatever the drafts, the width the adaptive policy
picks or the batch, and the output law is the target's (each token is a draw from p with noise that nothing
before it has seen). For a deterministic draft (n-gram, EAGLE top-k trees, DDTree) a child x is kept with
probability p(x) and siblings with the sum of theirs: the acceptance of recursive rejection sampling. A
sampled draft (EAGLE and DFlash chains at T > 0) draws x from its own q with the same noise E, argmax q / E,
so the draft and the target agree unless p and q disagree where the noise points.

p is always the distribution the plain sampler would use at that point (tercel.sampling): the same
penalties, min_tokens mask and temperature / top-k / top-p / min-p. Penalties and min_tokens depend on the
tokens generated so far, so along a path they are evaluated with the accepted tokens appended.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..request import Request
from ..sampling import SamplingTensors, ahead_keys, processed_logits, race_keys, sample_rows, target_probs
from .tree import DraftTree


@dataclass(slots=True)
class Accepted:
    nodes: list[int]  # accepted non-root node ids, root to leaf
    bonus: int  # the target's token after the last accepted node


def context_free(req: Request) -> bool:
    """True when the next-token distribution does not depend on the generated tokens so far."""
    p = req.params
    return not p.has_penalties and not p.min_tokens


@contextmanager
def _with_generated(req: Request, tokens: list[int]):
    """Temporarily append accepted draft tokens to the request's output (for penalties/min_tokens)."""
    n = len(req.output_token_ids)
    req.output_token_ids.extend(tokens)
    try:
        yield
    finally:
        del req.output_token_ids[n:]


def _path_tokens(tree: DraftTree, nodes: list[int]) -> list[int]:
    return [tree.tokens[j] for j in nodes]


def accept_walk(tree: DraftTree, logits: torch.Tensor, req: Request) -> Accepted:
    """One request's tree on the host, for what the batched rule cannot do (penalties, min_tokens: p
    depends on the path). logits: [n, V] rows of the verify forward for this tree."""
    nodes: list[int] = []
    cur = depth = 0
    while True:
        with _with_generated(req, _path_tokens(tree, nodes)):
            if req.params.greedy:
                tok = int(processed_logits(logits[cur], req).argmax())
            else:
                p = target_probs(logits[cur], req)
                tok = int(race_keys(p[None], ahead_keys([req], torch.tensor([[depth]]))[0].to(p.device))[0])
        nxt = next((c for c in tree.children[cur] if tree.tokens[c] == tok), None)
        if nxt is None:
            return Accepted(nodes, tok)
        nodes.append(nxt)
        cur, depth = nxt, depth + 1


def accept_greedy_batched(argmax: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor,
                          parents: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                          masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a whole verify batch on the device, no host sync.

    argmax, tokens: [B, W] (the target's token at each node: its argmax, or at T > 0 the plain sampler's draw
    from sampled_targets; the node's token); lens: [B] real nodes.
    Chains (parents None): the accepted count is the run of leading drafts equal to the argmax before
    them. Trees: node j is correct when its token is the argmax at its parent; it is reachable when every
    node on its root path is correct (masks: ancestor-or-self); the deepest reachable node ends the
    accepted path (siblings carry distinct tokens, so at most one node per depth is reachable).
    Returns (the last accepted node [B], the bonus token: the argmax there [B])."""
    w = tokens.shape[1]
    real = torch.arange(w, device=tokens.device)[None, :] < lens[:, None]
    if parents is None:
        match = (tokens[:, 1:] == argmax[:, :-1]) & real[:, 1:]
        best = match.to(torch.int32).cumprod(1).sum(1).long()
    else:
        correct = (tokens == argmax.gather(1, parents.clamp(min=0))) & real & (parents >= 0)
        correct[:, 0] = True
        wrong_on_path = torch.bmm(masks.float(), (~correct).float()[..., None])[..., 0]
        reachable = (wrong_on_path == 0) & real
        best = torch.where(reachable, depth, -1).argmax(1)
    return best, argmax.gather(1, best[:, None])[:, 0]


def sampled_targets(logits: torch.Tensor, depth: torch.Tensor, reqs: list[Request],
                    exact: torch.dtype | None = None) -> torch.Tensor:
    """The token the plain sampler draws at every node of a batch, on the device, no host sync: argmax p / E
    with E the noise of draw r.draws + depth of the request's stream. logits [b, W, V]; depth [b, W] (a
    chain's row index); reqs sampled (T > 0) and context_free. Returns [b, W], for accept_greedy_batched."""
    b, w, v = logits.shape
    keys = ahead_keys(reqs, depth.to(torch.int64)).reshape(-1)
    st = SamplingTensors.of([r.params for r in reqs], v, logits.device, repeat=w)
    return sample_rows(logits.reshape(b * w, v), st, keys, exact=exact).view(b, w)
