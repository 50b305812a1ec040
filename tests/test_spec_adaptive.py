"""Adaptive speculation: the policy picks the width (tokens verified per request; 1 = plain decoding) that
maximises expected tokens per second under a cost model and the running acceptance, and whatever it picks,
greedy output equals plain output token for token (fp32, CPU), also when it switches between plain and
speculative steps mid-generation (EAGLE-3 / DFlash then defer and batch their draft_extend)."""
from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from spec_utils import spec_llm

from tercel import SamplingParams
from tercel.config import ConfigError
from tercel.request import Request
from tercel.speculative import DEFAULT_EAGLE3_DRAFT, eagle
from tercel.speculative.adaptive import (
    HOPELESS_AFTER,
    PROBE_CHAIN_STEPS,
    PROBE_SHARE,
    AdaptiveSpec,
    CostModel,
    RequestAcceptStats,
    WidthPolicy,
    candidate_widths,
    check_adaptive,
    expected_tokens,
    shrunk_alphas,
    stats_of,
)

WIDTHS = (1, 2, 4, 6)


def _costs(forward: dict[int, float], bucket: int = 1, overhead: float = 0.0) -> CostModel:
    """A synthetic cost model: forward seconds by width at one bucket, the same overhead on spec steps."""
    costs = CostModel((bucket,), {(bucket, w): s for w, s in forward.items()})
    costs.overhead_s[bucket, True] = overhead
    return costs


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(1.0, 6) == 6.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)


def test_plain_when_verify_costs_more_than_it_gains():
    # verify costs 3x a decode step; acceptance 0.5 gives at most 2 tokens per step
    costs = _costs({1: 0.010, 2: 0.030, 4: 0.031, 6: 0.032})
    assert WidthPolicy().best(costs, 1, [0.5], WIDTHS) == 1


def test_full_width_when_acceptance_is_high_and_verify_cheap():
    costs = _costs({1: 0.010, 2: 0.011, 4: 0.012, 6: 0.013})
    assert WidthPolicy().best(costs, 1, [0.9], WIDTHS) == 6


def test_an_intermediate_width_when_it_maximises_tokens_per_second():
    # 0.7 per position: 1.7 tokens at width 2 (11 ms), 2.53 at 4 (12 ms), 3.04 at 6 (30 ms)
    costs = _costs({1: 0.010, 2: 0.011, 4: 0.012, 6: 0.030})
    assert WidthPolicy().best(costs, 1, [0.7], WIDTHS) == 4
    # the draft's cost counts: a dear draft turns the same step off
    assert WidthPolicy().best(_costs({1: 0.010, 2: 0.011, 4: 0.012, 6: 0.030}, overhead=0.03), 1, [0.7], WIDTHS) == 1


def test_a_running_width_yields_only_to_one_better_by_the_switch_gain():
    """At 64 requests on an H200 the adaptive EAGLE-3 chain left its chained full width for single width-2 / 4
    steps (3-5 a pass, each ending and restarting the chain) and read 0.85-0.89x where the fixed chain read
    0.96-1.0x: a narrower width must beat the running one by SWITCH_GAIN, as speculation must beat plain."""
    costs = _costs({1: 0.010, 2: 0.011, 4: 0.012, 6: 0.0135})
    policy = WidthPolicy()
    assert policy.choose(costs, 1, [0.7], WIDTHS) == 6
    assert WidthPolicy().best(costs, 1, [0.6], WIDTHS) == 4  # 2.7% more tokens per second than 6 at 0.6
    assert policy.choose(costs, 1, [0.6], WIDTHS) == 6  # ... not enough to leave the running width
    assert policy.choose(costs, 1, [0.4], WIDTHS) == 4  # 10% more: it switches
    assert policy.choose(costs, 1, [0.05], WIDTHS) == 1  # plain needs no margin over a dear speculative width


def test_the_batch_is_costed_as_a_whole():
    # one request that accepts everything does not carry seven that accept nothing
    costs = _costs({1: 0.010, 2: 0.016, 4: 0.02, 6: 0.024}, bucket=8)
    assert WidthPolicy().best(costs, 8, [1.0] + [0.0] * 7, WIDTHS) == 1
    assert WidthPolicy().best(costs, 8, [0.9] * 8, WIDTHS) == 6


def test_plain_steps_probe_with_exponential_back_off():
    costs = _costs({1: 0.010, 2: 0.015, 4: 0.031, 6: 0.032})
    policy = WidthPolicy(probe_first=4, probe_max=16, probe_share=1.0)  # the doubling alone
    picks = [policy.choose(costs, 1, [0.1], WIDTHS) for _ in range(4 + 8 + 16 + 16)]
    probes = [i for i, w in enumerate(picks) if w > 1]
    assert probes == [3, 11, 27, 43] and all(picks[i] == 2 for i in probes)  # the cheapest speculative step


def test_a_dear_probe_is_a_small_share_of_the_stretches_before_and_after_it():
    """At 256 requests on an H200 a probe (an eager step, the stretch's deferred draft_extend before it) cost about
    ten plain steps, and probes every 32-64 steps took 25% of a pass: the stretches on either side of a probe are
    long enough that it is at most PROBE_SHARE of each."""
    costs = _costs({1: 0.001, 2: 0.0015, 4: 0.0035, 6: 0.0055}, overhead=0.0085)  # the forwards could pay
    policy = WidthPolicy(probe_max=512)
    picks = [policy.choose(costs, 256, [0.1], WIDTHS) for _ in range(1200)]
    probes = [i for i, w in enumerate(picks) if w > 1]
    stretch = math.ceil(0.010 / (PROBE_SHARE * 0.001))  # 10 plain steps' probe / 3%
    assert probes == [stretch - 1, 2 * stretch - 1, 2 * stretch - 1 + policy.probe_max]
    assert policy.schedule(costs, 256).every == policy.probe_max
    cheap = WidthPolicy()  # a probe of 1.5 plain steps (a chain at batch 1): 50 steps, then the doubling decides
    picks = [cheap.choose(_costs({1: 0.010, 2: 0.015, 4: 0.018, 6: 0.02}), 1, [0.1], WIDTHS) for _ in range(200)]
    assert [i for i, w in enumerate(picks) if w > 1] == [49, 49 + 64] and cheap.schedule(costs, 1).every == 128


def test_a_probe_is_spaced_by_the_draft_extend_it_forces_too():
    """A probe after a plain stretch first runs the stretch's deferred draft_extend, which no step's cost carries (it
    is the switch's): the stretch before a probe is long enough that the probe and that draft_extend together are at
    most PROBE_SHARE of it. One tree or DDTree probe at 16-64 requests cost 10-30% of a 127-step pass on an H100."""
    costs = _costs({1: 0.001, 2: 0.0015, 4: 0.0016, 6: 0.0017})
    assert WidthPolicy().probe(costs, 16, WIDTHS) == (2, math.ceil(0.0015 / (PROBE_SHARE * 0.001)))
    for took in (0.020, 0.001, 0.006):  # the median of the recent ones: 6 ms
        costs.observe_switch(16, took)
    assert costs.switch_s(16) == 0.006 and costs.switch_s(1) == 0.006  # one bucket (the synthetic model has one)
    assert WidthPolicy().probe(costs, 16, WIDTHS) == (2, math.ceil(0.0075 / (PROBE_SHARE * 0.001)))
    # a width's first step is no step cost (one-time work), but until a real one follows it spaces the probes
    costs.observe(16, 2, 0.0045)
    assert costs.step_s(16, 2) == 0.0015 and costs.probe_s(16, 2) == 0.0045
    assert WidthPolicy().probe(costs, 16, WIDTHS) == (2, math.ceil(0.0105 / (PROBE_SHARE * 0.001)))
    costs.observe(16, 2, 0.002)  # a real step: the width's cost from now on
    assert costs.probe_s(16, 2) == costs.step_s(16, 2) == 0.002


