"""The engine's step loop on one background thread, bridged to asyncio.

Only the engine thread touches the LLMEngine (add, abort, step): handlers post commands to an
inbox (a deque) and wake the thread, so the event loop never waits on the engine lock while a step
runs the model. Outputs go back with one `loop.call_soon_threadsafe` per step, into an asyncio
queue per HTTP request (a RequestGroup: its n choices, or a completions batch).

Ordering guarantees: commands run in FIFO order before each step, so an abort posted after an add
always finds the request, and an aborted request gets no output after the step that follows.

Fairness: an HTTP request's engine requests (prompts x n) wait in a queue of their own on the engine
thread, and the loop hands them to the engine round-robin across HTTP requests, only as fast as the
engine can start them (Scheduler.admission_room: a free running slot, at most one step's prefill budget
waiting, cached and shared prompt blocks counted as free). A small
request that arrives behind a large fan-out therefore starts at the next free slot instead of
waiting behind the whole fan-out in the engine's FIFO queue.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    def __init__(self, waiting: int, limit: int) -> None:
        super().__init__(f"the server queue is full ({waiting} requests waiting, limit {limit}); retry later.")


class EngineFailure:
    """Queued in place of an output when the engine failed; `error` is the exception."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Aborted:
    __slots__ = ()

    def __repr__(self) -> str:
        return "ABORTED"


ABORTED = _Aborted()  # queued when the server aborts a request (shutdown): finish_reason "abort"

QueueItem = tuple[int, Any]  # (choice index, RequestOutput | ABORTED | EngineFailure)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True, eq=False)  # identity equality: `group in deque` must not compare fields
class _QueuedGroup:
    """An HTTP request's engine requests not yet handed to the engine (engine thread only)."""

    requests: collections.deque[EngineRequest]
    arrival: float
    added: list[str] = field(default_factory=list)


