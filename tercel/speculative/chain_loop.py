"""The host side of chained EAGLE chain steps (chain.py): start a chain from the requests' draft states,
keep replaying it while the batch stays the same, read each step's accepted tokens, end it.

Overlap schedule (on by default on a GPU, like plain decoding's): step N + 1 is launched before the host
reads step N's tokens, so the host's work (stop checks, detokenization, outputs) runs while the GPU
computes. The host's view then lags one step: when it launches N + 1 it knows where step N started
(num_computed_tokens), and N + 1 ends at most 2 W positions past that, so the KV blocks are reserved
that far ahead (Scheduler.schedule_decode_window with `ahead` = W) and nothing is freed while a chain
runs. A request that stops inside step N had step N + 1 run for it too: that work is discarded, and the
batch change ends the chain after N + 1 (the survivors' draft states are written back to them).

Only batches whose every token the device can choose qualify: context-free (no penalties or min_tokens),
no logprobs, and 2 W positions of room under max_model_len. A batch with sampled (T > 0) requests runs the
sampled chain step (chain.py): every draft and target token drawn with the request's own noise for that
output token, so a seeded request gets the tokens plain sampling gives it.

With adaptive speculation (adaptive.py) a chain is costed as a whole: from the engine cycle that started it
(or the next one, when a prefill shared that cycle) to its end, divided by its steps, so its
start (the draft_extend before it, staging) and its end (the state copies) count as they do wherever batches
change often. Each step's acceptance is recorded, and before each launch the policy is asked again (after a
probe's first PROBE_CHAIN_STEPS steps): when it no longer picks the full width, the chain ends and the worker's
adaptive steps take over.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from ..batching import padded_tables
from ..executor import CHAIN, CHAIN_SAMPLED
from ..graphs.runner import CudaGraphRunner
from ..graphs.staging import to_device
from ..outputs import RequestOutput
from ..request import Request
from .adaptive import PROBE_CHAIN_STEPS
from .chain import ChainOutputs, ChainSampling
from .host import ChainHost
from .verify import context_free


@dataclass(slots=True)
class InflightChain:
    reqs: list[Request]
    out: ChainOutputs  # views of the graph's outputs: valid until its next replay
    host: torch.Tensor  # [B, W + 2] tokens, accepted count, bonus: on their way to the host
    ready: torch.cuda.Event | None
    table_lens: list[int]  # block-table lengths in the graph's buffers
    runner: CudaGraphRunner | None = None  # the chain step it replays (greedy or sampled)


class ChainLoop:
    def __init__(self, worker: ChainHost, runner: CudaGraphRunner, sampled: CudaGraphRunner | None = None) -> None:
        """runner: the executor's CHAIN runner (chained replays restage nothing: they read its buffers);
        sampled: its CHAIN_SAMPLED runner, for batches with sampled (T > 0) requests."""
        self.worker = weakref.proxy(worker)  # the worker owns this loop: no reference cycle back to it
        self.engine = worker.engine
        self.runner = runner
        self.sampled = sampled
        self.width = worker.num_draft_tokens
        self.inflight: InflightChain | None = None
        self._timing = False  # adaptive: the in-flight chain is being costed (time_from)
        self._clock: float | None = None  # when its timed engine cycles began
        self._steps = 0  # chained steps read since then
        self._reads = (0.0, 0.0)  # when the first and the latest of them were read (the run's pace)
        self._policy_end = False  # the policy, not the batch, ended the run: its start and end were the switch's
        self._hold = 0  # chained steps still launched without asking the policy (a probe's, PROBE_CHAIN_STEPS)
        self._stream = torch.cuda.Stream(self.engine.device) if self.engine.device.type == "cuda" else None

    def _runner_for(self, reqs: list[Request]) -> CudaGraphRunner | None:
        return self.runner if all(r.params.greedy for r in reqs) else self.sampled

    def serves(self, reqs: list[Request]) -> bool:
        """Could a chain run these requests once their draft states are in step (deferred rows extended)?"""
        limit = self.engine.config.max_model_len - 2 * self.width
        runner = self._runner_for(reqs)
        return (runner is not None and runner.serves(len(reqs))
                and all(r.params.logprobs is None and context_free(r) and r.num_computed_tokens <= limit for r in reqs))

    def eligible(self, reqs: list[Request]) -> bool:
        return self.serves(reqs) and all(self.worker.drafter.ready(r) for r in reqs)

    # ---- launch ----------------------------------------------------------------------------
    def start(self, reqs: list[Request]) -> list[RequestOutput]:
        """The first step of a chain: stage the requests' states, replay; under the overlap schedule leave it
        in flight, else read it and end the chain now."""
        eng = self.engine
        n = len(reqs)
        cols = max(len(r.block_table) for r in reqs)
        roots = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in reqs]
        t = eng.executor.upload([roots, [r.num_computed_tokens for r in reqs], padded_tables(reqs, cols), [1] * n])
        runner = self._runner_for(reqs)
        sampling = None if runner is self.runner else self._sampling(reqs)
        # the drafter's own state joins the staged inputs (EAGLE: the first draft and hidden state)
        batch = self.worker.drafter.chain_batch(reqs, t[0], t[1], t[2].view(n, cols), t[3], sampling, runner.step)
        eager_before = runner.stats.eager
        out = eng.executor.run(CHAIN if sampling is None else CHAIN_SAMPLED, batch)  # a replay, or counted eager
        w = self._in_flight(reqs, out, [len(r.block_table) for r in reqs], runner)
        # chained replays read the graph's buffers: only after a replay (not an eager fallback) filled them
        if eng.overlap_schedule and not self.worker.profile.enabled and runner.stats.eager == eager_before:
            self.inflight = w
            return []
        outputs = self._collect(w)
        self._end(w)
        return outputs

    def _continue(self, w: InflightChain) -> InflightChain | None:
        """Launch the step after the in-flight one, when the batch is the same pure decode batch and the KV
        pool covers it (blocks for 2 W positions past where the in-flight step started)."""
        eng = self.engine
        limit = eng.config.max_model_len - 2 * self.width
        if eng.scheduler.running != w.reqs or any(r.num_computed_tokens > limit for r in w.reqs):
            return None
        if all(r.params.max_tokens - len(r.output_token_ids) <= self.width for r in w.reqs):
            return None  # every request ends inside the in-flight step: nothing would use the next
        ada = self.worker.adaptive
        if self._hold > 0:  # a probe's run: long enough to measure its pace apart from its start and end
            self._hold -= 1
        elif ada is not None and ada.costs.knows(len(w.reqs), self._widths()):
            alphas = ada.alphas(w.reqs, bool(eng.scheduler.waiting))
            if ada.policy.choose(ada.costs, len(w.reqs), alphas, self._widths()) != self.width:
                self._policy_end = True
                return None  # the policy would verify fewer tokens now: back to the worker's adaptive steps
        if eng.scheduler.schedule_decode_window(self.width, ahead=self.width) is None:
            return None
        lens = [len(r.block_table) for r in w.reqs]
        runner = w.runner
        if lens != w.table_lens:  # a table grew: refresh the graph's copy (rows past a table stay unread)
            cols = max(lens)
            bucket = runner.bucket_for(len(w.reqs))
            view = runner.buffers.view("block_tables", bucket)
            table = eng.executor.upload([padded_tables(w.reqs, cols)])[0]
            view[:len(w.reqs), :cols].copy_(table.view(len(w.reqs), cols))
        out = runner.replay_unstaged(len(w.reqs))
        return None if out is None else self._in_flight(w.reqs, out, lens, runner)

    def time_from(self, start: float | None, probe: bool = False) -> None:
        """Cost the chain just started (in flight): from `start` (its engine cycle's beginning), or, None, from
        the next cycle on (a prefill shared this one). probe: the policy's probe started it, so it runs
        PROBE_CHAIN_STEPS steps before the policy is asked again."""
        self._timing, self._clock, self._steps, self._policy_end = True, start, 0, False
        self._hold = PROBE_CHAIN_STEPS - 1 if probe else 0

    def _widths(self) -> tuple[int, ...]:
        return (1, self.width)  # where a chain runs, only plain or the chain (SpecWorker.widths)

    def _sampling(self, reqs: list[Request]) -> ChainSampling:
        """The requests' sampling settings and draw counts on the device (greedy rows: sampled = 0)."""
        vocab = self.engine.model_config.vocab_size
        ps = [r.params for r in reqs]
        ints = self.engine.executor.upload([[r.seed for r in reqs], [r.draws for r in reqs],
                                            [0 if p.greedy else 1 for p in ps],
                                            [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]])
        floats = to_device(torch.tensor([[1.0 if p.greedy else float(p.temperature) for p in ps],
                                         [float(p.top_p) for p in ps], [float(p.min_p) for p in ps]],
                                        dtype=torch.float32), self.engine.device)
        return ChainSampling(ints[0], ints[1], ints[2], floats[0], ints[3], floats[1], floats[2])

    def _in_flight(self, reqs: list[Request], out: ChainOutputs, table_lens: list[int],
                   runner: CudaGraphRunner) -> InflightChain:
        packed = torch.cat([out.tokens, out.accepted[:, None], out.bonus[:, None]], dim=1)
        if self._stream is None:
            return InflightChain(reqs, out, packed, None, table_lens, runner)
        # a copy on its own stream: the next step's kernels need not queue behind it
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(self._stream):
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        packed.record_stream(self._stream)
        return InflightChain(reqs, out, host, ready, table_lens, runner)

    # ---- read back -------------------------------------------------------------------------
    def advance(self) -> list[RequestOutput]:
        """Launch the next step (if the batch allows), then read the in-flight one."""
        w, self.inflight = self.inflight, None
        if self._timing and self._clock is None:
            self._clock = self.worker.cycle_began
        nxt = self._continue(w)
        self.inflight = nxt
        outputs = self._collect(w)
        if nxt is None:
            self._end(w)
            ada = self.worker.adaptive
            if self._timing and self._steps and ada is not None:
                now = time.perf_counter()
                if self._policy_end:  # its pace; the start and end count once per switch
                    ada.costs.observe_chain(len(w.reqs), self.width, self._steps, self._clock, *self._reads, now)
                else:  # the batch changed: restarts come with the chain's own steps (requests end at other times)
                    ada.costs.observe(len(w.reqs), self.width, (now - self._clock) / self._steps)
            self._timing, self._clock, self._policy_end, self._hold = False, None, False, 0
        return outputs

    def _collect(self, w: InflightChain) -> list[RequestOutput]:
        """Append each request's accepted drafts and bonus token with the usual stop checks. A request that
        stopped (or was aborted) before this step is skipped: its tokens here are discarded."""
        stats = self.worker.stats
        if w.ready is not None:
            t0 = time.perf_counter()
            w.ready.synchronize()
            stats.chain_reads += 1
            stats.chain_wait_s += time.perf_counter() - t0
        rows = w.host.tolist()  # the step's one device -> host read
        eng, width = self.engine, self.width
        if self._clock is not None:
            self._steps += 1
            now = time.perf_counter()
            self._reads = (now if self._steps == 1 else self._reads[0], now)
        stats.width_histogram[width] = stats.width_histogram.get(width, 0) + 1
        outputs: list[RequestOutput] = []
        for r, row in zip(w.reqs, rows):
            if r.finish_reason is not None:
                continue
            k, bonus = row[width], row[width + 1]
            r.num_computed_tokens += k + 1  # the chain's KV already sits in place
            if not r.params.greedy:  # the emitted tokens' draws are taken (the graph advanced its own count)
                r.draws += k + 1
            self.worker.emit_verified(r, width - 1, k, row[1:k + 1] + [bonus])
            eng.sink.emit(outputs, r)
        return outputs

    def _end(self, w: InflightChain) -> None:
        """The chain stops after step `w` (the last one replayed): the survivors take their draft state from
        its outputs and give back the blocks reserved past their tokens."""
        rows = [i for i, r in enumerate(w.reqs) if r.finish_reason is None]
        if not rows:
            return
        live = [w.reqs[i] for i in rows]
        self.worker.drafter.chains_ended(live, rows, w.out)
        for r in live:
            r.draft_kv_len = r.num_computed_tokens
            self.worker.free_unused_blocks(r)