def test_a_probe_measured_whole_spaces_the_next_ones_where_it_cost_more_than_its_parts():
    """A probe's parts (its step, the flush it forces) leave out what leaving the plain windows costs around them: the
    overlap schedule's pipeline drained and refilled, a chain's start and end, steps that lose after it. Measured whole
    (the last window read before it to the first after, less the plain steps' worth of tokens gained), the recent
    median spaces the probes where it is dearer than the parts; a cheaper one leaves the parts' estimate standing."""
    costs = _costs({1: 0.001, 2: 0.0015, 4: 0.0016, 6: 0.0017}, bucket=16)
    assert costs.probe_cost_s(16) is None
    parts = WidthPolicy().probe(costs, 16, WIDTHS)
    assert parts == (2, math.ceil(0.0015 / (PROBE_SHARE * 0.001)))
    for took in (0.012, 0.009, -0.002):  # a probe that gained counts as costing nothing
        costs.observe_probe(16, took)
    assert costs.probe_cost_s(16) == 0.009
    assert WidthPolicy().probe(costs, 16, WIDTHS) == (2, math.ceil(0.009 / (PROBE_SHARE * 0.001)))
    for _ in range(9):  # the recent ones only (OBSERVED_WINDOW): probes as cheap as their parts say
        costs.observe_probe(16, 0.001)
    assert WidthPolicy().probe(costs, 16, WIDTHS) == parts


def test_the_worker_measures_a_probe_from_the_window_read_before_it_to_the_one_after():
    """SpecWorker._close_excursion: the time since the window read before the probe, less the tokens each request
    gained meanwhile at the plain step's cost; nothing where the batch changed or a request finished in between."""
    from types import SimpleNamespace

    from tercel.speculative.stats import SpecStats
    from tercel.speculative.worker import SpecWorker

    ada = AdaptiveSpec(_costs({1: 0.001, 6: 0.002}, bucket=4))
    for _ in range(HOPELESS_AFTER):
        ada.costs.observe(4, 1, 0.001)  # the first is one-time work; the plain step costs 1 ms
    reqs = [SimpleNamespace(num_computed_tokens=100, finish_reason=None) for _ in range(4)]
    worker = SimpleNamespace(adaptive=ada, stats=SpecStats(), _excursion=(10.0, list(reqs), 400))
    for r in reqs:
        r.num_computed_tokens += 10  # a probe that accepted a few drafts, then the window's own steps
    SpecWorker._close_excursion(worker, reqs, 10.020)
    assert worker._excursion is None and worker.stats.probes == 1
    assert ada.costs.probe_cost_s(4) == pytest.approx(0.020 - 10 * 0.001)
    worker._excursion = (11.0, list(reqs), 440)
    SpecWorker._close_excursion(worker, reqs[:3], 11.050)  # a request left the batch: no measurement
    reqs[0].finish_reason = "length"
    worker._excursion = (12.0, list(reqs), 440)
    SpecWorker._close_excursion(worker, reqs, 12.050)  # one finished inside the window: none either
    assert worker.stats.probes == 1 and len(ada.costs.probes_s[4]) == 1


def test_a_plain_step_through_the_worker_is_no_plain_cost_where_windows_set_it():
    """Where plain windows' paces set a bucket's plain cost, a plain step that goes through the worker (the policy
    asked again after a chain run or a probe: a synced, unchained step) is a transition, not what plain costs: on an
    H200 (ab9d41b) such steps held a plain step at one request at 0.85-0.98 ms against ~0.5 ms in the passes that
    chained most. Speculative steps through the worker are still costed by their cycle."""
    from types import SimpleNamespace

    from tercel.speculative.worker import SpecWorker

    ada = AdaptiveSpec(_costs({1: 0.001, 6: 0.002}, bucket=4))
    worker = SimpleNamespace(adaptive=ada, _window_paced=set(), _open_step=None, _step_began=0.0)
    for width in (1, 1, 1, 6, 6, 6):
        worker._open_step = (4, width, time.perf_counter() - 0.01)
        SpecWorker.step_began(worker)
    assert ada.costs.observations(4, 1) == 2 and ada.costs.observations(4, 6) == 2  # (the first is one-time work)
    worker._window_paced.add(4)  # a window's pace was taken at this bucket
    for width in (1, 6):
        worker._open_step = (4, width, time.perf_counter() - 0.01)
        SpecWorker.step_began(worker)
    assert ada.costs.observations(4, 1) == 2 and ada.costs.observations(4, 6) == 3


def test_a_plain_grant_counts_down_the_stretch_fixed_when_it_was_granted():
    """A plain stretch is fixed when granted; its windows only count what is left of it (no policy work per
    window), and a probe's stretch after it is decided afresh."""
    costs = _costs({1: 0.001, 2: 0.0015, 4: 0.002, 6: 0.0025}, bucket=4)
    policy = WidthPolicy(probe_first=8, probe_max=64, probe_share=1.0)
    grant = policy.grant(costs, 4, WIDTHS)
    assert grant.left() == 7 == policy.plain_budget(costs, 4, WIDTHS)
    costs.observe(4, 1, 0.0)  # later costs do not move a granted stretch
    costs.observe(4, 1, 0.1)
    policy.schedule(costs, 4).plain_run += 5
    assert grant.left() == 2
    policy.schedule(costs, 4).plain_run += 5
    assert grant.left() == 0


def test_each_batch_bucket_keeps_its_own_probe_schedule():
    """In the #31 sweep (one engine, batch 1 then 16 and 64 requests) the EAGLE-3 tree held at batch 1, which
    started the back-off over, and the 16- and 64-request batches then probed every 32 steps, each probe a
    tree step of 3-4 plain steps: 0.75-0.87x plain with 1-3 speculative steps a pass. Speculation holding at one
    batch size says nothing of another's: each bucket has its own stretch and back-off."""
    costs = CostModel((1, 16), {(b, w): (0.01 if w == 1 else 0.012) * b for b in (1, 16) for w in WIDTHS})
    policy = WidthPolicy(probe_first=4, probe_max=64, probe_share=1.0)
    for _ in range(4 + 8 + 16):  # batches of 16 accept nothing: three probes, the next stretch 32
        policy.choose(costs, 16, [0.0] * 16, WIDTHS)
    assert policy.schedule(costs, 16).every == 32
    assert [policy.choose(costs, 1, [0.95], WIDTHS) for _ in range(8)] == [6] * 8  # batch 1 speculates throughout
    assert policy.schedule(costs, 16).every == 32 and policy.schedule(costs, 1).every == 4
    picks = [policy.choose(costs, 16, [0.0] * 16, WIDTHS) for _ in range(32)]
    assert [i for i, w in enumerate(picks) if w > 1] == [31]
    assert policy.plain_budget(costs, 16, WIDTHS) == 63 and policy.plain_budget(costs, 1, WIDTHS) == 3


def test_speculation_that_stops_at_once_does_not_restart_the_probe_back_off():
    """A probe finds acceptance high, the next step speculates on its merits and the one after goes plain again
    (the step cost more than the estimate): the back-off goes on growing. Speculation that holds for probe_first
    steps starts it over, so a batch that turns plain is probed again soon."""
    costs = _costs({1: 0.010, 2: 0.030, 4: 0.031, 6: 0.032})
    policy = WidthPolicy(probe_first=4, probe_max=64, probe_share=1.0)
    for _ in range(4 + 8):  # two probes: the next stretch is 16
        policy.choose(costs, 1, [0.1], WIDTHS)
    assert policy.schedule(costs, 1).every == 16
    assert policy.choose(costs, 1, [1.0], WIDTHS) == 6  # on its merits, once
    assert policy.choose(costs, 1, [0.1], WIDTHS) == 1 and policy.schedule(costs, 1).every == 16
    assert [policy.choose(costs, 1, [1.0], WIDTHS) for _ in range(4)] == [6] * 4  # it holds
    assert policy.choose(costs, 1, [0.1], WIDTHS) == 1 and policy.schedule(costs, 1).every == 4


