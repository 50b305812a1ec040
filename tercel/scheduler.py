"""Continuous batching: FCFS admission (each request starting after its longest cached prefix,
tercel.prefix_cache; one whose next block a running request is computing waits for it), chunked prefill
under a per-step prefill-token budget, decodes going first and outside it, and preemption by recompute
when KV blocks run out (the newest running request gives its blocks back and re-enters the queue; it is
never dropped)."""
from __future__ import annotations

import collections
from dataclasses import dataclass

from .kv import BlockAllocator
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled after it."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]


@dataclass(slots=True)
class AdmissionRoom:
    """What the next step can still take in beyond the waiting queue: free running slots, and prefill tokens
    (a request's cached blocks, and blocks a request before it computes, cost none). The server hands
    requests to the engine only while there is room, so its own round-robin order decides who goes next."""
    slots: int
    tokens: int
    scheduler: Scheduler
    pending: set[bytes]

    def take(self, req: Request) -> None:
        """Count req (just added to the waiting queue) against the room."""
        self.slots -= 1
        self.tokens -= self.scheduler.prefill_cost(req, self.pending)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_cache: PrefixCache | None = None,
                 max_step_tokens: int | None = None, min_prefill_tokens: int = 32) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # while requests decode, their tokens plus the prefill stay within max_step_tokens (None: no cap), the
        # prefill never below min_prefill_tokens: each of their next tokens waits for the whole step
        self.max_step_tokens = max_step_tokens
        self.min_prefill_tokens = min_prefill_tokens
        self.prefix_cache = prefix_cache  # None: prefix caching off
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def _release(self, req: Request) -> None:
        if self.prefix_cache is not None:  # what it computed stays findable after it lets go
            self.prefix_cache.publish(req)
        self.allocator.free(req.block_table)
        req.block_table = []
        req.num_published_blocks = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0  # recompute prompt + output on readmission (prefix hits spare most of it)
        req.draft_kv_len = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def _newest_unscheduled(self, scheduled: set[int]) -> Request:
        for j in range(len(self.running) - 1, -1, -1):
            if id(self.running[j]) not in scheduled:
                return self.running.pop(j)
        raise AssertionError("the request being scheduled is always unscheduled")

    def schedule(self, extra_tokens_per_request: int = 0) -> SchedulerOutput:
        """extra_tokens_per_request: KV slots reserved beyond the computed tokens (speculative verify).
        Every running request that decodes goes first, outside the token budget: a prefill never holds
        back another request's next token. Then prefill chunks of running requests, then admissions,
        under the budget (max_num_batched_tokens prefill tokens per step, less while requests decode: see
        prefill_budget)."""
        scheduled: list[ScheduledRequest] = []
        done: set[int] = set()
        preempted: list[Request] = []
        pc = self.prefix_cache
        # stable: decodes (one token left to compute) first, each group in arrival order
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        budget = self.prefill_budget(sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1))
        for req in order:
            if req.status is not RequestStatus.RUNNING:  # preempted for an earlier one this step
                continue
            left = req.num_tokens - req.num_computed_tokens
            if left > 1 and budget <= 0:
                break
            if pc is not None:
                pc.publish(req)
            n = left if left == 1 else min(left, budget)
            need = self._blocks_needed(req, n + extra_tokens_per_request)
            while need > self.allocator.num_free:
                victim = self._newest_unscheduled(done)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            req.block_table.extend(self.allocator.allocate(need))
            scheduled.append(ScheduledRequest(req, n))
            done.add(id(req))
            if left > 1:
                budget -= n
        if not preempted:
            self._admit(scheduled, budget, extra_tokens_per_request)
        return SchedulerOutput(scheduled, preempted)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens for a step that decodes num_decodes requests."""
        if num_decodes == 0 or self.max_step_tokens is None:
            return self.max_num_batched_tokens
        return min(self.max_num_batched_tokens, max(self.min_prefill_tokens, self.max_step_tokens - num_decodes))

    def admission_room(self) -> AdmissionRoom:
        """The room left for new requests in the next step, after the waiting queue (see AdmissionRoom)."""
        pending = self._pending_keys() if self.prefix_cache is not None else set()
        tokens = self.prefill_budget(len(self.running)) - sum(self.prefill_cost(r, pending) for r in self.waiting)
        return AdmissionRoom(self.max_num_seqs - len(self.running) - len(self.waiting), tokens, self, pending)

    def prefill_cost(self, req: Request, pending: set[bytes]) -> int:
        """Tokens a waiting request will compute: not its cached blocks, nor those a request before it computes
        (pending: their keys; req's own are added)."""
        pc = self.prefix_cache
        if pc is None or req.num_computed_tokens:
            return req.num_tokens - req.num_computed_tokens
        hits = len(pc.match(req))
        while (key := pc.next_key(req, hits)) is not None and key in pending:
            hits += 1
        pending.update(pc.prompt_keys_ahead(req))
        return req.num_tokens - hits * self.block_size

    def _pending_keys(self) -> set[bytes]:
        """Keys of the prompt blocks running requests are still computing."""
        pc = self.prefix_cache
        assert pc is not None
        keys: set[bytes] = set()
        for r in self.running:
            if r.num_computed_tokens < len(r.prompt_token_ids):
                keys.update(pc.prompt_keys_ahead(r))
        return keys

    def _admit(self, scheduled: list[ScheduledRequest], budget: int, extra: int) -> None:
        """Waiting requests in arrival order, each starting after its longest cached prefix. One whose next
        block another request is computing (n copies of a prompt, a shared system prompt) waits for it and
        then finds it cached, instead of computing it again (SGLang's in-batch prefix sharing)."""
        pc, a = self.prefix_cache, self.allocator
        pending = self._pending_keys() if pc is not None else set()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            hits = pc.match(req) if pc is not None else []
            if pending and pc.next_key(req, len(hits)) in pending:
                i += 1
                continue
            start = len(hits) * self.block_size
            n = min(req.num_tokens - start, budget)
            need = -(-(start + n + extra) // self.block_size) - len(hits)
            # a hit on a cached block nobody holds takes it off the free count
            if need + sum(1 for b in hits if a.is_evictable(b)) > a.num_free:
                break
            del self.waiting[i]
            if pc is not None:
                pc.take(req, hits)
                pending.update(pc.prompt_keys_ahead(req))
            req.block_table.extend(a.allocate(need))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def schedule_decode_window(self, num_steps: int, ahead: int = 0) -> list[ScheduledRequest] | None:
        """Multi-step decode: every running request decodes num_steps tokens back to back, with the KV
        slots of all of them reserved now. None when this is not a pure decode batch (a prefill is
        pending, or a waiting request could be admitted: arrivals wait at most one window) or when the
        free blocks do not cover the window (a normal step then runs, preempting if it must).
        ahead: positions of an in-flight window (overlap schedule) that come first, reserved already."""
        running = self.running
        if not running:
            return None
        if self.waiting and len(running) < self.max_num_seqs:
            return None
        for r in running:  # (per request per step: Request.num_tokens inlined)
            if r.num_computed_tokens != len(r.prompt_token_ids) + len(r.output_token_ids) - 1:
                return None
        pc, bs, k = self.prefix_cache, self.block_size, ahead + num_steps
        if pc is not None:
            for r in running:  # a block can be newly full and written only once computed tokens cross into it
                if r.num_computed_tokens // bs > r.num_published_blocks:
                    pc.publish(r)
        needs = [self._blocks_needed(r, k) for r in running]
        if sum(needs) > self.allocator.num_free:
            return None
        for r, n in zip(running, needs):
            if n:  # most steps of a window need no new block: skip the call (per request per step)
                r.block_table.extend(self.allocator.allocate(n))
        return [ScheduledRequest(r, 1) for r in running]

    def finish(self, req: Request) -> None:
        """Drop a request (finished or aborted) and free its KV blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
