"""DFlash drafting: one draft forward per block, verified as a chain (DFLASH) or as a tree built
from the block's per-position top-k under a node budget (DDTREE).

State per request (Request.spec_state): how many leading positions have their target context
injected into the draft cache. The draft cache shares the target pool's slot layout (same block
tables), so context K/V of position p lives at the same slot as the target's K/V of p.

Sampling (T > 0), DFLASH: drafts are sampled from the draft's own filtered distribution q (the
request's temperature / top-k / top-p / min-p) and verified by full rejection sampling with that q
(the reference's rule). DDTREE: the tree's tokens are the draft's top-k per position, a deterministic
choice, so verify treats each as q = one-hot (recursive rejection over siblings); both are lossless.
"""
from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

import torch

from ..batching import RowSpan, blocks_covering, build_batch, padded_tables
from ..executor import DRAFT_BLOCK
from ..forward_batch import CaptureHiddenMode
from ..graphs.runner import CudaGraphRunner, GraphConfig
from ..kv import PagedKVCache
from ..loader.drafts import load_dflash
from ..models.dflash import DFlashDraftModel
from ..request import Request
from ..sampling import ahead_keys, draw_noise, filter_logits, race
from .dflash_block_step import BlockBatch, DFlashBlockStep
from .drafter import Drafter, ExtendedChunk
from .host import SpecEngine
from .tree import DraftTree, top_k_probs
from .verify import Accepted


@dataclass(slots=True)
class DFlashState:
    context_len: int = 0  # positions [0, context_len) are injected


def build_ddtree(logprobs: torch.Tensor, tokens: torch.Tensor, root: int, budget: int) -> DraftTree:
    """Best-first tree over per-position candidates. logprobs/tokens: [S, k] (position d+1 of the block
    -> candidates sorted by draft log-probability). A node at depth d has the k candidates of
    position d + 1 as children; nodes are taken in order of cumulative log-probability until `budget`
    draft nodes are chosen. Parents are always taken before children (a child's score is lower)."""
    lp, tk = logprobs.tolist(), tokens.tolist()
    depth_max, k = len(lp), len(lp[0]) if lp else 0
    node_tokens, parents = [root], [-1]
    heap: list[tuple[float, int, int, int]] = []  # (-score, tiebreak, parent node, candidate index at depth)
    counter = 0

    def push_children(node: int, depth: int, score: float) -> None:
        nonlocal counter
        if depth < depth_max:
            for c in range(k):
                heapq.heappush(heap, (-(score + lp[depth][c]), counter, node, depth * k + c))
                counter += 1

    node_depth_score = {0: (0, 0.0)}
    push_children(0, 0, 0.0)
    while heap and len(node_tokens) - 1 < budget:
        neg, _, parent, flat = heapq.heappop(heap)
        depth, c = divmod(flat, k)
        node = len(node_tokens)
        node_tokens.append(tk[depth][c])
        parents.append(parent)
        node_depth_score[node] = (depth + 1, -neg)
        push_children(node, depth + 1, -neg)
    return DraftTree(node_tokens, parents)