def test_the_probe_takes_the_cheapest_speculative_width_by_cost():
    # a chained full-width step (the EAGLE chain graph) can cost less than a narrower unchained one
    costs = _costs({1: 0.010, 2: 0.032, 4: 0.031, 6: 0.018})
    policy = WidthPolicy(probe_first=4, probe_max=16, probe_share=1.0)
    picks = [policy.choose(costs, 1, [0.1], WIDTHS) for _ in range(4)]
    assert picks == [1, 1, 1, 6]


def test_acceptance_stats_follow_the_verifies():
    st = RequestAcceptStats()
    for _ in range(20):
        st.record(5, 5)  # every draft accepted
    assert st.alpha > 0.95
    for _ in range(20):
        st.record(5, 0)  # the first draft rejected
    assert st.alpha < 0.1
    before = st.alpha
    st.record(0, 0)  # nothing offered: no evidence
    assert st.alpha == before


def test_cost_model_buckets_and_overheads():
    costs = CostModel((1, 4, 16), {(4, 1): 0.01, (4, 6): 0.02})
    assert [costs.bucket(b) for b in (1, 2, 4, 5, 100)] == [1, 4, 4, 16, 16]
    assert costs.knows(3, (1, 6)) and not costs.knows(1, (1,))
    costs.forward_s[4, 4] = 0.015
    costs.observe(3, 6, 5.0)  # a width's first real step carries one-time work (compiles, captures): not its cost
    assert costs.step_s(4, 6) == pytest.approx(0.02) and costs.observations(4, 6) == 0
    costs.observe(3, 6, 0.05)  # 30 ms beyond the forward
    assert costs.step_s(4, 6) == pytest.approx(0.05) and costs.step_s(4, 1) == pytest.approx(0.01)
    assert costs.step_s(4, 4) == pytest.approx(0.045)  # never ran: its forward + the spec steps' overhead
    costs.observe(4, 6, 0.09)  # real steps move it: the median of the recent ones
    assert costs.step_s(4, 6) == pytest.approx(0.07)
    costs.observe(4, 6, 0.05)
    costs.observe(4, 6, 0.05)
    costs.observe(4, 6, 0.9)  # one step on a busy host moves nothing
    assert costs.step_s(4, 6) == pytest.approx(0.05)
    # what benchmarks record: the cost the policy uses, the forward's, and the real steps behind it
    est = round(costs.step_s(4, 4) * 1e3, 4)  # never ran: its forward + the learnt overhead
    assert costs.snapshot() == {"4x1": {"step_ms": 10.0, "forward_ms": 10.0, "observed": 0},
                                "4x4": {"step_ms": est, "forward_ms": 15.0, "observed": 0},
                                "4x6": {"step_ms": 50.0, "forward_ms": 20.0, "observed": 5}}


def test_a_widths_first_real_step_does_not_keep_the_policy_off_it():
    """n-gram on text that repeats itself, on a GPU: the first full-width step compiled a kernel for its shapes
    (0.2 s). Counted, that one sample would be the width's median and the policy would stay plain on a draft
    that accepts everything; its next steps are what the width costs."""
    costs = _costs({1: 0.001, 2: 0.0011, 4: 0.0012}, overhead=0.001)
    costs.observe(1, 4, 0.2)
    assert WidthPolicy().best(costs, 1, [0.95], (1, 2, 4)) == 4
    costs.observe(1, 4, 0.0023)
    assert costs.step_s(1, 4) == pytest.approx(0.0023) and WidthPolicy().best(costs, 1, [0.95], (1, 2, 4)) == 4


def test_a_plain_pace_on_few_windows_is_at_most_the_synced_forward():
    """SmolLM2 tree-16 at T = 1 over 16 requests on an H100: the bucket's one plain pace read 2.28 ms (a window
    beside a batch change) against 1.2 ms for plain steps there, and the policy drafted on (0.61x plain). Until
    HOPELESS_AFTER windows stand behind it, a plain pace counts at most as the synced forward; a speculative
    sample that reads dear stands (it errs toward plain)."""
    costs = _costs({1: 0.0015, 16: 0.0034}, bucket=16)
    costs.observe(16, 1, 0.0012)  # a bucket's first step is not its cost
    costs.observe(16, 1, 0.00228)
    assert costs.step_s(16, 1) == pytest.approx(0.0015)
    assert WidthPolicy().best(costs, 16, [0.45] * 16, (1, 16)) == 1
    for _ in range(HOPELESS_AFTER):
        costs.observe(16, 1, 0.0025)
    assert costs.step_s(16, 1) == pytest.approx(0.0025)  # the pace of many windows stands
    costs.observe(16, 16, 0.1)
    costs.observe(16, 16, 0.02)
    assert costs.step_s(16, 16) == pytest.approx(0.02)


def test_with_no_request_queued_no_request_may_lose():
    """A batch whose finished slots are not refilled ends at its slowest member's pace: SmolLM2 EAGLE-3 at T = 1
    over 16 requests on an H100 drafted on a mean acceptance that paid on paper and ran 0.71x plain. With nothing
    queued every request is weighed at the batch's lowest alpha; with requests queued, at its own (throughput).
    (Under the pooled rule a request that rejected the first draft six times reads ~0.19, not its raw ~0.12: a width
    whose step cost under ~1.2 plain steps would still be weighed for it; a GPU's cheapest costs ~2.)"""
    reqs = [Request(f"r{i}", None, [0], None, None, None) for i in range(4)]
    ada = AdaptiveSpec(_costs({1: 0.001, 2: 0.0013, 4: 0.0015, 6: 0.0016}, bucket=4))
    for r, (drafts, accepted) in zip(reqs, ((5, 5), (5, 5), (5, 5), (5, 0))):
        for _ in range(6):
            ada.record(r, drafts, accepted)
    alphas = ada.alphas(reqs, queued=True)
    assert min(alphas) < 0.2 and max(alphas) > 0.9
    low = min(shrunk_alphas([r.spec_adaptive for r in reqs]))  # the lowest, its noise damped (pooled)
    assert low < 0.3 and ada.alphas(reqs, queued=False) == [low] * 4
    ada.pooled = False  # TERCEL_ADAPTIVE_BATCH_ALPHA=min: the lowest raw alpha
    assert ada.alphas(reqs, queued=False) == [min(alphas)] * 4
    ada.pooled = True
    assert ada.alphas(reqs[:1], queued=False) == alphas[:1]
    assert WidthPolicy().best(ada.costs, 4, ada.alphas(reqs, queued=True), WIDTHS) == 6
    assert WidthPolicy().best(ada.costs, 4, ada.alphas(reqs, queued=False), WIDTHS) == 1
    assert ada.plain_steps(reqs, WIDTHS, queued=False).left() > 0 and ada.plain_steps(reqs, WIDTHS, queued=True) is None


def test_a_fresh_lone_request_starts_at_the_full_width_its_own_acceptance_decides():
    """At one request on an H100 (de69b85) a code prompt after a chat prompt decoded plain to its end: its prior was
    the chat prompt's acceptance and the next probe ~500 steps away, while the chain ran it at ~1.5x. A lone request
    just prefilled (no verify yet, no deferred rows) runs its first decode at the full width (a probe: a chain holds
    it PROBE_CHAIN_STEPS steps), unless that step costs more than FRESH_PROBE_RATIO plain steps; then its own
    verifies decide. Not for a batch of several (their floors weigh them), nor when switched off."""
    def sync() -> None:
        return None

    costs = _costs({1: 0.001, 2: 0.0015, 4: 0.002, 6: 0.0025}, bucket=2)
    ada = AdaptiveSpec(costs)
    for _ in range(20):  # the last requests accepted little: on the prior the policy stays plain
        ada.recent.record(5, 1, decay=0.95)
    lone = [Request("new", None, [0], None, None, None)]
    assert WidthPolicy().best(costs, 1, ada.alphas(lone, queued=False), WIDTHS) == 1
    assert ada.plain_steps(lone, WIDTHS) is None  # the next step comes through the worker ...
    assert ada.choose(lone, WIDTHS, None, sync) == 6 and ada.policy.probed  # ... at the full width, as a probe
    ada.record(lone[0], 5, 1)  # verified: its own acceptance decides from here
    assert ada.choose(lone, WIDTHS, None, sync) == 1 and ada.plain_steps(lone, WIDTHS).left() > 0
    pair = [Request(f"p{i}", None, [0], None, None, None) for i in range(2)]
    assert ada.fresh_width(pair, WIDTHS) is None  # several fresh requests: their floors
    deferred = [Request("deferred", None, [0], None, None, None)]
    stats_of(deferred[0]).deferred_rows = 3  # plain rows waiting for a draft_extend: no longer fresh
    assert ada.fresh_width(deferred, WIDTHS) is None
    dear = AdaptiveSpec(_costs({1: 0.001, 2: 0.002, 4: 0.003, 6: 0.0031}, bucket=2))
    assert dear.fresh_width([Request("x", None, [0], None, None, None)], WIDTHS) is None  # over 3 plain steps
    ada.fresh_probe = False  # TERCEL_ADAPTIVE_FRESH_PROBE=0
    assert ada.fresh_width([Request("y", None, [0], None, None, None)], WIDTHS) is None


