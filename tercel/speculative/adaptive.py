"""Adaptive speculation: per step, the number of tokens verified per request (the width; 1 = a plain
decode step, no drafts) that maximises expected tokens per second.

  cost model   seconds of one step per (batch bucket, width): the target forward, timed on a dummy
               batch the first time a bucket is used (graph replays where captured, else eager), plus
               the rest of the step (drafting, draft_extend, acceptance, host work), a moving average
               of real steps' wall time minus that forward, kept apart for speculative and plain steps
  accept stats per request, a decayed count of accepted / offered draft positions: alpha, the chance
               that a draft is accepted given the one before it was (a geometric model)
  policy       argmax over the candidate widths of sum_r E[accepted + 1 | w, alpha_r] / cost(bucket, w), each
               request at its own alpha while others queue for a slot (throughput), else every one at the
               batch's lowest (no request may lose: an unrefilled batch ends at its slowest member's pace);
               while the answer stays 1 it still probes the cheapest speculative width now and then
               (exponential back-off), so acceptance that was low can recover; never a width whose measured
               cost no acceptance could repay
  step costs   an unchained step's cost is its whole engine cycle, from its start to the next step's (the
               scheduler, output processing and the caller's loop included); a chained step's, its run's
               whole time over its steps, or, where the policy ended the run, the pace of its reads, as a plain
               window's pace is (that run's start and end count once per switch)

Plain steps of drafters that read target hidden states (EAGLE, DFlash) keep those states on the request
(`defer`) instead of running the draft over every token; one draft_extend over all of them (`flush`)
runs when speculation turns back on or the buffer fills. Nothing here changes which tokens are emitted:
the worker verifies whatever width is chosen with the same lossless acceptance.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..batching import same_batch
from ..dev_overrides import env
from ..options import ConfigError
from ..request import Request
from .drafter import Drafter, ExtendedChunk

PRIOR_ALPHA = 0.6  # the first requests' acceptance guess; later ones start from the recent requests' average
PRIOR_WEIGHT = 2.0  # worth two observed positions, so real verifies take over at once
DECAY = 0.8  # per verify: the stats follow the text as it changes (code, prose, a repeated list)
# deferred hidden rows per request before a draft_extend runs anyway: DEFER_ROWS over the batch (bounds memory), at
# least DEFER_FLOOR and at most DEFER_CAP per request (bounds the eager draft_extend). A request that finishes inside
# its plain stretch never pays for its rows, so at small batches the catch-up runs only when speculation resumes
DEFER_ROWS = 32768
DEFER_FLOOR = 128
DEFER_CAP = 512
OBSERVED_WINDOW = 9  # a width's step cost is the median of its last this many real steps (host noise)
ALPHA_CEILING = 0.9  # a probe is skipped where even this acceptance would not pay for the width's measured cost
HOPELESS_AFTER = 3  # ... once that cost rests on this many real steps
SWITCH_GAIN = 1.05  # from plain, speculation must promise this much more (a switch costs a draft_extend)
FLOOR_SMOOTHING = 0.25  # weight of the newest batch in AdaptiveSpec.floors
PROBE_SHARE = 0.03  # a probe may cost at most this share of the plain stretch after it (by the measured costs)
PROBE_FIRST = 32  # plain steps before a bucket's first probe
PROBE_MAX = 2048  # the most plain steps between probes (TERCEL_ADAPTIVE_PROBE_MAX)
# a probe that starts a chain runs this many chained steps before the policy may end it: a run of one step can only
# be costed whole (its start and end in its one step), which kept the chain's cost at 1.7-2x its pace and the policy
# plain where the chain paid
PROBE_CHAIN_STEPS = 4
# a lone request with no verify yet and a fresh draft state (just prefilled) runs its first decode at the full width,
# unless that step costs more than this many plain steps: its own acceptance, not the last requests', decides
FRESH_PROBE_RATIO = 3.0


def check_adaptive(value: object) -> bool:
    """speculative_adaptive as a bool (True / False, or "on" / "off"), else a ConfigError naming the fix."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    raise ConfigError(f"speculative_adaptive={value!r} must be True or False (CLI: --speculative-adaptive on|off); "
                      f"off verifies num_draft_tokens on every step.")


def expected_tokens(alpha: float, width: int) -> float:
    """E[accepted + 1] when width - 1 drafts are verified and each is accepted with probability alpha given
    its parent was: 1 + alpha + ... + alpha^(width - 1)."""
    if alpha >= 1.0:
        return float(width)
    return (1.0 - alpha ** width) / (1.0 - alpha)


