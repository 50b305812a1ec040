"""Adaptive speculation's policy offline: one request's decode simulated under the real WidthPolicy, CostModel and
RequestAcceptStats (tercel/speculative/adaptive.py), with step costs measured on a GPU and drafts accepted at a
known per-position acceptance alpha. It answers what the policy gives against plain and against the fixed width
when nothing but the policy varies (no host noise), and lets a policy change be compared before a device run.

What it models: a fresh request's first decode at the full width (AdaptiveSpec.fresh_width), then per step the
policy's choice from the request's own decayed estimate; a probe held for PROBE_CHAIN_STEPS chained steps; each
return from plain to speculation paying --switch-ms (the deferred draft_extend); plain steps at --plain-ms, full-width
steps at --spec-ms. Variants: `base` (the policy as shipped) and `hysteresis` (leaving speculation charges plain with
the switch back, spread over the policy's first probe stretch), each at --decay / --prior-weight.

Usage: python benchmarks/adaptive_sim.py [--alphas 0,0.3,0.5,0.62,0.7,0.75,0.8] [--plain-ms 0.5 --spec-ms 1.24
       --switch-ms 4] [--variants base,hysteresis] [--decays 0.8,0.9] [--out benchmarks/results/adaptive_sim.json]
(the defaults: an H100 at 34e85c8, SmolLM2 with the bundled EAGLE-3 chain of 5 drafts at one request).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment  # noqa: E402

from tercel.speculative.adaptive import (  # noqa: E402
    PRIOR_WEIGHT,
    PROBE_CHAIN_STEPS,
    SWITCH_GAIN,
    CostModel,
    RequestAcceptStats,
    WidthPolicy,
    expected_tokens,
)


class HysteresisPolicy(WidthPolicy):
    """Leaving a running speculative width for plain charges each plain step with the switch back (the deferred
    draft_extend), spread over the first probe stretch: a dip of a noisy estimate under the break-even no longer
    sends the request plain for the rest of its life."""

    def best(self, costs: CostModel, batch_size: int, alphas, widths) -> int:
        back = costs.switch_s(batch_size) / self.probe_first if self.width > 1 else 0.0
        rates = []
        for w in widths:
            tokens = float(len(alphas)) if w == 1 else sum(map(expected_tokens, alphas, itertools.repeat(w)))
            rate = tokens / (costs.step_s(batch_size, w) + (back if w == 1 else 0.0))
            rates.append((rate if w == 1 or w == self.width else rate / SWITCH_GAIN, -w))
        return -max(rates)[1]


POLICIES = {"base": WidthPolicy, "hysteresis": HysteresisPolicy}


def simulate(alpha: float, seed: int, policy: WidthPolicy, *, plain_s: float, spec_s: float, switch_s: float,
             width: int, tokens: int, prior: float, decay: float, prior_weight: float) -> tuple[float, int, int]:
    """(tokens per second, speculative steps, plain steps) of one request of `tokens` tokens."""
    rng = random.Random(seed)
    costs = CostModel((1,))
    costs.forward_s = {(1, 1): plain_s, (1, width): spec_s}
    for w, s in ((1, plain_s), (width, spec_s)):
        costs.first_s[1, w] = s
        for _ in range(9):
            costs.observe(1, w, s)
    for _ in range(3):
        costs.observe_switch(1, switch_s)
    stats = RequestAcceptStats(prior * prior_weight, prior_weight)
    elapsed, done, spec_steps, plain_steps, hold, last = 0.0, 0, 0, 0, 0, width
    first = True
    while done < tokens:
        if first or hold > 0:  # the fresh request's full-width step; a probe's held chain
            w, first, hold = width, False, max(0, hold - 1)
        else:
            w = policy.choose(costs, 1, [stats.alpha], (1, width))
            hold = PROBE_CHAIN_STEPS - 1 if policy.probed else 0
        if w == 1:
            done, elapsed, plain_steps = done + 1, elapsed + plain_s, plain_steps + 1
        else:
            accepted = 0
            while accepted < width - 1 and rng.random() < alpha:
                accepted += 1
            stats.record(width - 1, accepted, decay)
            elapsed += spec_s + (switch_s if last == 1 else 0.0)
            done, spec_steps = done + accepted + 1, spec_steps + 1
        last = w
    return done / elapsed, spec_steps, plain_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alphas", default="0,0.3,0.5,0.58,0.62,0.66,0.7,0.75,0.8")
    ap.add_argument("--plain-ms", type=float, default=0.5)
    ap.add_argument("--spec-ms", type=float, default=1.24)
    ap.add_argument("--switch-ms", type=float, default=4.0)
    ap.add_argument("--width", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prior", type=float, default=0.65, help="the recent requests' alpha a new request starts from")
    ap.add_argument("--variants", default="base,hysteresis")
    ap.add_argument("--decays", default="0.8,0.9")
    ap.add_argument("--prior-weight", type=float, default=PRIOR_WEIGHT)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    plain_s, spec_s, switch_s = args.plain_ms / 1e3, args.spec_ms / 1e3, args.switch_ms / 1e3
    res = {"benchmark": "adaptive policy simulated for one request (benchmarks/adaptive_sim.py)",
           "environment": environment(), "plain_ms": args.plain_ms, "spec_ms": args.spec_ms,
           "switch_ms": args.switch_ms, "width": args.width, "tokens": args.tokens, "prior": args.prior,
           "seeds": args.seeds, "results": {}}
    for variant, decay in itertools.product(args.variants.split(","), map(float, args.decays.split(","))):
        rows = res["results"][f"{variant} decay {decay}"] = {}
        for alpha in map(float, args.alphas.split(",")):
            runs = [simulate(alpha, s, POLICIES[variant](), plain_s=plain_s, spec_s=spec_s, switch_s=switch_s,
                             width=args.width, tokens=args.tokens, prior=args.prior, decay=decay,
                             prior_weight=args.prior_weight) for s in range(args.seeds)]
            rate = statistics.mean(r[0] for r in runs)
            fixed = expected_tokens(alpha, args.width) / spec_s
            rows[str(alpha)] = {"vs_plain": round(rate * plain_s, 3), "vs_fixed": round(rate / fixed, 3),
                                "vs_best": round(rate / max(fixed, 1 / plain_s), 3),
                                "spec_steps": round(statistics.mean(r[1] for r in runs), 1),
                                "plain_steps": round(statistics.mean(r[2] for r in runs), 1)}
            print(f"{variant:10s} decay {decay}  alpha {alpha:.2f}: {rows[str(alpha)]}", file=sys.stderr)
    text = json.dumps(res, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
