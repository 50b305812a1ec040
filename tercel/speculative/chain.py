"""The whole greedy EAGLE chain step as one step kind: draft -> verify -> accept -> draft_extend on the
device, with the request state carried from one replay to the next in the graph's own buffers.

Per request the state is (root token, the draft's first proposal and hidden state, base = the root's
position). One replay drafts num_steps tokens (EagleDraftLoopStep), verifies root + chain through the
target (one forward of W = num_steps + 1 rows, FULL hidden capture), accepts the longest matching
prefix plus the bonus token (accept_greedy_batched), runs draft_extend over the root and the accepted
drafts (EagleExtendStep) and writes the next state back into its input buffers. So consecutive steps of
an unchanged batch replay the graph with nothing staged from the host: the host only reads the accepted
tokens, and under the overlap schedule it does that for step N while step N + 1 runs (worker.py).

KV: verify writes the target's KV at base .. base + W - 1, a chain keeps the first k + 1 (no copy);
draft_extend writes the draft's KV at base .. base + k and sends the other rows to the dummy slot.
Padded rows (bucket > live) have base 0 and all-zero block tables: they draft, verify and extend in the
dummy block, and their base is reset every step so their positions never grow.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..forward_batch import CaptureHiddenMode, ForwardBatch
from ..graphs.buffers import BufferSpec, Pad, Per
from ..graphs.runner import StepKind
from ..kv import PagedKVCache
from ..sampling import SamplingTensors, greedy_tokens, race_logits_seeded, sample_rows, stream_keys
from .chain_accept import chain_accept
from .eagle_steps import ChainPositions, DraftExtendBatch, DraftLoopBatch, EagleDraftLoopStep, EagleExtendStep


@dataclass(slots=True)
class ChainBatch:
    """The state a chain step starts from, for B requests (updated in place by the step)."""
    roots: torch.Tensor  # [B] the last sampled token
    first: torch.Tensor  # [B] the draft's top-1 after the root (target id)
    hidden: torch.Tensor  # [B, H] the draft's pre-norm hidden state at position base - 1
    base: torch.Tensor  # [B] the root's position
    block_tables: torch.Tensor  # [B, width] zero-padded; cover base + W (and, chained, the next step's W)
    live: torch.Tensor  # [B] 1 for a real request (padding rows: 0)
    sampling: "ChainSampling | None" = None  # the sampled chain step's per-request settings (None: greedy)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def num_requests(self) -> int:
        return self.roots.shape[0]


@dataclass(slots=True)
class ChainSampling:
    """Per request: its sampling settings and its draw count (the next output token's draw index, advanced in
    place by each step). A greedy request in a sampled batch has sampled = 0 (its rows take the argmax)."""
    seeds: torch.Tensor  # [B] int64
    draws: torch.Tensor  # [B] int64
    sampled: torch.Tensor  # [B] int64 (1: T > 0)
    temperature: torch.Tensor  # [B] float32 (1 for greedy rows: unused)
    top_k: torch.Tensor  # [B] int64 (the target's vocabulary size when off)
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32

    FIELDS = ("seeds", "draws", "sampled", "temperature", "top_k", "top_p", "min_p")

    def advance(self, live: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a step: a live sampled request's draw count moves past its k accepted drafts and the bonus."""
        self.draws.copy_(torch.where(live.bool() & self.sampled.bool(), self.draws + accepted + 1, self.draws))

    def settings(self, vocab: int, repeat: int = 1) -> SamplingTensors:
        """Every filter on (off values filter nothing): one captured graph serves every mix of settings. vocab:
        the logits' width (top-k is kept within it: a draft's vocabulary is smaller than the target's)."""
        def rep(t: torch.Tensor) -> torch.Tensor:
            return t if repeat == 1 else t.repeat_interleave(repeat)

        # a padding row's zeroed temperature would make its logits / T all NaN: it divides by 1 instead
        temperature = torch.where(self.temperature > 0, self.temperature, torch.ones_like(self.temperature))
        return SamplingTensors(rep(temperature), rep(self.top_k.clamp(1, vocab)), rep(self.top_p),
                               rep(self.min_p), True, True, True)