def shrunk_alphas(stats: Sequence["RequestAcceptStats"]) -> list[float]:
    """Each request's alpha shrunk toward the batch's pooled one by how much of its spread is noise (empirical Bayes,
    by moments): a decayed count rests on ~10-15 positions, so over 16 requests that accept alike the lowest raw
    alpha sits ~0.2 under their common one (1.8 standard deviations), while a request that really accepts less
    shows a spread that noise does not explain and keeps most of its distance. Noise of request r: p(1 - p) / its
    positions; the spread between requests: the alphas' variance around the pool less the mean noise."""
    if len(stats) < 2:
        return [st.alpha for st in stats]
    offered = sum(st.offered for st in stats)
    pool = sum(st.accepted for st in stats) / offered if offered > 0 else PRIOR_ALPHA
    alphas = [st.alpha for st in stats]
    noise = [pool * (1.0 - pool) / max(st.offered, 1e-9) for st in stats]
    spread = sum((a - pool) ** 2 for a in alphas) / len(alphas) - sum(noise) / len(noise)
    if spread <= 0.0:
        return [pool] * len(alphas)
    return [pool + spread / (spread + n) * (a - pool) for a, n in zip(alphas, noise)]


def candidate_widths(num_draft_tokens: int, branching: bool) -> tuple[int, ...]:
    """Widths the policy may choose: a chain can be cut anywhere (1, 2, 4, full); a tree is on or off."""
    if branching:
        return tuple(sorted({1, num_draft_tokens}))
    return tuple(sorted({w for w in (1, 2, 4, num_draft_tokens) if w <= num_draft_tokens}))


@dataclass(slots=True)
class RequestAcceptStats:
    """One request's running acceptance (Request.spec_adaptive) and its deferred target hidden rows."""
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    offered: float = PRIOR_WEIGHT
    deferred: list[torch.Tensor] = field(default_factory=list)  # [n, H] chunks, positions deferred_start ..
    deferred_start: int = 0
    deferred_rows: int = 0
    verifies: int = 0  # verifies recorded (0: the alpha is the prior)

    @property
    def alpha(self) -> float:
        return self.accepted / self.offered if self.offered > 0 else PRIOR_ALPHA

    def record(self, drafts: int, accepted: int, decay: float = DECAY) -> None:
        """A verify offered `drafts` positions and accepted the first `accepted`: accepted + 1 positions were
        tried (the first rejected one included), unless every draft was accepted."""
        if drafts <= 0:
            return
        tried = accepted + (1 if accepted < drafts else 0)
        self.verifies += 1
        self.accepted = decay * self.accepted + accepted
        self.offered = decay * self.offered + tried

    def deferred_end(self) -> int:
        return self.deferred_start + self.deferred_rows


def stats_of(r: Request, prior: float = PRIOR_ALPHA) -> RequestAcceptStats:
    st = r.spec_adaptive
    if not isinstance(st, RequestAcceptStats):
        st = r.spec_adaptive = RequestAcceptStats(prior * PRIOR_WEIGHT, PRIOR_WEIGHT)
    return st


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to max_num_seqs (and max_num_seqs itself): a batch is costed at the next one up."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_num_seqs])