def test_a_new_batch_is_weighed_at_the_lowest_acceptance_batches_of_its_size_showed():
    """Requests not verified yet carry the prior (the recent mean): a batch of them speculated on it at every
    pass's start, and the first verify found its slowest member below the mean. SmolLM2 on an H200 at 16 / 64
    requests: passes whose only worker step was the prefill read 0.97-0.99x plain, those with 1-3 more
    speculative steps 0.83-0.94x. Once a batch of a size was verified whole, a new batch of that size is weighed
    at that batch's lowest alpha (a moving average over such batches); a single request keeps the prior."""
    costs = _costs({1: 0.001, 2: 0.0013, 4: 0.0014, 6: 0.0016}, bucket=4)
    ada = AdaptiveSpec(costs, pooled=False)  # the floors are the same under the pooled rule, of damped alphas
    for _ in range(20):  # the recent mean: 0.8
        ada.recent.record(5, 4, decay=0.95)
    fresh = [Request(f"new{i}", None, [0], None, None, None) for i in range(4)]
    assert ada.alphas(fresh, queued=False) == [pytest.approx(ada.recent.alpha)] * 4  # no batch of 4 seen: the prior
    assert ada.plain_steps(fresh, WIDTHS) is None  # ... on which it speculates
    old = [Request(f"r{i}", None, [0], None, None, None) for i in range(4)]
    for r, accepted in zip(old, (4, 4, 4, 0)):
        for _ in range(3):
            stats = ada.recent.accepted, ada.recent.offered
            ada.record(r, 5, accepted)
            ada.recent.accepted, ada.recent.offered = stats  # keep the prior where it was
    low = min(ada.alphas(old, queued=False))
    assert low < 0.3 and ada.floors[4] == pytest.approx(low)
    fresh = [Request(f"next{i}", None, [0], None, None, None) for i in range(4)]
    assert ada.alphas(fresh, queued=False) == [pytest.approx(low)] * 4
    assert ada.plain_steps(fresh, WIDTHS).left() > 0  # plain until a probe measures this batch
    assert ada.alphas(fresh, queued=True) == [pytest.approx(ada.recent.alpha)] * 4  # throughput: each its own
    assert ada.alphas(fresh[:1], queued=False) == [pytest.approx(ada.recent.alpha)]
    ada.record(fresh[0], 5, 5)  # a verified member's alpha stands beside the floor for the others
    assert ada.alphas(fresh, queued=False) == [pytest.approx(low)] * 4
    ada.lowest = False  # TERCEL_ADAPTIVE_BATCH_ALPHA=mean: each at its own, as when requests queue
    assert ada.alphas(old, queued=False) == ada.alphas(old, queued=True)
    assert max(ada.alphas(old, queued=False)) > 0.7


def test_the_batch_alpha_rule_switch(monkeypatch):
    monkeypatch.setenv("TERCEL_ADAPTIVE_BATCH_ALPHA", "mean")
    assert not AdaptiveSpec.for_batches(8).lowest
    monkeypatch.setenv("TERCEL_ADAPTIVE_BATCH_ALPHA", "min")
    assert AdaptiveSpec.for_batches(8).lowest and not AdaptiveSpec.for_batches(8).pooled
    monkeypatch.setenv("TERCEL_ADAPTIVE_BATCH_ALPHA", "lowest")
    with pytest.raises(ConfigError, match="TERCEL_ADAPTIVE_BATCH_ALPHA='lowest' must be pooled, min or mean"):
        AdaptiveSpec.for_batches(8)
    monkeypatch.delenv("TERCEL_ADAPTIVE_BATCH_ALPHA")
    assert AdaptiveSpec.for_batches(8).lowest and AdaptiveSpec.for_batches(8).pooled


def test_the_pooled_rule_damps_the_noise_of_the_lowest_alpha_but_not_a_request_that_rejects():
    """The lowest of 16 noisy estimates of one acceptance sits well under it: at T = 0 over 16 requests on an H100
    (da4a751) the min rule kept the EAGLE-3 chain plain (0.96x plain) where it paid 1.26x, as the mean rule found.
    pooled shrinks each request's alpha toward the batch's pooled one by the share of their spread that noise
    explains: a batch that accepts alike then speculates, one with a request that rejects every draft does not."""
    import random

    costs = _costs({1: 0.001, 6: 0.00225}, bucket=16)  # a chained step: 2.25 plain steps
    widths = (1, 6)
    ada = AdaptiveSpec(costs)  # the default: pooled
    raw = AdaptiveSpec(costs, pooled=False)  # the min rule over the same requests' stats
    rng = random.Random(0)
    reqs = [Request(f"r{i}", None, [0], None, None, None) for i in range(16)]
    for r in reqs:  # every draft accepted with probability 0.7 given its parent was
        for _ in range(12):
            accepted = 0
            while accepted < 5 and rng.random() < 0.7:
                accepted += 1
            ada.record(r, 5, accepted)
    alphas = raw.alphas(reqs, queued=True)
    assert min(alphas) < 0.5 < 0.6 < ada.alphas(reqs, queued=False)[0] < 0.7
    assert WidthPolicy().best(costs, 16, raw.alphas(reqs, queued=False), widths) == 1
    assert WidthPolicy().best(costs, 16, ada.alphas(reqs, queued=False), widths) == 6
    for _ in range(12):  # one request rejects every first draft: the batch must not speculate
        ada.record(reqs[0], 5, 0)
    assert ada.alphas(reqs, queued=False)[0] < 0.6
    assert WidthPolicy().best(costs, 16, ada.alphas(reqs, queued=False), widths) == 1
    assert shrunk_alphas([RequestAcceptStats(3.0, 5.0)]) == [0.6]  # one request: its own

def test_small_batches_defer_their_draft_extend_longer():
    """Each plain stretch of a drafter that reads hidden states ran a draft_extend every 128 rows, also at one
    request, where a 192-token answer finished with its rows never needed: the cap is a whole-batch budget
    (DEFER_ROWS) spread over the requests, between DEFER_FLOOR and DEFER_CAP each."""
    from tercel.speculative.adaptive import DEFER_CAP, DEFER_FLOOR, DEFER_ROWS
    ada = AdaptiveSpec(_costs({1: 0.001}))
    assert ada.defer_limit(1) == ada.defer_limit(16) == DEFER_CAP
    assert ada.defer_limit(128) == DEFER_ROWS // 128 and ada.defer_limit(256) == DEFER_FLOOR
    assert ada.defer_limit(256) * 256 <= DEFER_ROWS
    ada.defer_cap = 3
    assert ada.defer_limit(1) == 3