def verify_targets(logits: torch.Tensor, sp: "ChainSampling | None", ahead: torch.Tensor,
                   exact: torch.dtype | None = None) -> torch.Tensor:
    """The target's token at each of a chained step's verify rows [B, W] (logits [B * W, V]): the argmax, and for
    sampled requests the plain sampler's draw of output token draws + ahead (ahead [W] for a chain's row j, or
    [B, W]: a tree node's depth). exact: the target's logits_exact_dtype (sample_rows)."""
    n, w = ahead.shape if ahead.dim() == 2 else (logits.shape[0] // ahead.shape[0], ahead.shape[0])
    targets = greedy_tokens(logits).view(n, w)
    if sp is None:
        return targets
    keys = stream_keys(sp.seeds[:, None], sp.draws[:, None] + ahead).reshape(-1)
    drawn = sample_rows(logits, sp.settings(logits.shape[-1], w), keys, exact=exact).view(n, w)
    return torch.where(sp.sampled.bool()[:, None], drawn, targets)


def sampling_buffers() -> list[BufferSpec]:
    """A sampled chained step's per-request ChainSampling buffers."""
    return [BufferSpec(f, Per.REQUEST, torch.float32 if f in ("temperature", "top_p", "min_p") else torch.long,
                       Pad.ZERO) for f in ChainSampling.FIELDS]


@dataclass(slots=True)
class ChainOutputs:
    tokens: torch.Tensor  # [B, W] root + drafted chain (target ids)
    accepted: torch.Tensor  # [B] drafts accepted (k)
    bonus: torch.Tensor  # [B] the target's token after the accepted ones
    logits: torch.Tensor  # [B, Vd] the new state: the draft's logits (float32),
    first: torch.Tensor  # [B] their top-1 (target id)
    hidden: torch.Tensor  # [B, H] and the draft's hidden state


class EagleChainStep(StepKind):
    name = "spec_chain"
    tokens_per_request = 1  # every buffer is per request

    def __init__(self, target: torch.nn.Module, kv: PagedKVCache, loop: EagleDraftLoopStep, extend: EagleExtendStep,
                 max_blocks: int, sampled: bool = False) -> None:
        """sampled: the chain of sampled (T > 0) requests: every draft, target token and next first draft drawn
        with the request's noise for that output token (the plain sampler's), greedy rows by argmax."""
        self.target, self.kv = target, kv
        self.loop, self.extend = loop, extend
        self.sampled = sampled
        if sampled:
            self.name = "spec_chain_sampled"
        self.width = extend.tokens_per_request  # W = num_steps + 1
        self.max_blocks = max_blocks
        if loop.num_steps + 1 != self.width:
            raise ValueError(f"chain step: draft loop of {loop.num_steps} steps but extend width {self.width}.")

    def buffer_specs(self) -> list[BufferSpec]:
        hidden = self.loop.model.hidden_size
        return [
            BufferSpec("roots", Per.REQUEST, torch.long, Pad.ZERO),
            BufferSpec("first", Per.REQUEST, torch.long, Pad.ZERO),
            BufferSpec("hidden", Per.REQUEST, self.loop.model.fc.weight.dtype, Pad.ZERO, shape=(hidden,)),
            BufferSpec("base", Per.REQUEST, torch.long, Pad.ZERO),
            BufferSpec("block_tables", Per.REQUEST, torch.long, Pad.ZERO, shape=(self.max_blocks,)),
            BufferSpec("live", Per.REQUEST, torch.long, Pad.ZERO),
        ] + (sampling_buffers() if self.sampled else [])

    def unsupported(self, batch: ChainBatch) -> str | None:
        if batch.block_tables.shape[1] > self.max_blocks:
            return f"block table of width {batch.block_tables.shape[1]} exceeds the captured {self.max_blocks}"
        if self.sampled != (batch.sampling is not None):
            return ("a sampled batch on the greedy chain step" if batch.sampling is not None
                    else "a greedy batch on the sampled chain step")
        return None

    def live_inputs(self, batch: ChainBatch) -> dict[str, torch.Tensor]:
        out = {"roots": batch.roots, "first": batch.first, "hidden": batch.hidden, "base": batch.base,
               "block_tables": batch.block_tables, "live": batch.live}
        if batch.sampling is not None:
            out.update({f: getattr(batch.sampling, f) for f in ChainSampling.FIELDS})
        return out

    def static_batch(self, views: dict[str, torch.Tensor], num_requests: int, mode: CaptureHiddenMode) -> ChainBatch:
        # (padding rows have sampled = 0: their draws, made from zeroed settings, are never taken)
        sampling = ChainSampling(*(views[f] for f in ChainSampling.FIELDS)) if self.sampled else None
        return ChainBatch(views["roots"], views["first"], views["hidden"], views["base"], views["block_tables"],
                          views["live"], sampling)

    def forward(self, static: ChainBatch) -> ChainOutputs:
        return self._step(static)

    def eager(self, batch: ChainBatch) -> ChainOutputs:
        return self._step(batch)

    def live_outputs(self, out: ChainOutputs, num_live: int, mode: CaptureHiddenMode) -> ChainOutputs:
        return ChainOutputs(*(t[:num_live] for t in (out.tokens, out.accepted, out.bonus, out.logits, out.first,
                                                     out.hidden)))

    def _draft_pick(self, sp: ChainSampling, ahead: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Target ids from draft logits [B, Vd]: sampled rows race the request's noise of draw draws + ahead (the
        target's own draw for that output token) over the draft's distribution at the request's temperature,
        greedy rows take the top-1. No top-k / top-p / min-p here: the verify's draws are the plain sampler's
        whatever the drafts are, so a filter only saves the drafts a token the target would not draw, and costs
        a sort and a filter launch per pick (sampling.race_logits)."""
        model = self.loop.model
        ids = model.draft_to_target if model.maps_vocab else None
        vocab = self.target.config.vocab_size

        def pick(logits: torch.Tensor) -> torch.Tensor:
            return race_logits_seeded(logits, sp.temperature, sp.sampled, sp.seeds, sp.draws, ahead, ids, vocab)

        return pick

    def _step(self, s: ChainBatch) -> ChainOutputs:
        n, w, bs = s.roots.shape[0], self.width, self.kv.block_size
        dev = s.roots.device
        sp = s.sampling
        # every row's position and KV slot, once: draft step s reads row s - 1, verify and extend all of them
        at = ChainPositions.of(s.base, s.block_tables, bs, w, self.loop.max_position)
        # draft: the chain, root first [B, W]; a sampled chain's position j + 1 draws with output draw draws + j
        pick = None if sp is None else (lambda j, logits: self._draft_pick(sp, j)(logits))
        tokens = self.loop.body(DraftLoopBatch(s.roots, s.first, s.hidden, s.base, s.block_tables, [0] * n),
                                graph=True, pick=pick, at=at)
        # verify: W rows per request at base .. base + W - 1, every row's logits and aux hidden states
        positions = at.request_major(at.positions)
        fb = ForwardBatch(input_ids=tokens.reshape(-1), positions=positions,
                          out_cache_loc=at.request_major(at.slots), seq_lens=at.seq_lens[w - 1],
                          block_tables=s.block_tables, logits_indices=torch.arange(n * w, device=dev),
                          query_lens=[w] * n, seq_lens_cpu=[w] * n, capture_hidden_mode=CaptureHiddenMode.FULL)
        meta = self.target.attn_backend.capture_metadata(fb, bs, w)
        out = self.target(fb, self.kv, attn_meta=meta)
        # accept: the longest prefix of drafts the target agrees with, then its own next token
        targets = verify_targets(out.logits, sp, torch.arange(w, device=dev),  # sampled row j: draw draws + j
                                 self.target.logits_exact_dtype)
        # k, the bonus, draft_extend's rows (the root and the k accepted drafts; the rest write the dummy slot)
        # and the next step's root and base, written in place (padding rows keep base 0)
        acc = chain_accept(targets, tokens, at.slots, s.base, s.live, s.roots)
        ext = self.extend.body(DraftExtendBatch(acc.ext_ids, out.hidden_states, positions, acc.ext_slots,
                                                acc.ext_seq_lens, s.block_tables, acc.accepted, [w] * n),
                               graph=True)
        first = ext.first
        if sp is not None:  # the next step's first draft draws with the next output token's noise
            sp.advance(s.live, acc.accepted)
            first = self._draft_pick(sp, 0)(ext.logits)
        s.first.copy_(first)
        s.hidden.copy_(ext.hidden)
        return ChainOutputs(tokens, acc.accepted, acc.bonus, ext.logits, first, ext.hidden)
