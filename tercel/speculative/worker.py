"""The speculative step, shared by every drafter: draft -> verify -> accept -> draft_extend.

LLMEngine.step calls SpecWorker.step with the scheduled requests when speculation is on. Requests
that are decoding and whose drafter is ready take the spec step; the rest (prefill chunks, requests
recomputing after preemption) take the normal path, with the hidden states the drafter needs
captured (capture_hidden_mode) so it can extend its own state over those tokens.

KV bookkeeping for one request whose root (last sampled token) sits at position `base`:
  verify writes node j of its tree at slot position base + j (RoPE position base + depth[j]);
  accept keeps the root and k drafts: their KV is compacted to base .. base + k (a chain needs no
  copy), num_computed_tokens becomes base + 1 + k, blocks past the live tokens are freed, and the
  drafter's draft_extend runs over the same k + 1 positions.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..batching import same_batch, step_batch
from ..dev_overrides import env
from ..executor import CHAIN, CHAIN_SAMPLED, DECODE, StepKey, verify_key
from ..forward_batch import CaptureHiddenMode, ForwardBatch, ModelOutput
from ..graphs.runner import CudaGraphRunner, GraphConfig
from ..graphs.steps import ModelStep
from ..kv import slot_of
from ..outputs import RequestOutput
from ..request import Request
from ..sampling import greedy_tokens, token_logprobs
from ..scheduler import ScheduledRequest
from .adaptive import AdaptiveSpec, PlainGrant, candidate_widths
from .batching import VerifyLayout, verify_batch
from .drafter import DeviceChains, Drafter, ExtendedChunk
from .host import SpecEngine
from .profile import StepProfile
from .stats import SpecStats
from .tree import DraftTree
from .verify import Accepted, accept_greedy_batched, accept_walk, context_free, sampled_targets

if TYPE_CHECKING:
    from .chain_loop import ChainLoop

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Proposal:
    """What one verify runs: host trees, or greedy chains kept on the device ([B, W], root first), and the
    tokens verified per request."""
    trees: list[DraftTree] | None
    device_tokens: torch.Tensor | None
    width: int


class SpecWorker:
    def __init__(self, engine: SpecEngine, drafter: Drafter, num_draft_tokens: int, adaptive: bool = False) -> None:
        self.engine = weakref.proxy(engine)  # the engine owns the worker: no reference cycle back to it
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens  # nodes per tree, root included
        self.stats = SpecStats()
        self.chain: "ChainLoop | None" = None  # init_graphs: greedy EAGLE chains as one chained graph step
        # adaptive speculation (adaptive.py): the width of each step from a cost model and the acceptance
        self.adaptive = AdaptiveSpec.for_batches(engine.config.max_num_seqs) if adaptive else None
        self.last_width = 0  # the width the last spec step verified (1 when nothing was drafted)
        self.used_chain = False  # the last spec step ran as a chained step
        self.profile = StepProfile(engine.device)  # per-phase times, when a benchmark turns it on
        # adaptive: an unchained step's cost is its whole engine cycle (scheduling, output processing and the
        # caller's loop included, as a plain window's pace is), closed when the next engine step begins
        self._step_began = 0.0
        self._open_step: tuple[int, int, float] | None = None  # (batch size, width, cycle start)
        self._plain_grant: tuple[list[Request], PlainGrant] | None = None  # the batch plain_window's answer is for
        # a probe's whole cost (CostModel.observe_probe): the last plain window read (time, batch), and a probe's
        # excursion from it (that read's time, the batch, its tokens then) until the next window read
        self._window_read: tuple[float, list[Request]] | None = None
        self._windows_adjacent = False  # nothing but plain windows ran since that read (plain_pace)
        # buckets whose plain cost rests on plain windows' paces: there a plain step through the worker (a transition:
        # the policy asked again after a chain run or a probe) is no plain step's cost (step_began)
        self._window_paced: set[int] = set()
        self._excursion: tuple[float, list[Request], int] | None = None
        # a plain window's forward: the one-token verify (it returns the drafter's hidden rows), else the decode
        self._plain_kind = DECODE if drafter.capture_hidden_mode == CaptureHiddenMode.NULL else verify_key(1)

    @property
    def verify_runners(self) -> dict[int, CudaGraphRunner]:
        """The executor's captured verify steps by width (adaptive: the candidate widths)."""
        return self.engine.executor.widths("verify")

    @property
    def verify_runner(self) -> CudaGraphRunner | None:
        """The captured verify step of num_draft_tokens per request (None: verify runs eagerly)."""
        return self.engine.executor.runner(verify_key(self.num_draft_tokens))

    @property
    def extra_slots(self) -> int:
        """KV slots the scheduler reserves per request beyond its next token (the verify width)."""
        return self.num_draft_tokens - 1

    def _sync_target(self) -> None:
        # The drafter reads fixed target layers; set them before any forward (a loaded target can be
        # shared by several engines, e.g. in tests, each with its own drafter).
        model = self.engine.model
        if model.aux_layer_ids != self.drafter.aux_layer_ids:
            model.set_aux_layers(self.drafter.aux_layer_ids)

    def step_began(self) -> None:
        """The engine starts a step: the cycle of the unchained adaptive step before it, if any, ends here."""
        now = time.perf_counter()
        if self._open_step is not None:
            batch_size, width, start = self._open_step
            costs = self.adaptive.costs
            if width > 1 or costs.bucket(batch_size) not in self._window_paced:
                costs.observe(batch_size, width, now - start)
            self._open_step = None
        self._step_began = now

    @property
    def cycle_began(self) -> float:
        """When the engine's current step began (step_began)."""
        return self._step_began

    def step(self, scheduled: list[ScheduledRequest]) -> list[RequestOutput]:
        start = time.perf_counter()
        try:
            return self._step(scheduled)
        finally:
            self.stats.worker_steps += 1
            self.stats.worker_step_s += time.perf_counter() - start

    def _step(self, scheduled: list[ScheduledRequest]) -> list[RequestOutput]:
        self._sync_target()
        self._plain_grant = None  # a step through here (a prefill, a probe) ends the plain stretch's batch
        decoding, rest = [], []
        ada = self.adaptive
        for s in scheduled:
            r = s.request
            if s.num_tokens == 1 and r.num_computed_tokens == r.num_tokens - 1 and (
                    self.drafter.ready(r) or (ada is not None and ada.has_deferred(r))):
                decoding.append(r)
            else:
                rest.append(s)
                if ada is not None:  # it extends the draft state itself (a prefill, a recompute)
                    ada.drop_deferred(r)
        outputs = self._normal_path(rest) if rest else []
        if decoding:
            outputs += (self._adaptive_step(decoding, timed=not rest) if ada is not None
                        else self._spec_step(decoding))
        return outputs

    # ---- adaptive speculation: this step's width, a deferred draft_extend, the step's cost -----
    def widths(self, batch_size: int | None = None, reqs: list[Request] | None = None) -> tuple[int, ...]:
        """The candidate widths; at batch_size, where its plain step replays a graph, only the widths whose verify
        does too: an eager speculative step (hundreds of launches) never pays beside a graphed plain step, and
        probing one cost a good share of a pass (past SPEC_GRAPH_MAX_BS). Where a chain serves the requests (reqs),
        plain or the full width: a narrower width runs unchained (separate draft, verify and extend, a host sync) and
        cost more than the chained full width at every batch measured (docs/adaptive.md), so probing it only lost
        time."""
        widths = candidate_widths(self.num_draft_tokens, self.drafter.uses_trees)
        if reqs is not None and self.chain is not None and self.chain.serves(reqs):
            widths = (1, self.num_draft_tokens)
        plain = self.engine.executor.runner(self.plain_kind())
        if batch_size is None or plain is None or not plain.serves(batch_size):
            return widths
        runners = self.verify_runners
        return tuple(w for w in widths if w == 1 or (w in runners and runners[w].serves(batch_size)))

    def _adaptive_step(self, reqs: list[Request], timed: bool = True) -> list[RequestOutput]:
        """timed: a pure decode step (no prefill beside it), whose cycle measures what this width costs."""
        ada = self.adaptive
        sync = torch.cuda.synchronize if self.engine.device.type == "cuda" else (lambda: None)
        widths = self.widths(len(reqs), reqs)
        measured = ada.costs.knows(len(reqs), widths)  # else this step measures forwards (not timed)
        width = ada.choose(reqs, widths, self._dummy_forward, sync, bool(self.engine.scheduler.waiting))
        read = self._window_read
        if ada.policy.probed and self._excursion is None and read is not None and same_batch(read[1], reqs):
            self._excursion = (read[0], list(reqs), sum(r.num_computed_tokens for r in reqs))
        if width > 1:  # the draft state catches up over the plain steps' tokens first
            self._flush(reqs, sync)
        outputs = self._spec_step(reqs, width)
        if self.used_chain:  # a chain left in flight is costed when it ends (CostModel.observe_chain)
            width = self.num_draft_tokens
            if self.inflight:
                if measured:
                    self.chain.time_from(self._step_began if timed else None, probe=ada.policy.probed)
                timed = False
        else:  # n-gram: last_width is 1 when no request found a match; the cost is the chosen width's
            self.stats.width_histogram[self.last_width] = self.stats.width_histogram.get(self.last_width, 0) + 1
        if timed and measured and any(r.finish_reason is None for r in reqs):
            self._open_step = (len(reqs), width, self._step_began)
        return outputs

    def _flush(self, reqs: list[Request], sync: Callable[[], None]) -> None:
        """The deferred draft_extend before a speculative step, kept out of that step's cost: it is the catch-up of
        the plain stretch before it, paid once per switch (SWITCH_GAIN; a probe's spacing counts it), not per step of
        this width. Counted in, each probe (one step after a stretch) reads several chained steps' cost, and the
        policy stays off a width that pays. This cycle's clock starts after it."""
        t = time.perf_counter()
        rows = self.adaptive.flush(reqs, self.drafter)
        if rows:
            launched = time.perf_counter()
            sync()  # its device time too: the step's own work queues behind it
            took = time.perf_counter() - t
            self._step_began += took
            self.stats.flushes += 1
            self.stats.flush_s += took
            self.stats.flush_host_s += launched - t
            self.stats.flush_rows += rows
            self.adaptive.costs.observe_switch(len(reqs), took)

    # ---- plain stretches at plain speed: the engine runs them as decode windows ------------------
    def plain_window(self, running: list[Request]) -> int:
        """Plain steps the adaptive policy grants the running batch now (0: the next step comes here). Only
        when every request is decoding with its draft state in step (or its plain rows deferred)."""
        ada = self.adaptive
        if ada is None or not running or self.inflight:
            return 0
        # the same batch as the last windows, which ran plain (so its draft states stay deferred): the policy's
        # answer stands until the batch changes or the stretch ends in a probe. Plain steps change no acceptance,
        # and weighing every request per window cost ~0.2 ms a step at 256 requests (batch_gaps.py --host-profile)
        if self._plain_grant is not None and same_batch(self._plain_grant[0], running):
            return self._plain_grant[1].left()
        self._plain_grant = None
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1 or not (self.drafter.ready(r) or ada.has_deferred(r)):
                return 0
        grant = ada.plain_steps(running, self.widths(len(running), running), bool(self.engine.scheduler.waiting))
        if grant is None or grant.left() == 0:
            return 0
        self._plain_grant = (list(running), grant)
        return grant.left()

    def plain_forward(self, batch: ForwardBatch) -> ModelOutput:
        """One plain decode forward of a window, returning the hidden states the drafter reads (FULL / LAST):
        the one-token verify graph, or the engine's decode graph for drafters without hidden states."""
        self.prepare_plain(batch)
        return self._verify(batch)

    def prepare_plain(self, batch: ForwardBatch) -> None:
        """A plain window's forward reads the drafter's layers and returns its hidden states."""
        self._sync_target()
        batch.capture_hidden_mode = self.drafter.capture_hidden_mode

    def plain_kind(self) -> StepKey:
        """The step kind of a plain window's forward (plain_forward's): the one-token verify, or the decode."""
        return self._plain_kind

    def window_launched(self, reqs: list[Request], num_steps: int) -> None:
        """A plain window of num_steps is on its way: its steps count towards the granted stretch's probe (the
        grant's own schedule while the batch is the one it was granted to: no bucket lookup per window)."""
        grant = self._plain_grant
        if grant is not None and same_batch(grant[0], reqs):
            grant[1].schedule.plain_run += num_steps
        else:
            self.adaptive.ran_plain(num_steps, len(reqs), None)

    def windows_interrupted(self) -> None:
        """The engine runs something other than a plain window (a worker step, an idle turn): the next window's gap
        to the last one read holds that work, no plain step's."""
        self._windows_adjacent = False

    def plain_pace(self, reqs: list[Request], num_steps: int, now: float) -> float | None:
        """A window's seconds per step: the time since the window read just before it, only where nothing else ran
        in between and the batch is the same (the gap across a batch change holds the change's work: a request
        finishing, its blocks freed, the batch rebuilt)."""
        read = self._window_read
        if not self._windows_adjacent or read is None or not same_batch(read[1], reqs):
            return None
        return (now - read[0]) / num_steps

    def after_plain_window(self, reqs: list[Request], hidden: torch.Tensor | None, num_steps: int,
                           now: float | None = None) -> None:
        """A window's tokens are appended (read back at `now`): keep the hidden rows of the requests that go on
        ([num_steps, B, H], request i's column) for their next draft_extend, count the window's pace in the cost
        model (plain_pace), and close a probe's excursion."""
        ada = self.adaptive
        now = time.perf_counter() if now is None else now
        pace = self.plain_pace(reqs, num_steps, now)
        if pace is not None:
            ada.costs.observe(len(reqs), 1, pace)
            self._window_paced.add(ada.costs.bucket(len(reqs)))
        if self._excursion is not None:
            self._close_excursion(reqs, now)
        self._window_read, self._windows_adjacent = (now, reqs), True
        self.stats.width_histogram[1] = self.stats.width_histogram.get(1, 0) + num_steps
        self.stats.plain_window_steps += num_steps
        if hidden is not None:  # the window's stacked rows are its own tensor (the engine's decode window)
            ada.defer_window(reqs, hidden, self.drafter)

    def _close_excursion(self, reqs: list[Request], now: float) -> None:
        """The first plain window read after a probe: what the probe cost is the time since the window read before
        it, less what plain steps would have taken for the tokens the batch gained meanwhile. Only over an unchanged
        batch (a request that arrived or finished in between changes both the time and the tokens)."""
        began, batch, tokens = self._excursion
        self._excursion = None
        if not same_batch(batch, reqs) or any(r.finish_reason is not None for r in reqs):
            return
        ada = self.adaptive
        gained = (sum(r.num_computed_tokens for r in reqs) - tokens) / len(reqs)
        cost = now - began - gained * ada.costs.step_s(len(reqs), 1)
        ada.costs.observe_probe(len(reqs), cost)
        self.stats.probes += 1
        self.stats.probe_s += cost

    def _dummy_forward(self, batch_size: int, width: int) -> Callable[[], None]:
        """The forward a step of this width runs, over a dummy batch (every slot in the dummy block 0) whose
        requests sit 256 tokens in, built now: the cost model times only the forward."""
        eng = self.engine
        ctx = max(1, min(256, eng.config.max_model_len - width))
        blocks = [0] * -(-(ctx + width) // eng.kv.block_size)
        reqs = [Request(f"cost-{i}", None, [0], None, None, None, block_table=blocks, num_computed_tokens=ctx)
                for i in range(batch_size)]
        trees = [DraftTree.chain(0, [0] * (width - 1)) for _ in reqs]
        masks = width > 1 and self.drafter.uses_trees
        batch, _ = verify_batch(reqs, trees, None, width, eng.kv.block_size, self.drafter.capture_hidden_mode,
                                masks, eng.executor.upload, eng.device)
        return lambda: self._verify(batch)

    # ---- prefill chunks and undrafted decodes --------------------------------------------
    def _normal_path(self, scheduled: list[ScheduledRequest]) -> list[RequestOutput]:
        eng = self.engine
        batch, sampled = step_batch(scheduled, eng.kv.block_size, eng.executor.upload)
        batch.capture_hidden_mode = self.drafter.capture_hidden_mode
        out = eng.executor.forward(batch)
        chunks, offset = [], 0
        for s in scheduled:
            r = s.request
            chunks.append(ExtendedChunk(r, r.num_computed_tokens, r.num_computed_tokens + s.num_tokens, offset))
            offset += s.num_tokens
            r.num_computed_tokens += s.num_tokens
        reqs = [s.request for s in sampled]
        tokens, logprobs = eng.sampler.sample(out.logits, reqs)
        outputs = eng.sink.postprocess(reqs, tokens, logprobs)
        alive = [c for c in chunks if c.request.finish_reason is None]
        if alive:
            self.drafter.after_extend(alive, out.hidden_states)
        return outputs

    # ---- graphs ----------------------------------------------------------------------------
    def init_graphs(self, config: GraphConfig, max_blocks: int, plain_config: GraphConfig | None = None) -> None:
        """Capture target verify (num_draft_tokens per request, tree masks when the drafter branches, at
        the drafter's capture-hidden mode) and the drafter's own steps, every bucket, now, as step kinds of
        the executor: after the aux-layer set and the draft's shared embedding / lm_head are fixed, so the
        graphs bind them. plain_config: the buckets of the one-token verify (an adaptive engine's plain steps,
        with the drafter's hidden states), the decode graph's: plain steps must run at plain speed at every
        batch the decode graph serves, also past the speculative steps' buckets."""
        self._sync_target()
        eng = self.engine
        ex = eng.executor
        # adaptive: every candidate width (plain steps of a drafter without hidden states use the decode graph)
        widths = self.widths() if self.adaptive is not None else (self.num_draft_tokens,)
        plain = self.drafter.capture_hidden_mode == CaptureHiddenMode.NULL
        with torch.inference_mode():
            for w in widths:
                if w == 1 and plain:
                    continue
                step = ModelStep(eng.model, eng.kv, max_blocks, w, custom_mask=w > 1 and self.drafter.uses_trees,
                                 name=f"verify-{w}")
                ex.register(verify_key(w), step, plain_config if w == 1 and plain_config else config,
                            self.drafter.capture_hidden_mode)
            self.drafter.init_graphs(config, max_blocks)
            # TERCEL_SPEC_CHAIN=0: separate draft / verify / extend graphs only (side-by-side measurements)
            chain_step = (self.drafter.chain_step(max_blocks) if env("TERCEL_SPEC_CHAIN") != "0"
                          else None)
            if chain_step is not None:
                from .chain_loop import ChainLoop

                runners = []
                for key, step in ((CHAIN, chain_step), (CHAIN_SAMPLED, self.drafter.chain_step(max_blocks, True))):
                    try:  # never fatal: without a chained step the worker's separate steps serve its batches
                        runners.append(None if step is None else ex.register(key, step, config))
                    except Exception as e:  # noqa: BLE001 (a capture error of any kind)
                        log.warning("the %s step could not be captured (%s); its batches run unchained", key.name, e)
                        ex.steps.pop(key, None)
                        runners.append(None)
                if runners[0] is not None:
                    self.chain = ChainLoop(self, runners[0], runners[1])

    @property
    def inflight(self) -> bool:
        """A chained step is on the device and its tokens are not read yet (engine.step calls advance)."""
        return self.chain is not None and self.chain.inflight is not None

    def advance(self) -> list[RequestOutput]:
        return self.chain.advance()

    def _verify(self, batch: ForwardBatch) -> ModelOutput:
        """A verify of this batch's width through the executor (a width with no graph: the eager target)."""
        ex = self.engine.executor
        if batch.query_lens[0] == 1:  # no hidden states: a plain decode step (nothing drafted anywhere)
            return ex.run(self._plain_kind, batch)
        return ex.run(verify_key(batch.query_lens[0]), batch)

    # ---- the spec step -------------------------------------------------------------------
    def _spec_step(self, reqs: list[Request], width: int | None = None) -> list[RequestOutput]:
        """propose -> verify -> accept -> emit -> draft_extend. width: tokens verified per request (None:
        num_draft_tokens; 1, chosen by the adaptive policy: a plain decode step, nothing drafted, the
        draft_extend deferred)."""
        grammars = [r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None
        self.used_chain = (self.chain is not None and width in (None, self.num_draft_tokens)
                           and grammars is None and self.chain.eligible(reqs))
        prof = self.profile
        if self.used_chain:  # greedy EAGLE chains: the whole step is one graph (chain_loop.py)
            self.last_width = self.num_draft_tokens
            prof.mark("chain")
            outputs = self.chain.start(reqs)
            prof.end_step()
            return outputs
        plain = width == 1
        prof.mark("draft")
        proposal = self._propose(reqs, width)
        prof.mark("verify")
        out, layout, logits = self._run_verify(reqs, proposal, grammars)
        self.last_width = proposal.width
        prof.mark("accept")
        trees, accepted = self._accept(reqs, proposal, layout, logits)
        prof.mark("emit")
        outputs: list[RequestOutput] = []
        moves: list[tuple[int, int]] = []
        alive: list[int] = []
        for i, (r, t, acc) in enumerate(zip(reqs, trees, accepted)):
            emit = [t.tokens[j] for j in acc.nodes] + [acc.bonus]
            lps = None
            if r.params.logprobs is not None:  # each token's from the row whose logits produced it
                off = i * proposal.width
                lps = [token_logprobs(out.logits[off + row], tok, r.params.logprobs)
                       for tok, row in zip(emit, [0] + acc.nodes)]
            if self.emit_verified(r, len(t) - 1, len(acc.nodes), emit, lps, record=not plain,
                                  offered=(width or self.num_draft_tokens) - 1):
                moves += self._keep_accepted(r, acc)
                alive.append(i)
            self.engine.sink.emit(outputs, r)
        if moves:  # (a source may sit in a block just freed: nothing allocates before this copy)
            src, dst = self.engine.executor.upload([[m[0] for m in moves], [m[1] for m in moves]])
            self.engine.kv.copy_slots(src, dst)
        prof.mark("extend")
        self._draft_extend([reqs[i] for i in alive], [trees[i] for i in alive], [accepted[i] for i in alive],
                           [i * proposal.width for i in alive], out.hidden_states, plain)
        prof.end_step()
        return outputs

    def _propose(self, reqs: list[Request], width: int | None) -> Proposal:
        """1. draft: host trees, or greedy chains that stay on the device until the step's one sync."""
        plain = width == 1
        width = width or self.num_draft_tokens
        proposal = self.drafter.propose(reqs) if not plain else [
            DraftTree.chain((r.output_token_ids or r.prompt_token_ids)[-1], []) for r in reqs]
        if isinstance(proposal, DeviceChains):
            return Proposal(None, proposal.tokens[:, :width].contiguous(), width)
        # no node past max_model_len; a request past max_tokens stops at its emit
        if any(not t.is_chain for t in proposal):  # a branching proposal is verified whole (or not at all)
            width = self.num_draft_tokens
        max_len = self.engine.config.max_model_len
        trees = [t.truncated(max(1, min(width, max_len - r.num_computed_tokens))) for r, t in zip(reqs, proposal)]
        if max(len(t) for t in trees) == 1 and self.drafter.capture_hidden_mode == CaptureHiddenMode.NULL:
            width = 1
        return Proposal(trees, None, width)

    def _run_verify(self, reqs: list[Request], p: Proposal,
                    grammars: list | None) -> tuple[ModelOutput, VerifyLayout, torch.Tensor]:
        """2. verify: every request `width` rows (trees padded), one target forward (a graph replay when
        captured); with structured output each node's row masked by the grammar along its path."""
        eng = self.engine
        # tree masks when the drafter branches (or a proposal does: a chain-only verify graph then falls back)
        masks = p.width > 1 and (self.drafter.uses_trees or any(not t.is_chain for t in p.trees or ()))
        batch, layout = verify_batch(reqs, p.trees, p.device_tokens, p.width, eng.kv.block_size,
                                     self.drafter.capture_hidden_mode, masks, eng.executor.upload, eng.device)
        out = self._verify(batch)
        logits = out.logits
        if grammars is not None:
            from ..structured.mask import mask_verify_rows

            paths = p.trees if p.trees is not None else [DraftTree.chain(row[0], row[1:])
                                                         for row in p.device_tokens.tolist()]
            logits = mask_verify_rows(logits, grammars, paths, p.width)
        return out, layout, logits

    def _accept(self, reqs: list[Request], p: Proposal, layout: VerifyLayout,
                logits: torch.Tensor) -> tuple[list[DraftTree], list[Accepted]]:
        """3. accept on the device for the whole batch: at each node the token plain decoding would emit
        there (greedy: the argmax; T > 0: the plain sampler's draw for that output position), drafts kept
        while they carry it; the step's one host sync reads the result. Penalties / min_tokens walk on the
        host."""
        b, width = len(reqs), p.width
        targets = greedy_tokens(logits).view(b, width)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy and context_free(r)]
        if sampled:
            idx = self.engine.executor.upload([sampled])[0]  # pinned: no wait for the verify in flight
            depth = (layout.depth.index_select(0, idx) if layout.depth is not None
                     else torch.arange(width, device=logits.device).expand(len(sampled), width))
            targets = targets.index_copy(0, idx, sampled_targets(logits.view(b, width, -1).index_select(0, idx),
                                                                 depth, [reqs[i] for i in sampled],
                                                                 self.engine.model.logits_exact_dtype))
        best, bonus = accept_greedy_batched(targets, layout.tokens, layout.lens, layout.parents, layout.depth,
                                            layout.masks)
        fetch = [best[:, None], bonus[:, None]] + ([layout.tokens] if p.trees is None else [])
        host = torch.cat(fetch, 1).tolist()
        trees = p.trees if p.trees is not None else [DraftTree.chain(row[2], row[3:]) for row in host]
        accepted: list[Accepted] = []
        for i, (r, t) in enumerate(zip(reqs, trees)):
            if context_free(r):
                acc = Accepted(t.path_to(host[i][0])[1:], host[i][1])
            else:
                acc = accept_walk(t, logits[i * width:i * width + len(t)], r)
            if not r.params.greedy:  # the draws of the emitted tokens are taken (their noise was used)
                r.draws += len(acc.nodes) + 1
            accepted.append(acc)
        return trees, accepted

    def emit_verified(self, r: Request, num_drafts: int, num_kept: int, tokens: list[int],
                      logprobs: list[dict[int, float]] | None = None, record: bool = True, offered: int = 0) -> bool:
        """4. emit one request's verified tokens (its kept drafts, then the bonus) with the stop checks,
        counting the verify as if the tree stopped at max_tokens (drafts past it are verified but never
        emitted). The unchained step and the chain loop both emit here. True when the request goes on.
        offered: the draft positions the step's width gave each request (for the adaptive policy)."""
        if record:
            room = max(1, r.params.max_tokens - len(r.output_token_ids))
            drafted, kept = min(num_drafts + 1, room) - 1, min(num_kept, room - 1)
            r.metrics.record_verify(drafted, kept)
            self.stats.record(drafted, kept)
            if self.adaptive is not None:
                # a request the drafter found nothing for (n-gram: no match) gained nothing from the width the
                # policy chose: for the policy, its positions were offered and none accepted (else its
                # acceptance would stay at the prior and the policy would go on choosing that width)
                self.adaptive.record(r, drafted if drafted > 0 else min(offered, room - 1), kept)
        return self.engine.sink.append_tokens(r, tokens, logprobs)

    def _keep_accepted(self, r: Request, acc: Accepted) -> list[tuple[int, int]]:
        """The accepted nodes' KV moves to base + 1 .. base + k (a chain needs no copy); the request's tokens
        through its bonus are computed then, and the blocks past them freed. Returns the (src, dst) slots."""
        base, bs = r.num_computed_tokens, self.engine.kv.block_size
        moves = [(slot_of(r.block_table, base + j, bs), slot_of(r.block_table, base + i, bs))
                 for i, j in enumerate(acc.nodes, start=1) if j != i]
        r.num_computed_tokens = base + 1 + len(acc.nodes)
        self.free_unused_blocks(r)
        return moves

    def _draft_extend(self, reqs: list[Request], trees: list[DraftTree], accepted: list[Accepted],
                      offsets: list[int], hidden: torch.Tensor | None, plain: bool) -> None:
        """5. draft_extend over the accepted tokens of the requests that go on (a plain step defers it)."""
        if not reqs:
            return
        if plain and hidden is not None:
            self.adaptive.defer(reqs, offsets, hidden, self.drafter)
        else:
            self.drafter.after_verify(reqs, trees, accepted, offsets, hidden)

    def free_unused_blocks(self, r: Request) -> None:
        self.engine.kv.free_unused_blocks(r.block_table, r.num_tokens)