@dataclass(slots=True)
class CostModel:
    """Step seconds by (batch bucket, width). step_s: the median of the last real steps at that width once
    one ran (one slow step on a busy host moves nothing); before that the measured target forward (forward_s)
    plus the rest of a step (overhead_s, key: bucket, speculative?, learnt from the other widths' real steps).
    An unknown overhead counts as 0, so the first speculative step at a bucket runs and measures what drafting
    really costs."""
    buckets: tuple[int, ...]
    forward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    overhead_s: dict[tuple[int, bool], float] = field(default_factory=dict)
    observed_s: dict[tuple[int, int], float] = field(default_factory=dict)
    recent_s: dict[tuple[int, int], collections.deque] = field(default_factory=dict)
    # (bucket, width) -> its first real step's wall: past that step, later ones are its cost (observe)
    first_s: dict[tuple[int, int], float] = field(default_factory=dict)
    switches_s: dict[int, collections.deque] = field(default_factory=dict)  # bucket -> recent flushes' seconds
    # bucket -> recent chain runs' seconds beyond their steps' pace (the start before the first read, the end)
    excursions_s: dict[int, collections.deque] = field(default_factory=dict)
    # bucket -> recent probes' whole cost: from the last plain window read before one to the first after it, less
    # the plain steps' worth of tokens the batch gained in between (CostModel.observe_probe)
    probes_s: dict[int, collections.deque] = field(default_factory=dict)
    stale: set[tuple[int, int]] = field(default_factory=set)  # keys observed since their median was taken
    bucket_of: dict[int, int] = field(default_factory=dict)  # batch size -> its bucket (asked several times a step)
    smoothing: float = 0.25  # weight of the newest step in the overhead's moving average

    def bucket(self, batch_size: int) -> int:
        b = self.bucket_of.get(batch_size)
        if b is None:
            i = bisect.bisect_left(self.buckets, batch_size)
            b = self.bucket_of[batch_size] = self.buckets[min(i, len(self.buckets) - 1)]
        return b

    def knows(self, batch_size: int, widths: Sequence[int]) -> bool:
        b = self.bucket(batch_size)
        return all((b, w) in self.forward_s for w in widths)

    def step_s(self, batch_size: int, width: int) -> float:
        b = self.bucket(batch_size)
        if (b, width) in self.stale:  # the median when it is read, not per observed window (one per token at bs 1)
            self.stale.discard((b, width))
            self.observed_s[b, width] = statistics.median(self.recent_s[b, width])
        seen = self.observed_s.get((b, width))
        if seen is not None:
            if width == 1 and len(self.recent_s[b, 1]) < HOPELESS_AFTER:
                # a plain pace on one or two windows may carry a flush or a batch change: too dear, it would make
                # speculation look cheap. Until it rests on more, it is at most the synced forward (an overlapped
                # window runs no slower than that); a dear speculative sample errs the safe way and stands
                return min(seen, self.forward_s[b, 1])
            return seen
        return max(1e-9, self.forward_s[b, width] + self.overhead_s.get((b, width > 1), 0.0))

    def _average(self, table: dict, key: tuple, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def observations(self, batch_size: int, width: int) -> int:
        """Real steps behind step_s(batch_size, width) (0: it is the forward-based estimate)."""
        return len(self.recent_s.get((self.bucket(batch_size), width), ()))

    def observe(self, batch_size: int, width: int, wall_s: float) -> None:
        """A real step took wall_s: update that width's average and the overhead beyond its forward. The first
        real step at each (bucket, width) is not its cost: it carries one-time work (a kernel's first compile for
        new shapes, a graph captured on first use), and one such sample would stand as the width's median and
        keep the policy off a width that pays."""
        b = self.bucket(batch_size)
        if (b, width) not in self.forward_s:
            return
        if (b, width) not in self.first_s:
            self.first_s[b, width] = wall_s
            return
        recent = self.recent_s.setdefault((b, width), collections.deque(maxlen=OBSERVED_WINDOW))
        recent.append(wall_s)
        self.stale.add((b, width))
        self._average(self.overhead_s, (b, width > 1), wall_s - self.forward_s[b, width])

    def probe_s(self, batch_size: int, width: int) -> float:
        """What a probe of this width is taken to cost when spacing probes: step_s, or, before any real step but
        the first, at least that first one (it may carry one-time work, so it is no step cost, but a width whose
        first step was dear is probed again only after a stretch that pays for it)."""
        cost = self.step_s(batch_size, width)
        if self.observations(batch_size, width) == 0:
            cost = max(cost, self.first_s.get((self.bucket(batch_size), width), 0.0))
        return cost

    def observe_switch(self, batch_size: int, wall_s: float) -> None:
        """A switch from plain to speculative steps ran its deferred draft_extend in wall_s: no step's cost (it is
        paid once per switch), but a probe forces one, so the probe's spacing counts it (switch_s)."""
        recent = self.switches_s.setdefault(self.bucket(batch_size), collections.deque(maxlen=OBSERVED_WINDOW))
        recent.append(wall_s)

    def observe_chain(self, batch_size: int, width: int, steps: int, began: float, first_read: float,
                      last_read: float, ended: float) -> None:
        """The policy ended a chain run of `steps` chained steps: the step cost is the pace of its reads after the
        first (as a plain window's pace is), and what the run took beyond steps x pace (staging the chain and its
        first step's wait before the first read, the draft state handed back at the end) is paid once per switch,
        as a flush is. Counted into the run's steps, runs of a few steps read ~1.6x the fixed chain's step at one
        request on an H100 and kept the policy plain where the chain pays. (A run the batch's changes end is
        costed whole: there the restarts come with the chain.) One step: its whole cycle is its cost."""
        if steps < 2:
            self.observe(batch_size, width, (ended - began) / max(steps, 1))
            return
        pace = (last_read - first_read) / (steps - 1)
        self.observe(batch_size, width, pace)
        recent = self.excursions_s.setdefault(self.bucket(batch_size), collections.deque(maxlen=OBSERVED_WINDOW))
        recent.append(max(0.0, ended - began - steps * pace))

    def observe_probe(self, batch_size: int, cost_s: float) -> None:
        """A probe, from the last plain window read before it to the first one after, cost cost_s beyond the plain
        steps it stood in for: its flush, its steps, the chain's start and end, the overlap schedule's pipeline
        drained and refilled around it, whatever its parts' costs leave out. Negative: it gained (counted as 0)."""
        recent = self.probes_s.setdefault(self.bucket(batch_size), collections.deque(maxlen=OBSERVED_WINDOW))
        recent.append(max(0.0, cost_s))

    def probe_cost_s(self, batch_size: int) -> float | None:
        """The median whole cost of the recent probes at this batch's bucket (None: none measured yet)."""
        recent = self.probes_s.get(self.bucket(batch_size))
        return statistics.median(recent) if recent else None

    def switch_s(self, batch_size: int) -> float:
        """What a switch to speculation costs beyond its steps at this batch's bucket (0: none seen): the median
        deferred draft_extend before it and the median chain run's start and end."""
        b = self.bucket(batch_size)
        return sum(statistics.median(d) for d in (self.switches_s.get(b), self.excursions_s.get(b)) if d)

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """What the policy believes, per "bucket x width": the step time it uses (ms), the dummy forward's (ms)
        and how many real steps stand behind the first (0: the forward plus the learnt overhead). Benchmarks
        record it beside the measured pace, to tell a wrong choice from a wrong cost."""
        out: dict[str, dict[str, float | int]] = {}
        for b, w in sorted(self.forward_s):
            out[f"{b}x{w}"] = {"step_ms": round(self.step_s(b, w) * 1e3, 4),
                               "forward_ms": round(self.forward_s[b, w] * 1e3, 4), "observed": self.observations(b, w)}
        return out

    def measure(self, batch_size: int, widths: Sequence[int], prepare: Callable[[int, int], Callable[[], None]],
                sync: Callable[[], None], reps: int = 2, clock: Callable[[], float] = time.perf_counter) -> None:
        """Time the forward of each width not known yet at this batch's bucket: prepare(bucket, width) builds its
        dummy batch once and returns the forward over it, so only the forward is timed (building a dummy batch is
        no step's cost, and where the policy speculates from the start no real plain step ever corrects it). A
        warm-up, then `reps` rounds over the widths in turn, keeping each one's best (other processes only ever
        add time, and taking turns spreads a busy spell over all widths). A narrower forward never costs more than
        a wider one: a noisy narrow time is capped at the wider one's."""
        b = self.bucket(batch_size)
        todo = sorted(w for w in widths if (b, w) not in self.forward_s)
        best = dict.fromkeys(todo, float("inf"))
        forwards = {w: prepare(b, w) for w in todo}
        for w in todo:
            forwards[w]()
        for _ in range(reps):
            for w in todo:
                sync()
                t = clock()
                forwards[w]()
                sync()
                best[w] = min(best[w], clock() - t)
        self.forward_s.update({(b, w): s for w, s in best.items()})
        cap = float("inf")
        for w in sorted((w for bb, w in self.forward_s if bb == b), reverse=True):
            cap = self.forward_s[b, w] = min(self.forward_s[b, w], cap)


@dataclass(slots=True)
class ProbeSchedule:
    """One batch bucket's plain stretch and probe back-off: whether speculation pays depends on the batch size (a
    chain that wins alone may lose at 64 requests), so speculation holding at one bucket must not shorten another
    bucket's stretches."""
    every: int  # plain steps between probes
    plain_run: int = 0  # plain steps since the last probe or speculative step
    spec_run: int = 0  # speculative steps chosen on their merits in a row


@dataclass(slots=True)
class PlainGrant:
    """A plain stretch granted to one batch: its bucket's schedule and the plain steps due before the probe."""
    schedule: ProbeSchedule
    stretch: int

    def left(self) -> int:
        return max(0, self.stretch - 1 - self.schedule.plain_run)


@dataclass(slots=True)
class WidthPolicy:
    """The width that maximises expected tokens per second; probes the cheapest speculative width (by the cost
    model) after a run of plain steps (first after probe_first of them, then at least twice as long each time, up
    to probe_max), and only once the probe costs at most probe_share of the plain stretch before it and of the one
    after it: a probe that finds acceptance low again costs least there, and one that finds it high lets the
    policy widen on its merits. The back-off starts over only after speculation held for probe_first steps: a
    probe whose speculation stops again at once (it paid on paper, not in the steps it then measured) does not
    shorten the next stretch. Stretches and back-off are kept per batch bucket (ProbeSchedule)."""
    probe_first: int = PROBE_FIRST
    probe_max: int = PROBE_MAX
    probe_share: float = PROBE_SHARE
    width: int = 1  # the last width chosen on its merits (1: plain)
    probed: bool = False  # the last choice was a probe
    schedules: dict[int, ProbeSchedule] = field(default_factory=dict)

    def schedule(self, costs: CostModel, batch_size: int) -> ProbeSchedule:
        b = costs.bucket(batch_size)
        s = self.schedules.get(b)
        if s is None:
            s = self.schedules[b] = ProbeSchedule(self.probe_first)
        return s

    def best(self, costs: CostModel, batch_size: int, alphas: Sequence[float], widths: Sequence[int]) -> int:
        """The width of the most expected tokens per second; a speculative width other than the one running must
        beat it by SWITCH_GAIN (near a tie, switching back and forth costs more than either choice: from plain a
        draft_extend, from the chained full width the chain's end and restart around an unchained step)."""
        rates = []
        for w in widths:  # asked per window and per chained step over the whole batch: no per-row Python frames
            tokens = float(len(alphas)) if w == 1 else sum(map(expected_tokens, alphas, itertools.repeat(w)))
            rate = tokens / costs.step_s(batch_size, w)
            rates.append((rate if w == 1 or w == self.width else rate / SWITCH_GAIN, -w))
        return -max(rates)[1]  # ties go to the narrower width

    def probe(self, costs: CostModel, batch_size: int, widths: Sequence[int]) -> tuple[int, int]:
        """The next probe's width (of the widths that could pay, the cheapest step that measures acceptance, by its
        measured cost: a chained full-width EAGLE step costs less than a narrower unchained one) and the plain steps
        that must run before it: the bucket's stretch, and enough that the probe (CostModel.probe_s), with the
        deferred draft_extend it forces (CostModel.switch_s), costs at most probe_share of them."""
        spec = [w for w in widths if w > 1]
        payable = [w for w in spec if self.could_pay(costs, batch_size, w)] or spec  # none: choose() stays plain
        w = min(payable, key=lambda w: (costs.step_s(batch_size, w), w))
        cost = costs.probe_s(batch_size, w) + costs.switch_s(batch_size)  # the draft_extend the probe forces too
        seen = costs.probe_cost_s(batch_size)  # what whole probes cost here, where more than their parts say
        if seen is not None:
            cost = max(cost, seen)
        dear = math.ceil(cost / (self.probe_share * costs.step_s(batch_size, 1)))
        return w, min(max(self.schedule(costs, batch_size).every, dear), self.probe_max)

    def plain_budget(self, costs: CostModel, batch_size: int, widths: Sequence[int]) -> int:
        """Plain steps left before the next probe at this batch's bucket."""
        return self.grant(costs, batch_size, widths).left()

    def grant(self, costs: CostModel, batch_size: int, widths: Sequence[int]) -> PlainGrant:
        """The stretch up to this bucket's next probe, fixed now: while the batch stays the same its plain windows
        ask only how much of it is left (asking probe() again each window cost ~7 µs of Python)."""
        return PlainGrant(self.schedule(costs, batch_size), self.probe(costs, batch_size, widths)[1])

    def choose(self, costs: CostModel, batch_size: int, alphas: Sequence[float], widths: Sequence[int]) -> int:
        s = self.schedule(costs, batch_size)
        w = self.best(costs, batch_size, alphas, widths)
        self.width, self.probed = w, False
        if w > 1 or len(widths) == 1:
            s.plain_run = 0
            s.spec_run += 1
            if s.spec_run >= self.probe_first:  # speculation held: when it stops, probe again soon
                s.every = self.probe_first
            return w
        s.spec_run = 0
        s.plain_run += 1
        w, stretch = self.probe(costs, batch_size, widths)
        if s.plain_run < stretch:
            return 1
        # the next stretch: twice this one, and long enough that this probe is at most probe_share of it
        s.plain_run, s.every = 0, min(max(2 * s.every, stretch), self.probe_max)
        self.probed = self.could_pay(costs, batch_size, w)
        return w if self.probed else 1

    @staticmethod
    def could_pay(costs: CostModel, batch_size: int, width: int) -> bool:
        """Could any acceptance make this width pay here? No when one of its steps costs more plain steps than it
        would yield at ALPHA_CEILING (a tree run eagerly at a large batch, say): probing it again would only lose
        time. Its cost is the median of its real steps once HOPELESS_AFTER of them ran; before that its measured
        forward alone, which no step of that width undercuts (a first slow step may be one-off work, but the
        forward was timed warm)."""
        if costs.observations(batch_size, width) >= HOPELESS_AFTER:
            cost = costs.step_s(batch_size, width)
        else:
            cost = costs.forward_s.get((costs.bucket(batch_size), width))
            if cost is None:  # not measured at this bucket yet
                return True
        return expected_tokens(ALPHA_CEILING, width) * costs.step_s(batch_size, 1) > cost


@dataclass(slots=True)
class _Segment:
    """Plain windows' hidden rows over one unchanged batch, as the windows made them ([n, B, H] each)."""
    reqs: list[Request]
    cols: dict[int, int]  # id(request) -> its column (a dropped request leaves)
    parts: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0


@dataclass(slots=True)
class AdaptiveSpec:
    """The worker's adaptive state: cost model, policy and the chosen-width counts."""
    costs: CostModel
    policy: WidthPolicy = field(default_factory=WidthPolicy)
    defer_cap: int = DEFER_CAP
    defer_rows: int = DEFER_ROWS
    # every request's verifies, decayed slowly: a new request's prior (the same text source, likely)
    recent: RequestAcceptStats = field(default_factory=RequestAcceptStats)
    segment: _Segment | None = None  # the plain windows' rows not split per request yet (defer_window)
    # bucket -> the lowest alpha of a batch whose requests were all verified (a moving average): what a batch of
    # requests not verified yet is weighed at, since the lowest of several unknown alphas sits well below their mean
    floors: dict[int, float] = field(default_factory=dict)
    lowest: bool = True  # with nothing queued, weigh the batch at its lowest alpha (TERCEL_ADAPTIVE_BATCH_ALPHA)
    pooled: bool = True  # ... each request's alpha first shrunk toward the batch's pooled one (shrunk_alphas)
    pinned: bool = False  # TERCEL_ADAPTIVE_PIN=plain: every decode step plain, no probes (a measurement switch)
    fresh_probe: bool = True  # a fresh lone request starts at the full width (fresh_width; TERCEL_ADAPTIVE_FRESH_PROBE)

    @classmethod
    def for_batches(cls, max_num_seqs: int) -> "AdaptiveSpec":
        rule = env("TERCEL_ADAPTIVE_BATCH_ALPHA")
        if rule not in ("pooled", "min", "mean"):
            raise ConfigError(f"TERCEL_ADAPTIVE_BATCH_ALPHA={rule!r} must be pooled, min or mean (unset: pooled)")
        pin = env("TERCEL_ADAPTIVE_PIN")
        if pin not in ("", "plain"):
            raise ConfigError(f"TERCEL_ADAPTIVE_PIN={pin!r} must be plain or unset")
        share = env("TERCEL_ADAPTIVE_PROBE_SHARE")
        try:
            probe_share = float(share)
        except ValueError:
            probe_share = -1.0
        if not 0.0 < probe_share < 1.0:
            raise ConfigError(f"TERCEL_ADAPTIVE_PROBE_SHARE={share!r} must be a number in (0, 1) "
                              f"(unset: {PROBE_SHARE})")
        most = env("TERCEL_ADAPTIVE_PROBE_MAX")
        probe_max = int(most) if most.isdigit() else 0
        if probe_max < 1:
            raise ConfigError(f"TERCEL_ADAPTIVE_PROBE_MAX={most!r} must be an integer >= 1 (unset: "
                              f"{PROBE_MAX})")
        policy = WidthPolicy(probe_first=min(PROBE_FIRST, probe_max), probe_max=probe_max,
                             probe_share=probe_share)
        fresh = env("TERCEL_ADAPTIVE_FRESH_PROBE")
        if fresh not in ("0", "1"):
            raise ConfigError(f"TERCEL_ADAPTIVE_FRESH_PROBE={fresh!r} must be 0 or 1 (unset: 1)")
        return cls(CostModel(default_buckets(max_num_seqs)), policy, lowest=rule != "mean", pooled=rule == "pooled",
                   pinned=pin == "plain", fresh_probe=fresh == "1")

    def alphas(self, reqs: Sequence[Request], queued: bool) -> list[float]:
        """The acceptance the policy weighs for each request. queued (requests wait for a slot): the batch's
        throughput decides, each request at its own alpha, since a finished request's slot is refilled at once.
        Else no request may lose: each is weighed at the lowest alpha among them, because a batch that is not
        refilled ends at its slowest member's pace (a drafted step costs every row, while the row that accepts
        least gains least), and a served request's latency is its own. Requests not verified yet count at the
        lowest alpha that the last fully verified batches of this size showed (floors), not at the prior."""
        prior = self.recent.alpha
        stats = [stats_of(r, prior) for r in reqs]
        alphas = [st.alpha for st in stats]
        if queued or len(alphas) < 2 or not self.lowest:
            return alphas
        b = self.costs.bucket(len(reqs))
        verified = [st for st in stats if st.verifies]
        known = shrunk_alphas(verified) if self.pooled else [st.alpha for st in verified]
        if len(known) == len(alphas):
            low = min(known)
            old = self.floors.get(b)
            self.floors[b] = low if old is None else old + FLOOR_SMOOTHING * (low - old)
        else:  # requests not verified yet: each could be the batch's slowest
            low = min(known + [min(prior, self.floors.get(b, prior))])
        return [low] * len(alphas)

    def choose(self, reqs: Sequence[Request], widths: Sequence[int],
               prepare: Callable[[int, int], Callable[[], None]], sync: Callable[[], None],
               queued: bool = False) -> int:
        self.policy.probed = False
        if self.pinned:
            return 1
        if not self.costs.knows(len(reqs), widths):
            self.costs.measure(len(reqs), widths, prepare, sync)
            # the first step at a bucket runs the full width: the forwards alone miss what drafting costs and
            # the acceptance is a prior, so one real step measures both before the policy weighs them; unless
            # its forward alone costs more plain forwards than it could yield at ALPHA_CEILING (an eager tree
            # past the speculative graphs' largest batch): then the policy decides from the start
            b, full = self.costs.bucket(len(reqs)), max(widths)
            if expected_tokens(ALPHA_CEILING, full) * self.costs.forward_s[b, 1] > self.costs.forward_s[b, full]:
                return full
        fresh = self.fresh_width(reqs, widths)
        if fresh is not None:
            self.policy.probed = True  # a chain holds it for PROBE_CHAIN_STEPS (ChainLoop.time_from)
            return fresh
        return self.policy.choose(self.costs, len(reqs), self.alphas(reqs, queued), widths)

    def fresh_width(self, reqs: Sequence[Request], widths: Sequence[int]) -> int | None:
        """The full width for a lone request that is fresh (no verify yet, its draft state just set by its prefill,
        so no deferred draft_extend to pay) where that step costs at most FRESH_PROBE_RATIO plain steps; else None.
        A new request's prior is the last requests' acceptance, and at one request on an H100 (de69b85) a code
        prompt after a chat prompt decoded plain to its end (the next probe was ~500 steps away) where the chain ran
        it at ~1.5x: its own first steps now say whether it pays. Batches of several fresh requests keep their
        floors (AdaptiveSpec.alphas): there a few speculative steps at a pass's start cost 6-17% of a 16-request
        pass (H200 2e40fc6, H100 de69b85)."""
        if not self.fresh_probe or self.pinned or len(widths) < 2 or len(reqs) != 1:
            return None
        for r in reqs:
            st = r.spec_adaptive
            if isinstance(st, RequestAcceptStats) and (st.verifies or st.deferred_rows or self._in_segment(r)):
                return None
        full = max(widths)
        if self.costs.step_s(len(reqs), full) > FRESH_PROBE_RATIO * self.costs.step_s(len(reqs), 1):
            return None
        return full

    def plain_steps(self, reqs: Sequence[Request], widths: Sequence[int], queued: bool = False) -> PlainGrant | None:
        """The plain steps the policy grants these decoding requests now, to run as decode windows at plain speed
        (the engine's multi-step / overlap path); None: the next step goes through the worker (a speculative step,
        a probe, or a bucket whose costs are not measured yet)."""
        if len(widths) == 1 or self.pinned:  # nothing to probe at this batch (no speculative graph here), or pinned
            s = self.policy.schedule(self.costs, len(reqs))
            return PlainGrant(s, s.plain_run + 1 + self.policy.probe_max)  # probe_max steps left
        if not self.costs.knows(len(reqs), widths) or self.fresh_width(reqs, widths) is not None:
            return None
        if self.policy.best(self.costs, len(reqs), self.alphas(reqs, queued), widths) != 1:
            return None
        return self.policy.grant(self.costs, len(reqs), widths)

    def ran_plain(self, num_steps: int, batch_size: int, wall_s_per_step: float | None) -> None:
        """A decode window of num_steps plain steps ran (wall_s_per_step: its measured pace, when known)."""
        self.policy.schedule(self.costs, batch_size).plain_run += num_steps
        if wall_s_per_step is not None:
            self.costs.observe(batch_size, 1, wall_s_per_step)

    def record(self, r: Request, drafts: int, accepted: int) -> None:
        stats_of(r, self.recent.alpha).record(drafts, accepted)
        self.recent.record(drafts, accepted, decay=0.95)

    # ---- deferred draft_extend ---------------------------------------------------------------
    def _in_segment(self, r: Request) -> bool:
        seg = self.segment
        if seg is None:
            return False
        col = seg.cols.get(id(r))
        return col is not None and seg.reqs[col] is r

    def has_deferred(self, r: Request) -> bool:
        """Does r's deferred buffer bring its draft state up to num_computed_tokens?"""
        st = r.spec_adaptive
        if not isinstance(st, RequestAcceptStats):
            return False
        rows = st.deferred_rows + (self.segment.rows if self._in_segment(r) else 0)
        return rows > 0 and st.deferred_start + rows == r.num_computed_tokens

    def drop_deferred(self, r: Request) -> None:
        if self._in_segment(r):
            del self.segment.cols[id(r)]
        if isinstance(r.spec_adaptive, RequestAcceptStats):
            r.spec_adaptive.deferred.clear()
            r.spec_adaptive.deferred_rows = 0

    def defer_window(self, reqs: Sequence[Request], hidden: torch.Tensor, drafter: Drafter) -> None:
        """A plain decode window's tokens are counted: hidden [n, B, H] (its own tensor), request i's rows in
        column i. While the batch stays the same the windows' tensors are only kept (no work per request: at a
        large batch that work would slow the plain steps down); they are split per request when it changes."""
        seg = self.segment
        if seg is None or not same_batch(seg.reqs, reqs):
            self.split_segment()
            n = hidden.shape[0]
            for r in reqs:
                st = stats_of(r)
                if not st.deferred:
                    st.deferred_start, st.deferred_rows = r.num_computed_tokens - n, 0
            seg = self.segment = _Segment(list(reqs), {id(r): i for i, r in enumerate(reqs)})
        seg.parts.append(hidden)
        seg.rows += hidden.shape[0]
        if seg.rows >= self.defer_limit(len(seg.reqs)):
            self.flush([r for r in seg.reqs if r.finish_reason is None], drafter)

    def defer_limit(self, batch_size: int) -> int:
        """Deferred rows a request of a batch this size keeps before its draft_extend runs anyway."""
        return min(self.defer_cap, max(DEFER_FLOOR, self.defer_rows // max(1, batch_size)))

    def split_segment(self) -> None:
        """Move the kept windows' rows onto their requests' deferred buffers (views of one tensor)."""
        seg, self.segment = self.segment, None
        if seg is None or not seg.parts:
            return
        block = seg.parts[0] if len(seg.parts) == 1 else torch.cat(seg.parts)  # [rows, B, H]
        for i in seg.cols.values():
            r = seg.reqs[i]
            if r.finish_reason is None:
                st = stats_of(r)
                st.deferred.append(block[:, i])
                st.deferred_rows += seg.rows

    def defer(self, reqs: Sequence[Request], rows: Sequence[int], hidden: torch.Tensor, drafter: Drafter) -> None:
        """Plain step done (num_computed_tokens counts it): keep each request's hidden row for a later
        draft_extend; a full buffer is extended now."""
        self.defer_chunks(reqs, [hidden[row:row + 1] for row in rows], drafter)

    def defer_chunks(self, reqs: Sequence[Request], chunks: Sequence[torch.Tensor], drafter: Drafter,
                     owned: bool = False) -> None:
        """Plain steps done (num_computed_tokens counts them): chunk i holds request i's hidden rows of its last
        len(chunk) positions (cloned: graph outputs are overwritten by the next replay; owned: views of a
        tensor nothing else writes, kept as they are, so a window of B requests launches no B copies)."""
        self.split_segment()  # rows in position order
        full, limit = [], self.defer_limit(len(reqs))
        for r, chunk in zip(reqs, chunks):
            st = stats_of(r)
            if not st.deferred:
                st.deferred_start = r.num_computed_tokens - chunk.shape[0]
                st.deferred_rows = 0
            st.deferred.append(chunk if owned else chunk.clone())
            st.deferred_rows += chunk.shape[0]
            if st.deferred_rows >= limit:
                full.append(r)
        if full:
            self.flush(full, drafter)

    def flush(self, reqs: Sequence[Request], drafter: Drafter) -> int:
        """One draft_extend (the drafter's after_extend) over every deferred row of these requests; the rows."""
        self.split_segment()
        pending = [r for r in reqs if self.has_deferred(r)]
        if not pending:
            return 0
        chunks, rows, offset = [], [], 0
        for r in pending:
            st = stats_of(r)
            chunks.append(ExtendedChunk(r, st.deferred_start, st.deferred_end(), offset))
            offset += st.deferred_rows
            rows += st.deferred
            st.deferred, st.deferred_rows = [], 0
        drafter.after_extend(chunks, torch.cat(rows))
        return offset
