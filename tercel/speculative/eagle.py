"""EAGLE / EAGLE-3 drafting: the draft loop (chain or EAGLE-2 tree), and draft_extend.

Draft KV lives in its own paged cache indexed by the TARGET's block tables (same block size and
block count), so a request's draft KV for position p sits at the same slot as its target KV. The
draft input at position p pairs the token at p + 1 with the target's hidden state at p, so the draft
cache holds positions < num_computed_tokens, and the request's state (the draft's hidden state and
logits at position num_computed_tokens - 1) predicts the token after the root.

Draft loop for B requests, topk K, num_steps S: step 0 takes the top K of the state's logits
(a chain at T > 0 samples instead, keeping q for rejection sampling); each further step runs the K
current leaves through the draft at once (one forward for the batch) and expands each into its top
K children, keeping the K best by cumulative probability as the next leaves. The tokens of this
phase never enter the paged cache: their K/V sit in a small dense scratch, attended through an
ancestor mask (eagle_tree_step.py: one graph replay for the whole loop where captured). At the end the
num_draft_tokens - 1 best candidates (plus the root) form the tree, re-ranked on the host.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..batching import RowSpan, blocks_covering, build_batch, device_context_slots, padded_tables
from ..dev_overrides import env
from ..executor import DRAFT, DRAFT_EXTEND, DRAFT_TREE
from ..forward_batch import CaptureHiddenMode
from ..graphs.runner import CudaGraphRunner, GraphConfig
from ..kv import PagedKVCache
from ..loader.drafts import load_eagle_draft
from ..loader.model_loader import draft_dtype
from ..models.eagle3 import EagleDraftModel
from ..request import Request
from ..sampling import ahead_keys, draw_noise, filter_logits, race
from .drafter import DeviceChains, Drafter, ExtendedChunk
from .eagle_steps import DraftExtendBatch, DraftLoopBatch, EagleDraftLoopStep, EagleExtendStep
from .eagle_tree_step import DraftAttention, EagleTreeDraftStep, TreeDraftBatch
from .host import SpecEngine
from .tree import DraftTree, top_k_probs
from .verify import Accepted

if TYPE_CHECKING:
    from .config import SpecConfig

log = logging.getLogger(__name__)


def extend_shape(rows: int, prefix: int) -> tuple[int, int]:
    """An eager draft_extend's rows per request and prefix width, rounded up so that few shapes recur: rows to a
    power of two from 8 (to 512, then multiples of 512), the prefix to a multiple of 256. A deferred draft_extend
    (adaptive speculation's flush) ran at a new shape nearly every time, and on a GPU its host part took 3.6-7.6 ms
    whatever its rows (an H100 and an H200; ~0.7 ms in each cuBLAS linear). Padding rows write the dummy slot and
    feed no output; prefix positions past a request's own are masked."""
    rows = 1 << max(3, (rows - 1).bit_length()) if rows <= 512 else -(-rows // 512) * 512
    return rows, -(-prefix // 256) * 256


@dataclass(slots=True)
class EagleState:
    valid_for: int  # the request's num_computed_tokens this state belongs to
    hidden: torch.Tensor  # [H] draft pre-norm hidden at position valid_for - 1
    logits: torch.Tensor  # [Vd] draft logits there: the distribution of the token after the root
    first: torch.Tensor  # [] target id of their top-1: a greedy chain's first draft


DRAFT_HEAD_MODES = ("native", "int8")


def draft_head_mode() -> str:
    """TERCEL_DRAFT_HEAD: native (the head in the draft's dtype) or int8 (EagleDraftModel.quantize_head)."""
    mode = env("TERCEL_DRAFT_HEAD")
    if mode not in DRAFT_HEAD_MODES:
        raise ValueError(f"TERCEL_DRAFT_HEAD={mode!r}: use one of {', '.join(DRAFT_HEAD_MODES)}.")
    return mode


class EagleDrafter(Drafter):
    capture_hidden_mode = CaptureHiddenMode.FULL
    has_kv = True
    kv_lookahead = 1  # the draft row at p pairs the target's state at p with the token at p + 1

    def __init__(self, engine: SpecEngine, model: EagleDraftModel, num_steps: int, topk: int,
                 num_draft_tokens: int, token_map: Path | None = None) -> None:
        self.engine = weakref.proxy(engine)  # the engine owns the drafter: no reference cycle back to it
        self.model = model
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.aux_layer_ids = model.config.aux_layer_ids
        target = engine.draft_target  # the target itself; tensor parallel: rank 0's whole copies
        model.share_target(target.embed_tokens.weight, target.lm_head_weight, target.compute_logits)
        if token_map is not None:
            from .token_map import load_token_map

            kept = model.restrict_vocab(load_token_map(token_map, engine.model_config.vocab_size))
            if kept < topk:
                from ..options import ConfigError

                raise ConfigError(f"speculative_token_map {token_map} leaves the draft {kept} tokens, fewer than "
                                  f"speculative_eagle_topk={topk}; use a larger map or a smaller topk.")
            log.info("speculative_token_map %s: the draft proposes %d of its tokens", token_map, kept)
        if draft_head_mode() == "int8":
            model.quantize_head()
            log.info("TERCEL_DRAFT_HEAD=int8: the draft's head product reads int8 rows (%d x %d)",
                     *model.head_q[0].shape)
        self.kv = PagedKVCache(model.kv_spec(engine.kv.block_size, model.fc.weight.dtype), engine.kv.num_blocks,
                               engine.device)
        self.scale = model.config.layers.head_dim ** -0.5
        self.vocab_size = engine.model_config.vocab_size
        self.uses_trees = topk > 1
        self.pad_extend = env("TERCEL_FLUSH_PAD") != "0" and engine.device.type == "cuda"
        # static-shape steps (eagle_steps.py): eager until init_graphs captures them
        lc = model.config.layers
        backend = type(engine.model.attn_backend)(lc.num_heads, lc.num_kv_heads, lc.head_dim, None)
        max_position = engine.config.max_model_len - 1
        self.max_blocks = -(-(engine.config.max_model_len + num_draft_tokens) // engine.kv.block_size) + 1
        self.loop_step = EagleDraftLoopStep(model, self.kv, backend, self.max_blocks, max_position, num_steps)
        self.extend_step = EagleExtendStep(model, self.kv, backend, self.max_blocks, max_position, num_draft_tokens)
        self.tree_step = EagleTreeDraftStep(model, self.kv, backend, self.max_blocks, max_position, num_steps, topk,
                                            num_draft_tokens, self.scale)
        engine.executor.register(DRAFT, self.loop_step)
        engine.executor.register(DRAFT_EXTEND, self.extend_step)
        engine.executor.register(DRAFT_TREE, self.tree_step)

    @classmethod
    def load(cls, engine: SpecEngine, cfg: "SpecConfig") -> "EagleDrafter":
        model = load_eagle_draft(cfg.draft_model_path, engine.model_config, draft_dtype(engine.dtype, engine.device),
                                 engine.device, engine.config.max_model_len)
        want = "eagle3" if cfg.algorithm == "EAGLE3" else "eagle"
        if model.config.kind != want:
            from ..options import ConfigError

            raise ConfigError(f"speculative_algorithm={cfg.algorithm} but {cfg.draft_model_path} is an "
                              f"{model.config.kind.upper()} draft; pass --speculative-algorithm "
                              f"{model.config.kind.upper()}.")
        return cls(engine, model, cfg.num_steps, cfg.topk, cfg.num_draft_tokens, cfg.token_map)

    def one_row_model(self) -> torch.nn.Module | None:
        return self.model if self.topk == 1 else None  # a tree's draft steps run K rows

    def ready(self, req: Request) -> bool:
        st = req.spec_state
        return isinstance(st, EagleState) and st.valid_for == req.num_computed_tokens

    # ---- helpers -------------------------------------------------------------------------
    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.model.draft_to_target[draft_ids] if self.model.maps_vocab else draft_ids

    # ---- draft_extend --------------------------------------------------------------------
    def extend_rows(self, reqs: list[Request], starts: list[int], ids: list[list[int]], hidden: list[torch.Tensor],
                width: int) -> None:
        """Run the draft over rows [start, start + n) of each request (ids: the tokens at start+1 ..,
        hidden: the target's states at start ..), padded to `width` rows, write their draft KV and set
        each request's state from its last row."""
        dev = self.engine.device
        b = len(reqs)
        max_pos = self.engine.config.max_model_len - 1
        prefix = max(starts)
        if self.pad_extend:  # few distinct shapes (extend_shape): each new one cost its eager launches host time
            width, prefix = extend_shape(width, prefix)
        rows = build_batch([RowSpan(r, s, len(toks), width, toks) for r, s, toks in zip(reqs, starts, ids)],
                           self.kv.block_size)
        h = hidden[0].new_zeros(b, width, hidden[0].shape[-1])
        for i, (toks, hid) in enumerate(zip(ids, hidden)):
            h[i, :len(toks)] = hid
        # every integer input in one staged upload: a torch.tensor(list, device=...) each waited for the device
        # (a prefill's draft_extend, and each flush of a plain stretch, took six such round trips)
        cols = max(len(r.block_table) for r in reqs)
        t = self.engine.executor.upload([padded_tables(reqs, cols), starts, rows.slots, rows.ids,
                                         [min(p, max_pos) for p in rows.positions],
                                         [i * width + len(toks) - 1 for i, toks in enumerate(ids)]])
        prefix_slots, prefix_valid = device_context_slots(t[0].view(b, cols), t[1], prefix, self.kv.block_size)
        attn = DraftAttention(self.kv, prefix_slots, prefix_valid, width, self.scale)
        attn.entries = torch.arange(width, device=dev)
        attn.mask = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None].expand(b, -1, -1)
        attn.write_slots = t[2]
        out = self.model(t[3], h.view(b * width, -1), t[4], attn, from_target=True)
        h_last = out[t[5]]
        logits = self.model.compute_logits(h_last)
        first = self._to_target(logits.argmax(-1))
        for i, r in enumerate(reqs):
            r.spec_state = EagleState(starts[i] + len(ids[i]), h_last[i], logits[i], first[i])
            r.draft_kv_len = starts[i] + len(ids[i])

    def after_extend(self, chunks: list[ExtendedChunk], hidden: torch.Tensor | None) -> None:
        reqs = [c.request for c in chunks]
        ids = [c.request.token_slice(c.start + 1, c.end + 1) for c in chunks]
        rows = [hidden[c.row_offset:c.row_offset + c.end - c.start] for c in chunks]
        self.extend_rows(reqs, [c.start for c in chunks], ids, rows, max(c.end - c.start for c in chunks))
        for c in chunks:  # a partial prefill chunk leaves no usable state
            if c.end != c.request.num_tokens - 1:
                c.request.spec_state = None

    def after_verify(self, reqs: list[Request], trees: list[DraftTree], accepted: list[Accepted],
                     row_offsets: list[int], hidden: torch.Tensor | None) -> None:
        """draft_extend over the root and the accepted drafts, num_draft_tokens rows per request (a static
        shape: the rest are padding rows that write the dummy slot)."""
        w, bs = self.num_draft_tokens, self.kv.block_size
        spans, last, rows = [], [], []
        for r, acc, off in zip(reqs, accepted, row_offsets):
            n = len(acc.nodes) + 1
            start = r.num_computed_tokens - n  # the root's position
            spans.append(RowSpan(r, start, n, w, r.token_slice(start + 1, start + n + 1)))
            last.append(n - 1)
            rows += [off] + [off + j for j in acc.nodes] + [off] * (w - n)
        br = build_batch(spans, bs, blocks_covering(max(s.start for s in spans) + w, bs))
        t = self.engine.executor.upload([br.ids, br.positions, br.slots, br.seq_lens, br.tables, last, rows])
        batch = DraftExtendBatch(t[0], hidden[t[6]], t[1], t[2], t[3], t[4].view(len(reqs), br.cols), t[5],
                                 br.seq_lens)
        out = self.engine.executor.run(DRAFT_EXTEND, batch)
        # the outputs are graph buffers that the next replay overwrites: the states keep a copy
        h, logits, first = out.hidden.clone(), out.logits.clone(), out.first.clone()
        for i, r in enumerate(reqs):
            r.spec_state = EagleState(r.num_computed_tokens, h[i], logits[i], first[i])
            r.draft_kv_len = r.num_computed_tokens

    # ---- graphs --------------------------------------------------------------------------
    def init_graphs(self, config: GraphConfig, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.loop_step.max_blocks = self.extend_step.max_blocks = self.tree_step.max_blocks = max_blocks
        self.engine.executor.register(DRAFT_EXTEND, self.extend_step, config)
        if self.topk == 1:  # the greedy chain's draft loop
            self.engine.executor.register(DRAFT, self.loop_step, config)
        else:  # the tree's: every draft step in one replay (re-ranking into trees stays on the host)
            self.engine.executor.register(DRAFT_TREE, self.tree_step, config)

    @property
    def loop_runner(self) -> CudaGraphRunner | None:
        """The executor's draft-loop runner (None: the loop runs eagerly)."""
        return self.engine.executor.runner(DRAFT)

    @property
    def tree_runner(self) -> CudaGraphRunner | None:
        """The executor's tree draft-loop runner (None: the loop runs eagerly)."""
        return self.engine.executor.runner(DRAFT_TREE)

    @property
    def extend_runner(self) -> CudaGraphRunner | None:
        """The executor's draft_extend runner (None: it runs eagerly)."""
        return self.engine.executor.runner(DRAFT_EXTEND)

    def chain_step(self, max_blocks: int, sampled: bool = False):
        """The chain step (chain.py) for topk 1, the tree step (tree_chain.py) for trees."""
        if self.topk != 1:
            from .tree_chain import EagleTreeChainStep

            return EagleTreeChainStep(self.engine.model, self.engine.kv, self.tree_step, self.extend_step, max_blocks,
                                      sampled=sampled)
        from .chain import EagleChainStep

        return EagleChainStep(self.engine.model, self.engine.kv, self.loop_step, self.extend_step, max_blocks,
                              sampled=sampled)

    def chain_batch(self, reqs, roots, base, tables, live, sampling, step):
        from .chain import ChainBatch

        states = [r.spec_state for r in reqs]
        if self.topk != 1:
            from .tree_chain import TreeChainBatch

            return TreeChainBatch(roots, torch.stack([s.logits for s in states]),
                                  torch.stack([s.hidden for s in states]), base, tables, live, sampling)
        first = torch.stack([s.first for s in states])
        if sampling is not None:  # a sampled request's first draft draws with its next output token's noise
            first = step._draft_pick(sampling, 0)(torch.stack([s.logits for s in states]))
        return ChainBatch(roots, first, torch.stack([s.hidden for s in states]), base, tables, live, sampling)

    def chains_ended(self, reqs: list[Request], rows: list[int], out) -> None:
        # one copy of each output for the batch (the graph's buffers are overwritten by the next replay), each
        # request's state views of its row: three launches, where three per request were ~200 at 64 requests
        hidden, logits, first = out.hidden.clone(), out.logits.clone(), out.first.clone()
        for r, i in zip(reqs, rows):
            r.spec_state = EagleState(r.num_computed_tokens, hidden[i], logits[i], first[i])

    def _propose_on_device(self, reqs: list[Request]) -> DeviceChains:
        """The greedy chain draft loop for the whole batch in one step (a graph replay when captured)."""
        states = [r.spec_state for r in reqs]
        base = [r.num_computed_tokens for r in reqs]
        roots = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in reqs]
        cols = blocks_covering(max(base) + self.num_steps, self.kv.block_size)
        t = self.engine.executor.upload([roots, base, padded_tables(reqs, cols)])
        batch = DraftLoopBatch(t[0], torch.stack([s.first for s in states]), torch.stack([s.hidden for s in states]),
                               t[1], t[2].view(len(reqs), cols), base)
        return DeviceChains(self.engine.executor.run(DRAFT, batch))

    # ---- the draft loop ------------------------------------------------------------------
    def propose(self, reqs: list[Request]) -> list[DraftTree] | DeviceChains:
        # device chains are verified whole: only when no node would pass max_model_len (else trees, trimmed)
        room = self.engine.config.max_model_len - self.num_draft_tokens
        if self.topk == 1 and all(r.params.greedy and r.num_computed_tokens <= room for r in reqs):
            return self._propose_on_device(reqs)
        dev = self.engine.device
        k = self.topk
        base = [r.num_computed_tokens for r in reqs]
        cols = blocks_covering(max(base), self.kv.block_size)
        t = self.engine.executor.upload([base, padded_tables(reqs, cols)])
        batch = TreeDraftBatch(torch.stack([r.spec_state.logits for r in reqs]),
                               torch.stack([r.spec_state.hidden for r in reqs]), t[0], t[1].view(len(reqs), cols))
        sample_rows = [i for i, r in enumerate(reqs) if not r.params.greedy] if k == 1 else []
        if not sample_rows:  # the whole loop: one replay where captured
            out = self.engine.executor.run(DRAFT_TREE, batch)
        else:
            def pick(logits: torch.Tensor, ahead: int) -> tuple[torch.Tensor, torch.Tensor]:
                """top-k (scores, draft ids) of [B, K', Vd] logits; a chain's sampling rows draw instead: q, the
                request's own filters on the draft logits, raced against the noise the target's draw for the
                same output token will use (`ahead` places on), so draft and target agree wherever q and p do."""
                scores, idx = top_k_probs(logits, k)
                groups: dict[tuple, list[int]] = {}
                for i in sample_rows:
                    p = reqs[i].params
                    groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
                target_ids = self._to_target(torch.arange(logits.shape[-1], device=dev))
                for rows_ in groups.values():
                    q_draft = filter_logits(logits[rows_, 0], reqs[rows_[0]].params).softmax(-1)
                    keys = ahead_keys([reqs[i] for i in rows_], torch.full((len(rows_), 1), ahead, device=dev))
                    noise = draw_noise(keys[:, 0], self.vocab_size, dev).index_select(1, target_ids)
                    idx[rows_, 0, 0] = race(q_draft, noise)
                return scores, idx

            out = self.tree_step.eager(batch, max(base), pick)
        # the re-ranked trees (a chain when topk is 1), in one copy back
        tokens, parents = torch.stack([out.tree_tokens, out.tree_parents]).tolist()
        roots = [r.prompt_token_ids[-1] if not r.output_token_ids else r.output_token_ids[-1] for r in reqs]
        return [DraftTree([root] + tok, [-1] + par) for root, tok, par in zip(roots, tokens, parents)]
