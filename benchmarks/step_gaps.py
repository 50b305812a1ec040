"""Where a bs=1 decode loses time against its graph: the GPU timeline of a greedy generation, per token.

Runs the Llama-3.1-8B-shaped random model (or SmolLM2 with --smol) under torch.profiler (CUDA activity
only, so host launches are not slowed by CPU tracing), once per engine setting (single step with and
without the overlap schedule, multi-step windows), and reports per generated token:
  busy_us   GPU time covered by kernels and copies (the union of their intervals)
  idle_us   the rest of the token's wall time on the GPU timeline: launch gaps and host waits
  the kernels that run outside the decode graph (their names and time per token), and the largest idle
  gaps with the operation that ended each one.
The decode graph's own GPU time (benchmarks/gpu_decode.py's graph_step_gpu_ms) is the floor; idle_us and
the outside kernels are what the engine adds on top.

Usage: PYTHONPATH=. python benchmarks/step_gaps.py [--smol PATH] --out FILE.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402
from gpu_decode import generate, graph_step_ms, llama8b_loaded  # noqa: E402

SETTINGS = {  # name -> (num_scheduler_steps, overlap schedule)
    "single": (1, False), "overlap": (1, True), "multistep32": (32, False), "multistep32_overlap": (32, True)}


def timeline(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel / memcpy / memset, in start order."""
    ops = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ops)


def busy_idle(ops: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, str]], float]:
    """(busy us: the union of the ops' intervals, idle us: the rest of the span, the idle gaps as (us, the op
    that ended each), the span's end) over a timeline in start order."""
    busy, idle, cursor = 0.0, 0.0, ops[0][0]
    gaps: list[tuple[float, str]] = []
    for start, end, name in ops:
        if start > cursor:
            idle += start - cursor
            gaps.append((start - cursor, name))
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    return busy, idle, gaps, cursor


def analyse(ops: list[tuple[float, float, str]], graph_kernels: set[str], tokens: int) -> dict:
    busy, idle, gaps, cursor = busy_idle(ops)
    outside: dict[str, float] = collections.defaultdict(float)
    for start, end, name in ops:
        if name not in graph_kernels:
            outside[name] += end - start
    by_next: dict[str, list[float]] = collections.defaultdict(list)
    for g, name in gaps:
        if g > 1.0:
            by_next[name[:80]].append(g)
    return {
        "span_us_per_token": round((cursor - ops[0][0]) / tokens, 1),
        "busy_us_per_token": round(busy / tokens, 1), "idle_us_per_token": round(idle / tokens, 1),
        "outside_graph_kernels_us_per_token": {k[:80]: round(v / tokens, 2)
                                               for k, v in sorted(outside.items(), key=lambda kv: -kv[1])[:12]},
        "idle_over_1us_by_next_op": sorted(({"next_op": k, "count_per_token": round(len(v) / tokens, 2),
                                             "us_per_token": round(sum(v) / tokens, 2), "max_us": round(max(v), 1)}
                                            for k, v in by_next.items()), key=lambda r: -r["us_per_token"])[:12],
    }


def graph_kernel_names(runner) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    g = runner.graphs[1].graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return {name for _, _, name in timeline(prof)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smol", default=None, help="SmolLM2 GGUF (default: the Llama-3.1-8B shape, random)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from tercel.engine import LLMEngine

    env = environment()
    env["commit"] = os.environ.get("TERCEL_COMMIT", env["commit"])
    env["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    common = dict(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=8, progress=False,
                  cuda_graph_bs=[1, 2, 4, 8], skip_tokenizer_init=True, kv_cache_memory=4 << 30)
    if args.smol:
        engine = LLMEngine(args.smol, **common)
        label = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)"
    else:
        engine = LLMEngine(loaded=llama8b_loaded(2048), **common)
        label = "Llama-3.1-8B shape, random weights (seeded normal std 0.02)"
    prompt = [torch.randint(1000, 30000, (32,), generator=torch.Generator().manual_seed(1)).tolist()]
    graph_ms = graph_step_ms(engine.graph_runner, 1)
    names = graph_kernel_names(engine.graph_runner)
    result = {"benchmark": "step_gaps", "env": env, "model": label, "new_tokens": args.new_tokens,
              "graph_step_gpu_us": round(graph_ms * 1e3, 1), "graph_kernels": len(names), "settings": {}}
    for name in args.settings.split(","):
        steps, overlap = SETTINGS[name]
        engine.num_scheduler_steps, engine.overlap_schedule = steps, overlap
        generate(engine, prompt, args.new_tokens)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = generate(engine, prompt, args.new_tokens)[0]
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        row = analyse(timeline(prof), names, args.new_tokens)
        row["wall_us_per_token"] = round(wall / args.new_tokens * 1e6, 1)
        row["decode_tok_s"] = round(out.metrics.decode_tokens_per_s, 1)
        result["settings"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
