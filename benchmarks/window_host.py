"""Host time of a decode window's bookkeeping at a batch of requests (the per-step work that sets the pace on a GPU
at large batches, where a SmolLM2 step's kernels take ~1.1 ms at 256 requests on an H100 and the step ~2.5 ms).

A tiny random Llama on the CPU (its forwards are not timed): N requests are admitted and decoding, then each
round times, per part, what the overlap schedule does once per step: `_window_steps` (may a window run, and how
long), `Scheduler.schedule_decode_window` (the window's KV slots, prefix-cache publishing), `_build_window` (the
rows and their upload; on the CPU the upload is the same packing as the GPU's pinned staging, minus the copy) and
`_collect_window` (one token per request appended, with the stop checks). Median µs per part over the rounds.

Usage: PYTHONPATH=. python benchmarks/window_host.py [--requests 64,256] [--rounds 200] --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from common import environment  # noqa: E402
from graph_utils import tiny_model  # noqa: E402

from tercel import SamplingParams  # noqa: E402
from tercel.engine import InflightWindow, LLMEngine  # noqa: E402
from tercel.loader import LoadedModel  # noqa: E402
from tercel.sampling_params import RequestOutputKind  # noqa: E402


def measure(n: int, rounds: int) -> dict[str, float]:
    model, cfg = tiny_model()
    loaded = LoadedModel(model, cfg, None, Path("tiny-random"), (10**9,))  # no EOS: nothing stops early
    e = LLMEngine(loaded=loaded, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=n * 40 + 8,
                  block_size=16, disable_overlap_schedule=False, max_num_seqs=n, enable_prefix_caching=True)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(n):
        e.add_request(torch.randint(3, cfg.vocab_size, (16,), generator=g).tolist(), sp)
    for _ in range(1000):  # until every request is admitted and decoding, with nothing in flight
        e.step()
        if len(e.scheduler.running) == n and not e.scheduler.waiting and e._inflight is None and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in e.scheduler.running):
            break
    else:
        raise RuntimeError(f"{n} requests did not all reach decoding")
    reqs = list(e.scheduler.running)
    longest = max(len(r.output_token_ids) for r in reqs)
    if longest + rounds + 1 >= sp.max_tokens:
        raise RuntimeError(f"the warm-up left a request at {longest} tokens: {rounds} rounds would finish it")
    tokens = torch.full((1, n), 5, dtype=torch.long)
    def schedule() -> None:
        if e.scheduler.schedule_decode_window(1) is None:
            raise RuntimeError("no decode window: the KV pool ran out")

    parts = {"window_steps": lambda: e._window_steps(),
             "schedule_decode_window": schedule,
             "build_window": lambda: e._build_window(reqs, 1),
             "collect_window": lambda: e._collect_window(InflightWindow(reqs, 1, tokens, tokens, None, False, None))}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(rounds):  # one window per round, in the engine's order (the KV slots reserved before the rows)
        for k, fn in parts.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    out = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    out["total"] = round(sum(out.values()), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = dict(benchmark="window_host", environment=environment(),
               method="median host µs per part of one decode window (overlap schedule, one step), tiny random "
                      "Llama on the CPU, every request decoding, prefix caching on", results={})
    for n in (int(x) for x in args.requests.split(",")):
        res["results"][str(n)] = measure(n, args.rounds)
        print(n, res["results"][str(n)], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
