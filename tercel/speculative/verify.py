"""Acceptance rules for verify: which draft tokens the target keeps, and the token after them.

Greedy: follow the tree while a child carries the target's argmax; the argmax where it stops is the
bonus token. Sampling (T > 0): recursive rejection sampling, exactly lossless. At a node with target
distribution p, the children are tried in order; child token x drawn from proposal q is accepted with
probability min(1, p(x) / q(x)); on rejection p becomes normalize(max(p - q, 0)) and the next child is
tried; when no child is left the bonus token is drawn from the current p. A deterministic draft
(n-gram, EAGLE top-k tree) has q = one-hot, so acceptance is p(x) and the residual is p with x removed.

p is always the distribution the plain sampler would use at that point (tercel.sampling): the same
penalties, min_tokens mask, temperature / top-k / top-p / min-p and the request's own generator.
Penalties and min_tokens depend on the tokens generated so far, so along a path they are evaluated
with the accepted tokens appended.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..request import Request
from ..sampling import (
    draw_keys,
    draw_noise,
    draw_uniform,
    filter_logits,
    greedy_tokens,
    processed_logits,
    sample_from_probs,
)
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


def accept_greedy(tree: DraftTree, logits: torch.Tensor, req: Request, argmax: list[int] | None = None) -> Accepted:
    """logits: [n, V] rows of the verify forward for this tree; argmax: their precomputed argmax
    (valid when context_free(req))."""
    nodes: list[int] = []
    cur = 0
    while True:
        if argmax is not None:
            best = argmax[cur]
        else:
            with _with_generated(req, _path_tokens(tree, nodes)):
                best = int(processed_logits(logits[cur], req).argmax())
        nxt = next((c for c in tree.children[cur] if tree.tokens[c] == best), None)
        if nxt is None:
            return Accepted(nodes, best)
        nodes.append(nxt)
        cur = nxt


def accept_sampling(tree: DraftTree, logits: torch.Tensor, req: Request) -> Accepted:
    params, gen = req.params, req.generator
    all_probs = None
    if context_free(req):  # one batched filter for every node of the tree
        all_probs = filter_logits(logits, params).softmax(-1).float().cpu()
    nodes: list[int] = []
    cur = 0
    while True:
        if all_probs is not None:
            p0 = all_probs[cur]
        else:
            with _with_generated(req, _path_tokens(tree, nodes)):
                p0 = filter_logits(processed_logits(logits[cur], req), params).softmax(-1).float().cpu()
        p = p0.clone()
        accepted = None
        for child in tree.children[cur]:
            x = tree.tokens[child]
            q = tree.q_of(child)
            px = float(p[x])
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=gen))
            if qx > 0 and u * qx < px:  # u < p(x) / q(x)
                accepted = child
                break
            if q is None:
                p[x] = 0.0
            else:
                p = (p - q.to(p)).clamp_min_(0.0)
            total = float(p.sum())
            if total <= 0.0:  # only when p == q up to rounding, where rejection had probability ~0
                p = p0.clone()
            else:
                p /= total
        if accepted is None:
            return Accepted(nodes, sample_from_probs(p, req))
        nodes.append(accepted)
        cur = accepted


def accept_greedy_batched(argmax: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor,
                          parents: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                          masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a whole verify batch on the device, no host sync.

    argmax, tokens: [B, W] (the target's argmax at each node, the node's token); lens: [B] real nodes.
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


def device_sampling_ok(req: Request, tree: DraftTree | None) -> bool:
    """accept_sampling_chains serves this request: T > 0, context-free, and a chain (None: a chain still
    on the device)."""
    return not req.params.greedy and context_free(req) and (tree is None or tree.is_chain)


def chain_proposals(trees: list[DraftTree], width: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """q of each chain's drafts as [b, W - 1, V] (a deterministic draft: one-hot), or None when every
    draft is deterministic. Rows past a chain's end are ones (never read: they are not real)."""
    if all(t.q is None or all(q is None for q in t.q[1:]) for t in trees):
        return None
    ones = torch.ones(vocab, dtype=torch.float32, device=device)
    rows = []
    for t in trees:
        for j in range(1, width):
            q = t.q_of(j) if j < len(t) else ones
            if q is None:
                q = torch.nn.functional.one_hot(torch.tensor(t.tokens[j], device=device), vocab)
            rows.append(q.to(device=device, dtype=torch.float32))
    return torch.stack(rows).view(len(trees), width - 1, vocab)  # one copy kernel, not one per row


def accept_sampling_chains(logits: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor, reqs: list[Request],
                           q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of draft chains for a batch, on the device, no host sync: the law of
    accept_sampling. logits [b, W, V], tokens [b, W] (root + drafts), lens [b] real nodes; q [b, W - 1, V]
    the distributions the drafts were drawn from (None: every draft deterministic, q one-hot); reqs pass
    device_sampling_ok. Draft i + 1 is accepted with probability min(1, p_i(x) / q_i(x)) while the drafts
    before it were; where the run stops at k the bonus is drawn from max(p_k - q_k, 0) (all accepted:
    from p_k). Each request takes one draw of its counter-based stream: W - 1 uniforms for the drafts and
    exponential noise for the bonus (the exponential race is unchanged by scaling, so the residual needs no
    renormalisation). Returns (accepted drafts k [b], bonus [b])."""
    b, w, v = logits.shape
    probs = torch.empty(b, w, v, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):  # one filter per distinct setting, as sample_batch
        p = r.params
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    for rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx).reshape(len(rows) * w, v)
        probs.index_copy_(0, idx, filter_logits(sub, reqs[rows[0]].params).softmax(-1).float().view(-1, w, v))
    keys = draw_keys(reqs)
    drafts = tokens[:, 1:]
    p_draft = probs[:, :-1].gather(2, drafts[..., None])[..., 0]  # [b, W - 1]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, drafts[..., None])[..., 0]
    u = draw_uniform(keys, v + 1, w - 1, logits.device)  # past the noise's indices 1..V
    real = torch.arange(w - 1, device=logits.device)[None, :] < (lens - 1)[:, None]
    ok = (q_draft > 0) & (u * q_draft < p_draft) & real  # u < p(x) / q(x), as the host walk
    k = ok.to(torch.int32).cumprod(1).sum(1).long()
    rows = torch.arange(b, device=logits.device)
    p_k = probs[rows, k]  # [b, V]
    rejected = k < lens - 1
    if w > 1:
        at = k.clamp(max=w - 2)
        if q is None:
            residual = p_k.scatter(1, drafts.gather(1, at[:, None]), 0.0)
        else:
            residual = (p_k - q[rows, at]).clamp_min(0.0)
        # p_k == q_k up to rounding, where rejection had probability ~0: draw from p_k, as the host walk
        keep = rejected[:, None] & (residual.sum(1, keepdim=True) > 0)
        p_k = torch.where(keep, residual, p_k)
    bonus = greedy_tokens(p_k / draw_noise(keys, v, logits.device))
    return k, bonus