class RequestGroup:
    """The engine requests behind one HTTP request. Outputs arrive on `queue` as (index, item)."""

    def __init__(self, owner: "AsyncEngine", ids: list[str]) -> None:
        self._owner = owner
        self.ids = ids
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.unfinished = set(ids)
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()

    def abort(self) -> None:
        """Abort what is still running (idempotent; a no-op once all finished). Event-loop thread."""
        if self.unfinished:
            rids, self.unfinished = list(self.unfinished), set()
            self._owner._abort(rids)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._inbox: collections.deque[tuple] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # event-loop thread only:
        self._owners: dict[str, RequestGroup] = {}
        # Engine requests posted but not yet added to the engine (in the inbox or the fair queue). Both
        # threads change it (under the lock), the engine thread right before each add: at worst a moment's
        # under-count, never an over-count that would answer a spurious 429.
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.draining = False
        self.error: BaseException | None = None  # set when the engine thread died
        # engine thread only: request id -> [arrival, last token time]
        self._timing: dict[str, list[float]] = {}
        self._turns: collections.deque[_QueuedGroup] = collections.deque()  # round-robin admission order
        self._queued: dict[str, _QueuedGroup] = {}  # request id -> its group, until added or dropped
        self._taken_in: list[asyncio.Future] = []  # submit() waits on these: resolved after admission
        self._spec_seen: list[int] = []  # the engine's accept histogram already exported
        spec_config = getattr(engine, "spec_config", None)
        self._spec_algorithm = getattr(spec_config, "algorithm", None) or "unknown"
        if metrics is not None:
            metrics.bind_engine_stats(engine.stats, lambda: self._pending)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tercel-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0, release_engine: bool = False) -> None:
        """Abort every request and stop the engine thread; release_engine (the server owns the engine): then
        give back its memory (LLMEngine.shutdown), once the thread has stopped using it."""
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        if release_engine and (self._thread is None or not self._thread.is_alive()):
            self.engine.shutdown()
        elif release_engine:
            log.warning("the engine thread did not stop within %.0f s; its memory is released at exit", timeout_s)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stop

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests; abort those still running after grace_s. Event-loop thread."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d requests in flight get %.1f s to finish", len(self._owners), grace_s)
        assert self._loop is not None
        self._loop.call_later(grace_s, self.abort_all)

    def num_waiting(self) -> int:
        return self.engine.stats().num_waiting + self._pending

    # ---- handler side (event-loop thread) -------------------------------------------------------
    async def submit(self, requests: list[EngineRequest], max_waiting: int | None = None) -> RequestGroup:
        """Queue requests for the engine; they join it in round-robin turns with other HTTP requests.
        Returns once the engine thread has taken them in and admitted what fits (the next loop
        iteration), so a burst of requests is paced by the engine loop and a stream starts while
        its requests still wait. If add_request refuses one (the server validates first, so this
        is rare), the group's queue gets EngineFailure items. The queue check and the bookkeeping
        run without an await in between, so it is race-free."""
        if max_waiting is not None:
            waiting = self.num_waiting()
            if waiting + len(requests) > max_waiting:
                raise QueueFullError(waiting, max_waiting)
        group = RequestGroup(self, [r.request_id for r in requests])
        for rid in group.ids:
            self._owners[rid] = group
        self._change_pending(len(requests))
        assert self._loop is not None
        taken_in: asyncio.Future[None] = self._loop.create_future()
        self._post_command(("add", requests, time.perf_counter(), taken_in))
        try:
            await taken_in
        except BaseException:
            group.abort()  # cancelled (the client left): nothing may keep running
            raise
        return group

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self._owners.pop(rid, None)
        self._post_command(("abort", rids))

    def abort_all(self) -> None:
        """Abort every request in flight; their handlers see ABORTED (finish_reason "abort")."""
        for rid, group in list(self._owners.items()):
            group.queue.put_nowait((group.index[rid], ABORTED))
            group.unfinished.discard(rid)
        if self._owners:
            self._abort(list(self._owners))

    def _post_command(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    # callbacks run on the event loop, posted by the engine thread
    @staticmethod
    def _resolve(futures: list[asyncio.Future]) -> None:
        for fut in futures:
            if not fut.done():
                fut.set_result(None)

    def _change_pending(self, delta: int) -> None:  # either thread
        with self._pending_lock:
            self._pending += delta

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            group = self._owners.get(out.request_id)
            if group is None:  # aborted meanwhile
                continue
            idx = group.index[out.request_id]
            if out.finished:
                del self._owners[out.request_id]
                group.unfinished.discard(out.request_id)
            group.queue.put_nowait((idx, out))

    def _fail(self, rids: list[str], error: BaseException) -> None:
        for rid in rids:
            group = self._owners.pop(rid, None)
            if group is not None:
                group.unfinished.discard(rid)
                group.queue.put_nowait((group.index[rid], EngineFailure(error)))

    # ---- engine thread ------------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _run(self) -> None:
        try:
            while not self._stop:
                self._taken_in = self._process_inbox()
                self._admit()
                if self._taken_in:
                    self._post(self._resolve, self._taken_in)
                    self._taken_in = []
                if self._stop:
                    break
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug or OOM in a step: fail its requests, keep serving
                    log.exception("engine step failed; aborting the requests in flight")
                    rids = list(self.engine.requests)
                    for rid in rids:
                        self.engine.abort_request(rid)
                        self._timing.pop(rid, None)
                    self._post(self._fail, rids, e)
                    continue
                if outputs:
                    self._record(outputs)
                    self._record_spec()
                    self._post(self._deliver, outputs)
                elif not self.engine.scheduler.running:
                    time.sleep(0.005)  # nothing could be scheduled: do not spin
        except BaseException as e:  # pragma: no cover - the loop itself broke
            log.exception("the engine loop died")
            self.error = e
            self._post(self._fail, list(self.engine.requests) + list(self._queued), e)
        finally:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            for group in list(self._turns):  # never admitted: their handlers saw ABORTED or the failure
                self._drop(group, list(group.requests))
            # taken in by an iteration that broke, or posted after the loop stopped
            late = self._taken_in + [cmd[3] for cmd in self._inbox if cmd[0] == "add"]
            if late:
                self._post(self._resolve, late)

    def _process_inbox(self) -> list[asyncio.Future]:
        """Run the posted commands; returns the futures of the add commands taken in."""
        taken_in: list[asyncio.Future] = []
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "add":
                _, requests, arrival, fut = cmd
                group = _QueuedGroup(collections.deque(requests), arrival)
                for r in requests:
                    self._queued[r.request_id] = group
                self._turns.append(group)
                taken_in.append(fut)
            elif cmd[0] == "abort":
                dropped: dict[int, tuple[_QueuedGroup, list[EngineRequest]]] = {}
                for rid in cmd[1]:
                    group = self._queued.get(rid)
                    if group is None:
                        self.engine.abort_request(rid)
                        self._timing.pop(rid, None)
                    else:
                        dropped.setdefault(id(group), (group, []))[1].append(rid)
                for group, rids in dropped.values():
                    gone = set(rids)
                    self._drop(group, [r for r in group.requests if r.request_id in gone])
        return taken_in

    def _drop(self, group: _QueuedGroup, requests: list[EngineRequest]) -> None:
        """Take requests out of a group's queue (aborted, or the group failed)."""
        gone = {r.request_id for r in requests}
        for rid in gone:
            self._queued.pop(rid, None)
        group.requests = collections.deque(r for r in group.requests if r.request_id not in gone)
        if not group.requests and group in self._turns:
            self._turns.remove(group)
        self._change_pending(-len(gone))

    def _admit(self) -> None:
        """Add queued requests to the engine, one per HTTP request in turn, while it has room."""
        if not self._turns:
            return
        room = self.engine.scheduler.admission_room()
        prompt_tokens = 0
        while self._turns and room.slots > 0 and room.tokens > 0:
            group = self._turns.popleft()
            r = group.requests.popleft()
            del self._queued[r.request_id]
            self._change_pending(-1)
            try:
                self.engine.add_request(r.prompt_token_ids, r.params, r.request_id)
            except Exception as e:  # all or nothing for a group: undo what it already added
                for rid in group.added:
                    self.engine.abort_request(rid)
                    self._timing.pop(rid, None)
                self._post(self._fail, group.added + [r.request_id] + [q.request_id for q in group.requests], e)
                self._drop(group, list(group.requests))
                continue
            group.added.append(r.request_id)
            self._timing[r.request_id] = [group.arrival, 0.0]
            prompt_tokens += len(r.prompt_token_ids)
            room.take(self.engine.requests[r.request_id])
            if group.requests:
                self._turns.append(group)
        if prompt_tokens and self.metrics is not None:
            self.metrics.prompt_tokens.inc(prompt_tokens)

    def _record_spec(self) -> None:
        """Export the engine's speculative accept counters (deltas since the last step)."""
        spec_stats = getattr(self.engine, "spec_stats", None)
        stats = spec_stats() if spec_stats is not None and self.metrics is not None else None
        if stats is None:
            return
        hist = stats.accept_histogram  # index k: verify steps that accepted k drafts (k + 1 tokens)
        for k, total in enumerate(hist):
            new = total - (self._spec_seen[k] if k < len(self._spec_seen) else 0)
            if new > 0:
                self.metrics.observe_spec_accept(self._spec_algorithm, k + 1, new)
        self._spec_seen = list(hist)
        if stats.accept_rate is not None:
            self.metrics.spec_accept_rate.labels(self._spec_algorithm).set(stats.accept_rate)

    def _record(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            t = self._timing.get(out.request_id)
            n = len(out.delta_token_ids)
            if m is not None and n:
                m.generation_tokens.inc(n)
            if t is None:
                continue
            if m is not None:
                if t[1] == 0.0:
                    m.ttft.observe(now - t[0])
                elif n:  # several tokens in one step (speculative decoding) share the gap
                    gap = (now - t[1]) / n
                    for _ in range(n):
                        m.itl.observe(gap)
                if out.finished:
                    m.e2e.observe(now - t[0])
            t[1] = now
            if out.finished:
                del self._timing[out.request_id]
