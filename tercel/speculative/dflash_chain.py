"""The whole greedy DFLASH step as one step kind (like the EAGLE chain, chain.py): the block forward, verify,
accept and the context injection on the device, the request state carried in the graph's own buffers.

Per request the state is (root token, base = the root's position): the draft's context cache holds the target's
states of positions [0, base). One replay runs the draft over the block [root, mask, ..., mask] at base .. base
+ S - 1 (attending to the context [0, base): on a GPU through the paged split-KV kernel, else over every slot
its block table could hold, masked past base), takes the block's top-1 drafts, verifies root + drafts through
the target (S rows, FULL hidden capture of the draft's target layers), accepts the longest matching prefix plus
the bonus token, injects the target's states of the root and the accepted drafts into the context cache (the
other rows write the dummy slot) and writes the next state back into its input buffers. So consecutive steps of
an unchanged batch replay with nothing staged, under the same chain loop as EAGLE's (chain_loop.py).

A shorter block near a request's max_tokens (the eager path's block_lens) is not needed here: drafts past
max_tokens are verified and never emitted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.paged_merge import draft_context
from ..forward_batch import CaptureHiddenMode, ForwardBatch
from ..graphs.buffers import BufferSpec, Pad, Per
from ..graphs.runner import StepKind
from ..kv import PagedKVCache
from ..models.dflash import DFlashDraftModel
from ..sampling import greedy_tokens, race_logits, stream_keys
from .chain import ChainSampling, sampling_buffers, verify_targets
from .chain_accept import chain_accept
from .eagle_steps import ChainPositions


@dataclass(slots=True)
class DFlashChainBatch:
    """The state a DFLASH chain step starts from, for B requests (updated in place by the step)."""
    roots: torch.Tensor  # [B] the last sampled token
    base: torch.Tensor  # [B] the root's position (the context cache covers [0, base))
    block_tables: torch.Tensor  # [B, width] zero-padded; cover base + S (and, chained, the next step's S)
    live: torch.Tensor  # [B] 1 for a real request (padding rows: 0)
    sampling: ChainSampling | None = None  # the sampled step's per-request settings (None: greedy)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.roots.shape[0]


@dataclass(slots=True)
class DFlashChainOutputs:
    tokens: torch.Tensor  # [B, S] root + drafted block (target ids)
    accepted: torch.Tensor  # [B] drafts accepted (k)
    bonus: torch.Tensor  # [B] the target's token after the accepted ones


class DFlashChainStep(StepKind):
    name = "dflash_chain"
    tokens_per_request = 1  # every buffer is per request

    def __init__(self, target: torch.nn.Module, kv: PagedKVCache, draft: DFlashDraftModel, cache: PagedKVCache,
                 block: int, max_blocks: int, sampled: bool = False) -> None:
        """sampled: the step of batches with sampled (T > 0) requests: each draft and target token drawn with
        the request's noise for that output token (the plain sampler's), greedy rows by argmax."""
        self.target, self.kv, self.draft, self.cache = target, kv, draft, cache
        self.width = self.block = block  # S: root + S - 1 drafts, all verified
        self.max_blocks = max_blocks
        self.sampled = sampled
        if sampled:
            self.name = "dflash_chain_sampled"

    def buffer_specs(self) -> list[BufferSpec]:
        return [BufferSpec("roots", Per.REQUEST, torch.long, Pad.ZERO),
                BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),
                BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
                BufferSpec("live", Per.REQUEST, torch.long, Pad.ZERO)] + (sampling_buffers() if self.sampled else [])

    def unsupported(self, batch: DFlashChainBatch) -> str | None:
        if batch.block_tables.shape[1] > self.max_blocks:
            return f"block table of width {batch.block_tables.shape[1]} exceeds the captured {self.max_blocks}"
        if self.sampled != (batch.sampling is not None):
            return "a batch of the other kind (greedy / sampled)"
        return None

    def live_inputs(self, batch: DFlashChainBatch) -> dict[str, torch.Tensor]:
        out = {"roots": batch.roots, "base": batch.base, "block_tables": batch.block_tables, "live": batch.live}
        if batch.sampling is not None:
            out.update({f: getattr(batch.sampling, f) for f in ChainSampling.FIELDS})
        return out

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int,
                     mode: CaptureHiddenMode) -> DFlashChainBatch:
        sampling = ChainSampling(*(views[f] for f in ChainSampling.FIELDS)) if self.sampled else None
        return DFlashChainBatch(views["roots"], views["base"], views["block_tables"], views["live"], sampling)

    def forward(self, static: DFlashChainBatch) -> DFlashChainOutputs:
        return self._step(static)

    def eager(self, batch: DFlashChainBatch) -> DFlashChainOutputs:
        return self._step(batch)

    def live_outputs(self, out: DFlashChainOutputs, num_live: int, mode: CaptureHiddenMode) -> DFlashChainOutputs:
        return DFlashChainOutputs(out.tokens[:num_live], out.accepted[:num_live], out.bonus[:num_live])

    def _draft_block(self, s: DFlashChainBatch, pos: torch.Tensor) -> torch.Tensor:
        """The block [root, mask ...] at base .. base + S - 1 (pos [B, S]) over the context (GPU: paged; else the
        table's slots, past base masked): the drafts' logits [B, S - 1, V]."""
        w, bs = self.block, self.kv.block_size
        cfg = self.draft.config
        j = torch.arange(w, device=s.roots.device)
        ids = torch.where(j == 0, s.roots[:, None], torch.full_like(pos, cfg.mask_token_id))
        embeds = self.target.embed_tokens(ids) * cfg.input_embedding_scale
        ctx_slots, ctx_mask, paged = draft_context(s.block_tables, s.base, self.max_blocks * bs, w, self.cache, embeds)
        hidden = self.draft(embeds, pos, ctx_slots, ctx_mask, self.cache, paged=paged)
        return self.target.compute_logits(hidden[:, 1:]) * cfg.output_multiplier

    def _step(self, s: DFlashChainBatch) -> DFlashChainOutputs:
        n, w, bs = s.roots.shape[0], self.width, self.kv.block_size
        dev = s.roots.device
        j = torch.arange(w, device=dev)
        # positions base + j and their KV slots, [S, B] (the rows' RoPE positions are not clamped here)
        at = ChainPositions.of(s.base, s.block_tables, bs, w, s.block_tables.shape[1] * bs)
        logits = self._draft_block(s, at.positions.t())  # [B, S - 1, V]
        flat = logits.reshape(n * (w - 1), -1)
        sp = s.sampling
        if sp is None:
            drafts = greedy_tokens(flat).view(n, w - 1)
        else:  # block position j + 1 races with output draw draws + j (the target's draw there), no filters
            keys = stream_keys(sp.seeds[:, None], sp.draws[:, None] + j[None, :-1]).reshape(-1)
            drafts = race_logits(flat, sp.temperature.repeat_interleave(w - 1), sp.sampled.repeat_interleave(w - 1),
                                 keys).view(n, w - 1)
        tokens = torch.cat([s.roots[:, None], drafts], dim=1)
        # verify: S rows per request at base .. base + S - 1, every row's logits and the draft's target layers
        positions = at.request_major(at.positions)
        fb = ForwardBatch(input_ids=tokens.reshape(-1), positions=positions, out_cache_loc=at.request_major(at.slots),
                          seq_lens=s.base + w, block_tables=s.block_tables,
                          logits_indices=torch.arange(n * w, device=dev), query_lens=[w] * n, seq_lens_cpu=[w] * n,
                          capture_hidden_mode=CaptureHiddenMode.FULL)
        out = self.target(fb, self.kv, attn_meta=self.target.attn_backend.capture_metadata(fb, bs, w))
        targets = verify_targets(out.logits, sp, j,  # sampled row j: the plain sampler's draw draws + j
                                 self.target.logits_exact_dtype)
        # k, the bonus, and the next step's root and base in place (padding rows keep base 0)
        acc = chain_accept(targets, tokens, at.slots, s.base, s.live, s.roots)
        # the context grows by the root and the accepted drafts (the other rows write the dummy slot 0)
        self.draft.inject_context(out.hidden_states, positions, acc.ext_slots, self.cache)
        if sp is not None:
            sp.advance(s.live, acc.accepted)
        return DFlashChainOutputs(tokens, acc.accepted, acc.bonus)