def test_measuring_takes_turns_and_caps_noisy_narrow_widths():
    durations = [0.050, 0.020, 0.030, 0.040, 0.019, 0.031]  # widths 1, 2, 4 in turn, two rounds
    ticks = [t for i in range(len(durations)) for t in (sum(durations[:i]), sum(durations[:i + 1]))]
    clock = iter(ticks).__next__
    calls = []
    costs = CostModel((1,))
    built = []
    costs.measure(1, (1, 2, 4), lambda b, w: built.append(w) or (lambda: calls.append(w)), lambda: None, reps=2,
                  clock=clock)
    assert built == [1, 2, 4]  # each width's batch built once, outside the timed forwards
    assert calls == [1, 2, 4] * 3  # a warm-up each, then two rounds taking turns
    # width 1's best (40 ms) was a busy spell: capped at width 2's 19 ms
    assert costs.forward_s == pytest.approx({(1, 1): 0.019, (1, 2): 0.019, (1, 4): 0.030})


def test_a_buckets_first_step_skips_a_full_width_no_acceptance_could_repay():
    """The first step at a batch bucket runs the full width (one real step measures drafting and acceptance),
    unless its forward alone costs more plain forwards than the width could yield at ALPHA_CEILING: a tree-16
    verify of 256 requests ran eagerly (past the speculative graphs' largest batch) in 39 ms against 4.4 ms for
    a plain step on an H100, a pass's worth of plain steps spent once per bucket."""
    reqs = [Request(f"r{i}", None, [0], None, None, None) for i in range(4)]
    for dear, first in ((0.002, 16), (0.1, 1)):  # 2 or 100 plain forwards; at most 8.2 tokens at 0.9
        ada = AdaptiveSpec(CostModel((4,)))
        forward = {1: 0.001, 16: dear}

        def prepare(b, w):
            return lambda: time.sleep(forward[w])

        assert ada.choose(reqs, (1, 16), prepare, lambda: None) == first
        assert ada.costs.knows(4, (1, 16))


def test_candidate_widths_and_the_on_off_setting():
    assert candidate_widths(6, branching=False) == (1, 2, 4, 6)
    assert candidate_widths(3, branching=False) == (1, 2, 3)
    assert candidate_widths(16, branching=True) == (1, 16)
    assert check_adaptive("OFF") is False and check_adaptive(True) is True
    with pytest.raises(ConfigError, match="speculative_adaptive='sometimes'.*on\\|off"):
        check_adaptive("sometimes")


# ---- lossless, whatever the policy picks -------------------------------------------------------

class CyclePolicy:
    """Stands in for WidthPolicy: the widths in a fixed cycle (clipped to the candidates), so steps switch
    between plain and speculative mid-generation."""

    def __init__(self, cycle: list[int]) -> None:
        self.cycle = itertools.cycle(cycle)

    def choose(self, costs, batch_size, alphas, widths) -> int:
        want = next(self.cycle)
        return max(w for w in widths if w <= want)


@pytest.fixture(scope="module")
def prompts(smol_llm, smol_chat_ids):
    tok = smol_llm.tokenizer
    return smol_chat_ids[:2] + [tok.encode("The quick brown fox. " * 6)]


@pytest.fixture(scope="module")
def plain(smol_llm, prompts):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]


SWITCHING = {
    "ngram": (dict(speculative_algorithm="NGRAM"), [1, 6, 1, 1, 2, 4]),
    "eagle3-chain": (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT)),
                     [1, 1, 6, 1, 2, 4, 1, 1, 1, 6]),
    "eagle3-tree": (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                         speculative_eagle_topk=4, speculative_num_draft_tokens=8), [1, 8, 1, 1, 8]),
    "dflash": (dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=8), [1, 1, 8, 4, 1, 2]),
}