class DFlashDrafter(Drafter):
    capture_hidden_mode = CaptureHiddenMode.FULL
    has_kv = True  # the context cache: position p's K/V from the target's state at p (no lookahead)

    def __init__(self, engine: SpecEngine, draft: DFlashDraftModel, block_size: int,
                 tree_budget: int | None, tree_topk: int = 4) -> None:
        self.engine = weakref.proxy(engine)  # the engine owns the drafter: no reference cycle back to it
        self.draft = draft
        self.block_size = block_size
        self.tree_budget = tree_budget  # None: chain (DFLASH)
        self.uses_trees = tree_budget is not None
        self.tree_topk = tree_topk
        self.aux_layer_ids = draft.config.target_layer_ids
        self.mask_token_id = draft.config.mask_token_id
        # the draft's context cache mirrors the target pool slot for slot
        self.cache = PagedKVCache(draft.kv_spec(engine.kv.block_size, engine.dtype), engine.kv.num_blocks,
                                  engine.device)
        # the block forward as a step kind: eager until init_graphs captures it
        max_blocks = -(-(engine.config.max_model_len + block_size) // engine.kv.block_size) + 1
        self.block_step = DFlashBlockStep(engine.draft_target, draft, self.cache, block_size, max_blocks)
        engine.executor.register(DRAFT_BLOCK, self.block_step)

    @classmethod
    def load(cls, engine: SpecEngine, path, block_size: int | None, tree_budget: int | None) -> "DFlashDrafter":
        draft = load_dflash(path, engine.model_config, engine.dtype, engine.device, engine.config.max_model_len
                            + (block_size or 64))
        size = block_size or draft.config.block_size
        return cls(engine, draft, size, tree_budget)

    @property
    def num_draft_tokens(self) -> int:
        """Nodes verified per step, root included."""
        return self.block_size if self.tree_budget is None else self.tree_budget + 1

    # ---- draft state ---------------------------------------------------------------------
    @staticmethod
    def _state(r: Request) -> DFlashState:
        if not isinstance(r.spec_state, DFlashState):
            r.spec_state = DFlashState()
        return r.spec_state

    def ready(self, req: Request) -> bool:
        return self._state(req).context_len == req.num_computed_tokens

    def _inject(self, rows: list[int], spans: list[RowSpan], hidden: torch.Tensor) -> None:
        built = build_batch(spans, self.engine.kv.block_size)
        # one staged upload (a torch.tensor(list, device=...) each waited for the device)
        t = self.engine.executor.upload([rows, built.positions, built.slots])
        self.draft.inject_context(hidden[t[0]], t[1], t[2], self.cache)
        for s in spans:
            self._state(s.request).context_len = s.request.draft_kv_len = s.start + s.count

    def after_extend(self, chunks: list[ExtendedChunk], hidden: torch.Tensor | None) -> None:
        assert hidden is not None, "DFlash needs the target's FULL hidden states"
        rows, spans = [], []
        for c in chunks:
            st = self._state(c.request)
            if st.context_len != c.start:  # preempted and recomputing: start over from this chunk
                st.context_len = c.start
            rows += range(c.row_offset, c.row_offset + c.end - c.start)
            spans.append(RowSpan(c.request, c.start, c.end - c.start))
        self._inject(rows, spans, hidden)

    def after_verify(self, reqs: list[Request], trees: list[DraftTree], accepted: list[Accepted],
                     row_offsets: list[int], hidden: torch.Tensor | None) -> None:
        assert hidden is not None, "DFlash needs the target's FULL hidden states"
        rows, spans = [], []
        for r, acc, off in zip(reqs, accepted, row_offsets):
            nodes = [0, *acc.nodes]  # the root and the accepted drafts now hold committed positions
            base = r.num_computed_tokens - len(nodes)
            rows += [off + j for j in nodes]
            spans.append(RowSpan(r, base, len(nodes)))
        self._inject(rows, spans, hidden)

    # ---- graphs ----------------------------------------------------------------------------
    def init_graphs(self, config: GraphConfig, max_blocks: int) -> None:
        """DDTREE: the block forward, every bucket, for the batches its chained step cannot serve. (DFLASH's
        run the block eagerly then, sparing every bucket a [B, S - 1, V] logits buffer.)"""
        self.block_step.max_blocks = max_blocks
        if self.tree_budget is not None:
            self.engine.executor.register(DRAFT_BLOCK, self.block_step, config)

    @property
    def block_runner(self) -> CudaGraphRunner | None:
        """The executor's block-forward runner (None: it runs eagerly)."""
        return self.engine.executor.runner(DRAFT_BLOCK)

    # ---- the chained step (DFLASH, greedy) --------------------------------------------------
    def chain_step(self, max_blocks: int, sampled: bool = False):
        """The step as one chained graph step (sampled: for batches with sampled requests): DFLASH's chain
        (dflash_chain.py), DDTREE's tree (ddtree_chain.py; None when the block cannot hold the budget's nodes)."""
        if self.tree_budget is not None:
            from .ddtree_chain import DDTreeChainStep, beam_sizes

            if sum(beam_sizes(self.block_size - 1, self.tree_topk, self.tree_budget)) < self.tree_budget:
                return None
            return DDTreeChainStep(self.engine.model, self.engine.kv, self.draft, self.cache, self.block_size,
                                   max_blocks, self.tree_budget, self.tree_topk, sampled=sampled)
        from .dflash_chain import DFlashChainStep

        return DFlashChainStep(self.engine.model, self.engine.kv, self.draft, self.cache, self.block_size, max_blocks,
                               sampled=sampled)

    def chain_batch(self, reqs, roots, base, tables, live, sampling, step):
        from .dflash_chain import DFlashChainBatch

        return DFlashChainBatch(roots, base, tables, live, sampling)

    def chains_ended(self, reqs: list[Request], rows: list[int], out) -> None:
        for r in reqs:
            self._state(r).context_len = r.num_computed_tokens  # the chain injected every committed position

    # ---- draft ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Request]) -> list[DraftTree]:
        eng, s = self.engine, self.block_size
        base = [r.num_computed_tokens for r in reqs]
        roots = [(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs]
        cols = blocks_covering(max(base), eng.kv.block_size)
        # no drafts past what a request may still generate: its block shrinks there, like the reference's
        # (the block is attended non-causally, so its length changes every draft)
        max_len = eng.config.max_model_len
        n_drafts = [max(1, min(s - 1, r.params.max_tokens - len(r.output_token_ids), max_len - r.num_tokens))
                    for r in reqs]
        t = eng.executor.upload([roots, base, padded_tables(reqs, cols), [n + 1 for n in n_drafts]])
        batch = BlockBatch(t[0], t[1], t[2].view(len(reqs), cols), t[3])
        logits = eng.executor.run(DRAFT_BLOCK, batch)  # [B, S - 1, V]: one replay where captured
        if self.tree_budget is not None:  # every request's candidates in one copy back
            lp_all, tk_all = (x.cpu() for x in top_k_probs(logits, self.tree_topk, log=True))
        greedy_all = logits.argmax(-1).tolist() if self.tree_budget is None and all(
            r.params.greedy for r in reqs) else None
        trees = []
        for i, r in enumerate(reqs):
            root, n, row = roots[i], n_drafts[i], logits[i, :n_drafts[i]]
            if self.tree_budget is not None:
                trees.append(build_ddtree(lp_all[i, :n], tk_all[i, :n], root, self.tree_budget))
            elif r.params.greedy:
                trees.append(DraftTree.chain(root, greedy_all[i][:n] if greedy_all is not None
                                             else row.argmax(-1).tolist()))
            else:
                # each draft raced against the noise the target's draw for that output token will use
                q = filter_logits(row.float(), r.params).softmax(-1)
                keys = ahead_keys([r], torch.arange(q.shape[0], device=q.device)[None])[0]
                trees.append(DraftTree.chain(root, race(q, draw_noise(keys, q.shape[-1], q.device)).tolist()))
        return trees
