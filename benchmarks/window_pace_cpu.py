"""Host µs per plain decode window step: the plain engine against adaptive speculation pinned to plain windows.

On the H200 at 2e40fc6 adaptive EAGLE-3 ran its bs-1 passes almost all as plain windows and read 0.94x plain (DFLASH
0.97x, n-gram 1.00x). This measures what a plain window step costs the host on each engine, with the device's part
taken out: SmolLM2 on the CPU, overlap schedule on, each engine's one-token model step answered from a cached output
(prefills run for real), TERCEL_ADAPTIVE_PIN=plain for the speculative engines (every decode step a plain window
that keeps the drafter's hidden rows). The pace is the median gap between window read-backs, past the first 8;
interleaved rounds, median over rounds.

Usage: PYTHONPATH=. python benchmarks/window_pace_cpu.py --model $SMOLLM2_GGUF [--tokens 128] [--rounds 5]
       --out benchmarks/results/window_pace_cpu_<commit>.json
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
from common import environment, switches  # noqa: E402

ENGINES = {"plain": {}, "eagle3": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
           "dflash": dict(speculative_algorithm="DFLASH"), "ngram": dict(speculative_algorithm="NGRAM")}


def build(model: str, name: str):
    from tercel import LLM
    from tercel.speculative import DEFAULT_DFLASH_DRAFT, DEFAULT_EAGLE3_DRAFT

    kw = dict(ENGINES[name])
    algo = kw.get("speculative_algorithm")
    if algo in ("EAGLE3", "DFLASH"):
        kw["speculative_draft_model_path"] = str(DEFAULT_EAGLE3_DRAFT if algo == "EAGLE3" else DEFAULT_DFLASH_DRAFT)
    with switches({"TERCEL_ADAPTIVE_PIN": "plain"}):
        llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=128 << 20,
                  disable_overlap_schedule=False, progress=False, **kw)
    eng = llm.engine
    run, cache = eng.executor.run, {}

    def cached(kind, batch):  # one token per request: the first output again (the device's part, taken out)
        if batch.input_ids.shape[0] != batch.num_requests:
            return run(kind, batch)
        key = (kind, batch.num_requests, batch.capture_hidden_mode)
        if key not in cache:
            cache[key] = run(kind, batch)
        return cache[key]

    collect, stamps = eng._collect_window, []

    def stamped(window):
        stamps.append(time.perf_counter())
        return collect(window)

    eng.executor.run, eng._collect_window = cached, stamped
    return llm, stamps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tercel import SamplingParams

    torch.set_num_threads(2)
    engines = {n: build(args.model, n) for n in args.engines.split(",")}
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    paces: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, (llm, stamps) in engines.items():
            stamps.clear()
            llm.generate(["Write a poem about the moon."], params)
            gaps = [b - a for a, b in zip(stamps, stamps[1:])][8:]
            paces[name].append(1e6 * statistics.median(gaps))
    res = {n: {"us_per_window_step": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v],
               "plain_window_steps": llm.engine.spec_stats().plain_window_steps if llm.engine.spec else None}
           for n, v in paces.items() for llm in [engines[n][0]]}
    for n, r in res.items():
        print(f"{n:8s} {r['us_per_window_step']:7.1f} µs per window step {r['rounds']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "window_pace_cpu", "environment": environment(), "tokens": args.tokens,
        "method": "host µs per plain decode window step (median gap between read-backs past the first 8), SmolLM2 "
                  "fp32 on the CPU, overlap schedule, one-token model steps answered from a cached output; "
                  "speculative engines with TERCEL_ADAPTIVE_PIN=plain; median over interleaved rounds",
        "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