@pytest.mark.parametrize("name", list(SWITCHING))
def test_switching_between_plain_and_speculative_steps_is_lossless(smol_llm, prompts, plain, name):
    kw, cycle = SWITCHING[name]
    for batch in (prompts, prompts[:1]):
        llm = spec_llm(smol_llm, max_num_seqs=len(batch), **kw)
        llm.engine.spec.adaptive.policy = CyclePolicy(cycle)
        llm.engine.spec.adaptive.defer_cap = 3  # plain runs longer than this extend the draft mid-run too
        outs = llm.generate(batch, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == plain[:len(batch)]
        stats = llm.engine.spec_stats()
        assert stats.width_histogram.get(1, 0) > 0 and sum(n for w, n in stats.width_histogram.items() if w > 1) > 0
        assert stats.accepted_tokens > 0  # drafts made after deferred extends still get accepted
        assert llm.engine.stats().kv_blocks_used == 0


def test_a_plain_pace_is_taken_only_over_back_to_back_windows_of_one_batch(smol_llm, prompts, monkeypatch):
    """A plain window's pace is the time since the window before it; across a batch change that gap holds the
    change's work (a request finishing, its blocks freed, the batch rebuilt). On an H200 (ab9d41b, T = 1, 16
    requests, EAGLE-3 with each request at its own alpha) the plain cost at 16 rested on three such gaps at the
    passes' ends, 2.7-2.8 ms against ~1.05 ms a plain step, and the chain ran at 0.80x plain where plain paid. Only
    windows over the batch of the window read just before them are timed."""
    monkeypatch.setenv("TERCEL_ADAPTIVE_PIN", "plain")
    llm = spec_llm(smol_llm, max_num_seqs=len(prompts), num_scheduler_steps=4, speculative_algorithm="NGRAM")
    spec = llm.engine.spec
    seen: list[tuple[list, float | None]] = []
    original = spec.plain_pace

    def record(reqs, num_steps, now):
        pace = original(reqs, num_steps, now)
        seen.append((list(reqs), pace))
        return pace

    monkeypatch.setattr(spec, "plain_pace", record)
    params = [SamplingParams(max_tokens=12 + 8 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params)  # the batch shrinks as the shorter requests finish
    timed = [i for i, (_, pace) in enumerate(seen) if pace is not None]
    changed = [i for i in range(1, len(seen)) if len(seen[i][0]) != len(seen[i - 1][0])]
    assert timed and changed, (len(seen), timed, changed)
    assert all(i > 0 and len(seen[i][0]) == len(seen[i - 1][0]) and
               all(a is b for a, b in zip(seen[i][0], seen[i - 1][0])) for i in timed)
    assert not set(changed) & set(timed)


@pytest.mark.parametrize("name", ["ngram", "eagle3-chain", "dflash"])
def test_plain_stretches_run_as_decode_windows_and_stay_lossless(smol_llm, prompts, plain, name):
    """When the policy picks plain, the engine runs the stretch up to the next probe as its multi-step decode
    windows (plain speed: no per-step drafter work), deferring the hidden rows the drafter reads; the probes
    then draft from an up-to-date draft state (drafts still accepted) and the output is plain output."""
    kw, _ = SWITCHING[name]
    llm = spec_llm(smol_llm, max_num_seqs=len(prompts), num_scheduler_steps=4, **kw)
    ada = llm.engine.spec.adaptive
    widths = llm.engine.spec.widths()
    # speculation pays only above alpha 0.8, so the prior (0.6) starts plain and the probes could still pay
    ada.costs = CostModel((len(prompts),), {(len(prompts), w): 0.001 * expected_tokens(0.8, w) for w in widths})
    ada.policy = WidthPolicy(probe_first=5, probe_max=10)
    ada.defer_cap = 6  # some windows fill the buffer and extend the draft mid-stretch
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.spec_stats()
    assert stats.plain_window_steps > 0 and stats.width_histogram.get(min(w for w in widths if w > 1), 0) > 0
    assert stats.accepted_tokens > 0  # probes after deferred extends still accept drafts
    # probes between plain windows are measured whole, from the window read before each to the first after it
    assert stats.probes > 0 and 0 < len(ada.costs.probes_s[len(prompts)]) <= stats.probes
    assert llm.engine.stats().kv_blocks_used == 0


def test_switching_under_graphs_replays_every_width(smol_llm, prompts, plain):
    """CPU breakable-debug graphs: each candidate width has its verify graph, and they all replay (in a batch no
    chain serves, here one that asks for logprobs: where a chain serves, only plain and the chain are weighed)."""
    llm = spec_llm(smol_llm, cuda_graph_backend="breakable-debug", max_model_len=320, cuda_graph_max_bs=4,
                   speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    spec = llm.engine.spec
    assert sorted(spec.verify_runners) == [1, 2, 4, 6]
    spec.adaptive.policy = CyclePolicy([1, 2, 4, 6, 1])
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(r.stats.replays > 0 and r.stats.eager == 0 for r in spec.verify_runners.values())


def test_plain_steps_replay_a_graph_at_every_batch_the_decode_graph_serves(smol_llm, prompts, plain, monkeypatch):
    """Speculative steps are captured up to SPEC_GRAPH_MAX_BS; an adaptive engine's plain steps (the one-token
    verify, with the drafter's hidden states) up to the decode graph's largest batch, so that past the speculative
    buckets plain runs at plain speed (on the H200 at 256 requests they ran eagerly: 0.3x plain decoding)."""
    import tercel.engine

    monkeypatch.setattr(tercel.engine, "SPEC_GRAPH_MAX_BS", 2)
    llm = spec_llm(smol_llm, cuda_graph_backend="breakable-debug", max_model_len=320, cuda_graph_max_bs=4,
                   speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    spec = llm.engine.spec
    runners = spec.verify_runners
    assert max(runners[1].buckets) == 4 and all(max(r.buckets) == 2 for w, r in runners.items() if w > 1)
    spec.adaptive.policy = CyclePolicy([1])
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))  # 3 > 2 requests
    assert [o.outputs[0].token_ids for o in outs] == [p[:24] for p in plain]
    assert runners[1].stats.replays > 0 and runners[1].stats.eager == 0


def test_no_speculative_width_runs_eagerly_where_the_plain_step_replays_a_graph(smol_llm, prompts, plain, monkeypatch):
    """Past the speculative graphs' largest batch (SPEC_GRAPH_MAX_BS) a speculative step runs eagerly while the plain
    step still replays its graph: such a step never pays, and on an H100 one probe of it took 20-60% of a 127-step
    pass at 256 requests. There the only candidate is plain, whatever the policy would pick; below it, the widths
    are there again."""
    import tercel.engine

    monkeypatch.setattr(tercel.engine, "SPEC_GRAPH_MAX_BS", 2)
    llm = spec_llm(smol_llm, cuda_graph_backend="breakable-debug", max_model_len=320, cuda_graph_max_bs=4,
                   speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    spec = llm.engine.spec
    assert spec.widths(3) == (1,) and spec.widths(2) == spec.widths() == (1, 2, 4, 6)
    spec.adaptive.policy = CyclePolicy([6])  # would speculate at full width on every step
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)  # 3 requests (1 or 2 decode while the others prefill)
    assert [o.outputs[0].token_ids for o in outs] == [p[:24] for p in plain]
    runners = spec.verify_runners
    assert spec.stats.width_histogram.get(1, 0) > 0 and spec.stats.verify_steps > 0  # plain at 3, drafted below
    assert all(r.stats.eager == 0 for r in runners.values()), {w: r.stats for w, r in runners.items()}


def test_adaptive_off_verifies_the_full_width_every_step(smol_llm, prompts, plain):
    llm = spec_llm(smol_llm, speculative_algorithm="NGRAM", speculative_adaptive="off")
    assert llm.engine.spec.adaptive is None
    outs = llm.generate(prompts[2:], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == plain[2] and llm.engine.spec_stats().width_histogram == {}
    with pytest.raises(ConfigError, match="speculative_adaptive"):
        spec_llm(smol_llm, speculative_algorithm="NGRAM", speculative_adaptive="auto")


class _FixedCosts(CostModel):
    """Costs the test sets, not moved by the host's real step times."""

    def observe(self, batch_size: int, width: int, wall_s: float) -> None:
        pass


def test_a_request_the_drafter_finds_nothing_for_turns_speculation_off(smol_llm):
    """n-gram on a prompt of distinct tokens: the first steps the policy makes speculative draft nothing (no
    earlier occurrence to copy), which counts as offered-and-rejected for the policy, so it goes plain (decode
    windows) until its next probe instead of choosing the full width on its prior acceptance every step."""
    prompt = list(range(1000, 1064))  # 64 distinct ids: no earlier occurrence of any suffix
    llm = spec_llm(smol_llm, speculative_algorithm="NGRAM", num_scheduler_steps=4)
    ada = llm.engine.spec.adaptive
    widths = llm.engine.spec.widths()
    # speculation pays from an acceptance of ~0.25 up (the prior is 0.6)
    ada.costs = _FixedCosts((1,), {(1, w): 1.0 if w == 1 else 1.3 for w in widths})
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    plain = smol_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    stats = llm.engine.spec_stats()
    assert stats.plain_window_steps >= 12, stats


def test_a_width_no_acceptance_could_repay_is_not_probed():
    """Once real steps show a width costs more plain steps than it could yield even at ALPHA_CEILING (an eager
    tree at a large batch), the probes that would re-measure acceptance are skipped: the batch stays plain.
    Before that many real steps, the probe runs (a first slow step may be a one-off)."""
    costs = _costs({1: 0.001, 6: 0.002})
    policy = WidthPolicy(probe_first=2, probe_max=4)
    costs.observe(1, 6, 9.0)  # the first real step (one-time work) is not counted
    for _ in range(HOPELESS_AFTER - 1):
        costs.observe(1, 6, 0.05)  # 50 plain steps' time for at most 6 tokens
    # the probe waits for the longest stretch (probe_max: the probe is dear), then runs
    assert [policy.choose(costs, 1, [0.0], (1, 6)) for _ in range(4)] == [1, 1, 1, 6]
    costs.observe(1, 6, 0.05)
    assert WidthPolicy.could_pay(costs, 1, 2) and not WidthPolicy.could_pay(costs, 1, 6)
    picks = [policy.choose(costs, 1, [0.0], (1, 6)) for _ in range(16)]
    assert picks == [1] * 16 and policy.schedule(costs, 1).every == 4  # the back-off grows: longer stretches


def test_a_width_whose_forward_alone_no_acceptance_could_repay_is_never_probed():
    """EAGLE-3 tree-16 over 256 requests on an H100 (eager past the speculative graphs' largest batch): one probe,
    its deferred draft_extend and its eager verify took 60% of a 127-step pass. A width whose measured forward
    alone costs more plain steps than it could yield at ALPHA_CEILING is not probed, real steps or none."""
    costs = _costs({1: 0.002, 16: 0.039}, bucket=256)
    policy = WidthPolicy(probe_first=2, probe_max=4)
    assert not WidthPolicy.could_pay(costs, 256, 16)
    assert [policy.choose(costs, 256, [0.0] * 256, (1, 16)) for _ in range(32)] == [1] * 32
    cheap = _costs({1: 0.002, 16: 0.004}, bucket=256)
    assert WidthPolicy.could_pay(cheap, 256, 16)
    policy = WidthPolicy(probe_first=2, probe_max=4)
    assert 16 in [policy.choose(cheap, 256, [0.0] * 256, (1, 16)) for _ in range(8)]


class _RecordingCosts(CostModel):
    def observe(self, batch_size: int, width: int, wall_s: float) -> None:
        self.seen.append((width, wall_s))


def test_unchained_steps_are_costed_by_their_whole_engine_cycle(smol_llm):
    """A speculative step's cost is the time from its start to the next engine step's start, so what the
    caller's loop and the engine do around each step counts for speculative steps as it does for plain
    windows (whose pace is measured the same way): here a caller that spends 0.2 s between steps."""
    llm = spec_llm(smol_llm, speculative_algorithm="NGRAM", max_num_seqs=1)
    ada = llm.engine.spec.adaptive
    widths = llm.engine.spec.widths()
    ada.costs = _RecordingCosts((1,), {(1, w): 0.001 for w in widths})
    ada.costs.seen = []
    ada.policy = CyclePolicy([6])
    step = llm.engine.step

    def slow_caller() -> list:
        out = step()
        time.sleep(0.2)
        return out

    llm.engine.step = slow_caller
    text = list(itertools.chain.from_iterable([[1000 + i for i in range(8)]] * 4))
    llm.generate([text], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert ada.costs.seen and all(w == 6 and s >= 0.2 for w, s in ada.costs.seen), ada.costs.seen


class _AlwaysFull(WidthPolicy):
    def best(self, costs, batch_size, alphas, widths) -> int:
        return max(widths)


def _chain_run(smol_llm, monkeypatch, policy: WidthPolicy, dear_s: float):
    """One request's greedy decode under the chained EAGLE-3 step (breakable-debug graphs, overlap on), every width's
    forward known, the policy given, each chain start dearer by dear_s; returns the worker, its chained steps and the
    full width's observed costs."""
    llm = spec_llm(smol_llm, cuda_graph_backend="breakable-debug", max_model_len=320, cuda_graph_max_bs=4,
                   disable_overlap_schedule=False, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    spec = llm.engine.spec
    assert spec.chain is not None
    widths = spec.widths()
    spec.adaptive.costs = _RecordingCosts((1, 2, 4), {(b, w): 0.001 for b in (1, 2, 4) for w in widths})
    spec.adaptive.costs.seen = []
    spec.adaptive.policy = policy
    spec.adaptive.fresh_probe = False  # the policy decides from the first decode
    start = type(spec.chain).start

    def dear_start(self, reqs):
        time.sleep(dear_s)
        return start(self, reqs)

    monkeypatch.setattr(type(spec.chain), "start", dear_start)
    prompt = llm.tokenizer.encode("The quick brown fox. " * 6)
    llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    steps = spec.stats.width_histogram.get(spec.num_draft_tokens, 0)
    return spec, steps, [s for w, s in spec.adaptive.costs.seen if w == spec.num_draft_tokens]


def test_a_chain_is_costed_with_its_start_and_end(smol_llm, monkeypatch):
    """A chained EAGLE step read 1.9 ms a step between two reads at 16 requests on an H100 (T = 1) while the fixed
    chain's passes worked out at >= 2.3 ms: each start (the draft_extend before it, staging) and end (the state
    copies) fell outside every timed interval, and chains restart whenever the batch changes. A chain that the
    batch's changes end is costed as a whole, start to end over its steps: here a start that costs 0.3 s more
    shows in its steps' cost."""
    spec, steps, seen = _chain_run(smol_llm, monkeypatch, _AlwaysFull(), 0.3)
    assert steps > 1 and spec.stats.worker_steps == 2  # the prefill and the chain's start: the rest ran in flight
    # one chain over the request's decode: its cost per step carries the start's 0.3 s
    assert len(seen) == 1 and seen[0] >= 0.3 / steps, (seen, steps)


class _FullThenPlain(WidthPolicy):
    """The full width for the first three choices (the chain's start and its next two steps), then plain."""
    def best(self, costs, batch_size, alphas, widths) -> int:
        self.calls = getattr(self, "calls", 0) + 1
        return max(widths) if self.calls <= 3 else 1


def test_a_chain_run_the_policy_ends_is_costed_at_its_pace(smol_llm, monkeypatch):
    """At one request on an H100 the adaptive chain's runs lasted 4-8 steps, the policy ending each, and costed whole
    they read 2.15-2.29 ms a step against the fixed chain's ~1.33 ms: the policy stayed plain (0.99x plain) where the
    fixed chain ran 1.09x. A run the policy ends is costed at the pace of its reads; its start and end (here a start
    that costs 0.5 s more) count once per switch, in the probes' spacing."""
    spec, steps, seen = _chain_run(smol_llm, monkeypatch, _FullThenPlain(), 0.5)
    excursions = spec.adaptive.costs.excursions_s[1]
    assert steps >= 2 and len(seen) == 1 and len(excursions) == 1, (steps, seen, excursions)
    # the run's time beyond steps x pace holds the start's 0.5 s, so the pace left it out
    assert excursions[0] >= 0.5 and 0 < seen[0] and spec.adaptive.costs.switch_s(1) == excursions[0]


class _NeverPays(WidthPolicy):
    """Plain on the merits, every time: only the probes run the chain."""
    def best(self, costs, batch_size, alphas, widths) -> int:
        return 1


def test_a_probe_runs_the_chain_long_enough_to_cost_it_at_its_pace(smol_llm, monkeypatch):
    """At one request on an H200 (ab9d41b) each probe ran one chained step, the policy ending the chain at its first
    ask; a run of one step is costed whole (its start and end in its one step): 2.1-2.4 ms against a pace of
    ~1.2 ms, and the policy stayed plain in 2024 of 2028 steps where the fixed chain ran 1.36x plain. A probe now
    runs PROBE_CHAIN_STEPS chained steps before the policy is asked, so its pace is measured apart from its start
    (here 0.3 s dearer), which counts once per switch."""
    spec, steps, seen = _chain_run(smol_llm, monkeypatch, _NeverPays(probe_first=2, probe_max=2), 0.3)
    excursions = spec.adaptive.costs.excursions_s.get(1, ())
    # the first probe's run (a later one may end with the request, and a run the batch ends is costed whole)
    assert steps >= PROBE_CHAIN_STEPS and seen and excursions, (steps, seen, excursions)
    assert seen[0] < 0.3 and excursions[0] >= 0.3, (seen, excursions)


def test_a_chain_runs_pace_and_its_switch_cost():
    """CostModel.observe_chain: the pace of the reads after the first is the step cost; the rest of the run, with
    the median flush, is what a switch costs; a run of one step is costed whole."""
    costs = _costs({1: 0.001, 6: 0.002})
    for _ in range(2):  # a width's first real step carries one-time work: the second is its cost
        costs.observe_chain(1, 6, 5, began=0.0, first_read=0.004, last_read=0.004 + 4 * 0.0013, ended=0.0095)
    assert costs.step_s(1, 6) == pytest.approx(0.0013)
    assert costs.switch_s(1) == pytest.approx(0.0095 - 5 * 0.0013)
    costs.observe_switch(1, 0.002)
    assert costs.switch_s(1) == pytest.approx(0.0095 - 5 * 0.0013 + 0.002)
    costs.observe_chain(1, 6, 1, began=0.0, first_read=0.003, last_read=0.003, ended=0.0035)
    assert list(costs.recent_s[1, 6]) == pytest.approx([0.0013, 0.0035])


def test_a_plain_stretch_weighs_the_batch_once_not_every_window(smol_llm, prompts, plain, monkeypatch):
    """The overlap schedule runs one-step windows; while the batch stays the same, the policy's plain answer
    stands for the whole stretch up to the probe (plain steps change no acceptance). Weighing every request again
    every few windows was host work per step that plain decoding never does (~0.2 ms a step at 256 requests)."""
    kw, _ = SWITCHING["ngram"]
    llm = spec_llm(smol_llm, max_num_seqs=len(prompts), disable_overlap_schedule=False, **kw)
    ada = llm.engine.spec.adaptive
    widths = llm.engine.spec.widths()
    # speculation pays only above alpha 0.8, so the prior (0.6) starts plain and the probes could still pay
    ada.costs = CostModel((len(prompts),), {(len(prompts), w): 0.001 * expected_tokens(0.8, w) for w in widths})
    ada.policy = WidthPolicy(probe_first=64, probe_max=64)
    asked = []  # the batch (request ids) each time the policy weighs one for a plain stretch
    weigh = AdaptiveSpec.plain_steps
    monkeypatch.setattr(AdaptiveSpec, "plain_steps",
                        lambda self, reqs, *a: asked.append(tuple(r.request_id for r in reqs)) or weigh(self, reqs, *a))
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.engine.spec_stats().plain_window_steps >= 30  # one-step windows almost throughout
    # once per batch (it changes as prefill chunks join); before, the same batch every ninth window
    assert asked and len(asked) == len(set(asked)), asked


def test_the_draft_extend_after_a_plain_stretch_is_not_the_speculative_steps_cost(smol_llm, monkeypatch):
    """A probe is one speculative step after a plain stretch, and before it the draft catches up over the stretch's
    tokens (the deferred draft_extend). That catch-up is the switch's cost, once per stretch: counted in the probe's
    step cost, every probe read a chained step at 2-4x what it costs, and the policy never speculated where it paid.
    Here a catch-up that takes 0.3 s: no speculative step's measured cost carries it."""
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                   max_num_seqs=1)
    ada = llm.engine.spec.adaptive
    widths = llm.engine.spec.widths()
    ada.costs = _RecordingCosts((1,), {(1, w): 0.001 for w in widths})
    ada.costs.seen = []
    ada.policy = CyclePolicy([1, 1, 1, 6])
    flushed = []
    flush = AdaptiveSpec.flush

    def slow_flush(self, reqs, drafter) -> int:
        rows = flush(self, reqs, drafter)
        if rows:
            flushed.append(rows)
            time.sleep(0.3)
        return rows

    monkeypatch.setattr(AdaptiveSpec, "flush", slow_flush)
    prompt = llm.tokenizer.encode("The quick brown fox. " * 6)
    llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    spec_costs = [s for w, s in ada.costs.seen if w > 1]
    assert flushed and spec_costs, (flushed, ada.costs.seen)
    assert max(spec_costs) < 0.3, ada.costs.seen
    assert ada.costs.switch_s(1) >= 0.3  # the switch's own cost, which spaces the probes


class _RecordingPolicy(WidthPolicy):
    def choose(self, costs, batch_size, alphas, widths) -> int:
        self.seen.add(tuple(widths))
        return super().choose(costs, batch_size, alphas, widths)


def test_where_a_chain_serves_the_batch_only_plain_or_the_chain_is_weighed(smol_llm):
    """A width narrower than the chained EAGLE step runs unchained (separate draft, verify and extend, a host sync):
    on an H100 it cost more than the chained full width at every batch measured (5x at T = 1 and one request), so
    where a chain serves the batch the policy weighs only plain and the chain; a batch no chain serves (here:
    logprobs asked) keeps every width."""
    llm = spec_llm(smol_llm, cuda_graph_backend="breakable-debug", max_model_len=320, cuda_graph_max_bs=4,
                   disable_overlap_schedule=False, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
    spec = llm.engine.spec
    assert spec.chain is not None
    full = spec.num_draft_tokens
    prompt = llm.tokenizer.encode("The quick brown fox. " * 6)
    for params, want in ((SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), {(1, full)}),
                         (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1),
                          {candidate_widths(full, False)})):
        spec.adaptive.policy = _RecordingPolicy()
        spec.adaptive.policy.seen = set()
        llm.generate([prompt], params)
        assert spec.adaptive.policy.seen == want, (params, spec.adaptive.policy.seen)


def _extends(llm) -> list[tuple[int, int]]:
    """Record each draft_extend the drafter runs: (first row, end) of its first chunk."""
    drafter = llm.engine.spec.drafter
    seen: list[tuple[int, int]] = []
    real = drafter.after_extend

    def after_extend(chunks, hidden):
        seen.append((chunks[0].start, chunks[0].end))
        return real(chunks, hidden)

    drafter.after_extend = after_extend
    return seen


def test_pinned_to_plain_the_drafter_runs_only_at_prefill(smol_llm, monkeypatch):
    """TERCEL_ADAPTIVE_PIN=plain (the plain stretches' own cost, side by side with the plain engine): every decode
    step is plain, nothing is probed, and with the deferred rows under the budget the draft runs only over the
    prompt; an unknown value is refused with the ones it takes."""
    monkeypatch.setenv("TERCEL_ADAPTIVE_PIN", "plain")
    prompt = smol_llm.tokenizer.encode("The quick brown fox. " * 6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = smol_llm.generate([prompt], params)[0].outputs[0].token_ids
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                   max_num_seqs=1)
    seen = _extends(llm)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    stats = llm.engine.spec_stats()
    assert stats.verify_steps == 0 and set(stats.width_histogram) == {1} and seen == [(0, len(prompt))], (stats, seen)
    monkeypatch.setenv("TERCEL_ADAPTIVE_PIN", "spec")
    with pytest.raises(ConfigError, match="TERCEL_ADAPTIVE_PIN='spec'"):
        AdaptiveSpec.for_batches(8)


def test_the_probe_share_switch_spaces_probes_by_its_share(monkeypatch):
    """TERCEL_ADAPTIVE_PROBE_SHARE (side-by-side runs of the probe spacing): a probe and the draft_extend it forces
    cost at most that share of the plain stretch before it; a value outside (0, 1) is refused with the range.
    TERCEL_ADAPTIVE_PROBE_MAX caps the stretch; anything but a positive integer is refused."""
    def stretch() -> int:
        ada = AdaptiveSpec.for_batches(8)
        ada.costs.forward_s.update({(1, 1): 2.0 ** -10, (1, 4): 2.0 ** -8})  # a width-4 step costs 4 plain steps
        width, steps = ada.policy.probe(ada.costs, 1, (1, 4))
        assert width == 4
        return steps

    assert stretch() == math.ceil(4 / 0.03)  # unset: 3 %
    monkeypatch.setenv("TERCEL_ADAPTIVE_PROBE_SHARE", "0.0625")
    assert stretch() == 64
    for bad in ("0", "1.5", "often"):
        monkeypatch.setenv("TERCEL_ADAPTIVE_PROBE_SHARE", bad)
        with pytest.raises(ConfigError, match=f"TERCEL_ADAPTIVE_PROBE_SHARE='{bad}' must be a number in"):
            AdaptiveSpec.for_batches(8)
    monkeypatch.setenv("TERCEL_ADAPTIVE_PROBE_SHARE", "0.01")
    assert stretch() == 400
    monkeypatch.setenv("TERCEL_ADAPTIVE_PROBE_MAX", "256")  # the cap on the stretch
    assert stretch() == 256
    for bad in ("0", "-4", "2.5", "never"):
        monkeypatch.setenv("TERCEL_ADAPTIVE_PROBE_MAX", bad)
        with pytest.raises(ConfigError, match=f"TERCEL_ADAPTIVE_PROBE_MAX='{bad}' must be an integer >= 1"):
            AdaptiveSpec.for_batches(8)


def test_a_draft_extend_padded_to_few_shapes_gives_the_exact_shapes_draft_state(smol_llm, prompts):
    """On a GPU each eager draft_extend (a prefill's, a plain stretch's deferred flush) runs at shapes rounded up to
    few buckets (eagle.extend_shape: a flush at a new shape nearly every time cost 3.6-7.6 ms of host time). The
    padding rows write the dummy slot and the padded prefix is masked: every draft state it leaves (hidden, logits,
    first draft) is the exact shapes' one, and the output is plain decoding's."""
    assert eagle.extend_shape(6, 0) == (8, 0) and eagle.extend_shape(9, 257) == (16, 512)
    assert eagle.extend_shape(512, 256) == (512, 256) and eagle.extend_shape(513, 1) == (1024, 256)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in smol_llm.generate(prompts[:2], params)]
    states = {}
    for pad in (False, True):
        llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", max_num_seqs=2,
                       speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT))
        spec = llm.engine.spec
        spec.drafter.pad_extend = pad
        spec.adaptive.policy = _NeverPays(probe_first=8, probe_max=8)  # plain stretches, each probe flushes them
        seen = states[pad] = []
        real = spec.drafter.extend_rows

        def extend_rows(reqs, starts, ids, hidden, width, real=real, seen=seen):
            real(reqs, starts, ids, hidden, width)
            seen.append([(r.spec_state.valid_for, r.spec_state.hidden.clone(), r.spec_state.logits.clone(),
                          int(r.spec_state.first)) for r in reqs])

        spec.drafter.extend_rows = extend_rows
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)] == plain
    assert len(states[True]) == len(states[False]) > 2  # the prefill's and the flushes'
    for exact, padded in zip(states[False], states[True]):
        for (n, h, lg, first), (n2, h2, lg2, first2) in zip(exact, padded):
            assert n == n2 and first == first2
            torch.testing.assert_close(h2, h, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(lg2, lg, rtol=1e-4, atol=1e-4)
