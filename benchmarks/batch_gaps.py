"""Where an adaptive engine's plain stretches lose to plain decoding at a batch (issue #31): GPU busy and idle
time, kernels and the heaviest kernels per output token of the batch (a decode step's worth), through
`LLM.chat` as spec_rounds.py runs it.

At 64 requests adaptive engines that run nothing but plain windows measured 0.82-0.93x plain on the H200
(spec_rounds_adaptive_focus_h200_fde67c2.json.gz); this tells a GPU-side cost (more busy µs per step) from a
host-side one (more idle µs: the GPU waits for the host). Each configuration (spec_rounds.py's names) is built on
the shared weights, warmed up, then one pass of `--concurrency` requests runs under torch.profiler (CUDA activity
only). Per output token of the batch: busy (the union of kernel intervals), idle (the rest
of the span), kernels; the engine's step count and the widths it ran.

Usage: PYTHONPATH=. python benchmarks/batch_gaps.py --model $M [--concurrency 64] [--tokens 128]
       [--configs plain,ngram-adaptive,eagle3-tree16-adaptive] --out FILE.json
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402
from spec_rounds import CONFIGS, build, run_point  # noqa: E402
from step_gaps import busy_idle, timeline  # noqa: E402


def gaps(ops: list[tuple[float, float, str]], steps: int) -> dict:
    """Busy / idle µs, kernels and the heaviest kernels per step (steps: output tokens per request)."""
    busy, idle, _, _ = busy_idle(ops)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in ops:
        by_name[name][0] += 1
        by_name[name][1] += end - start
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return dict(busy_us_per_step=round(busy / steps, 1), idle_us_per_step=round(idle / steps, 1),
                kernels_per_step=round(len(ops) / steps, 1),
                top_kernels=[dict(name=k[:100], per_step=round(n / steps, 2), us_per_step=round(us / steps, 1))
                             for k, (n, us) in top])


def host_top(prof: cProfile.Profile, steps: int, n: int = 30) -> list[dict]:
    """The functions with the most own (tottime) and inclusive (cumtime) host µs per step."""
    st = pstats.Stats(prof)
    rows = [(f"{Path(f).name}:{line}({fn})", tt, ct, nc) for (f, line, fn), (_, nc, tt, ct, _) in st.stats.items()]
    top = sorted(rows, key=lambda r: -r[1])[:n] + sorted(rows, key=lambda r: -r[2])[:n]
    seen, out = set(), []
    for name, tt, ct, nc in top:
        if name not in seen:
            seen.add(name)
            out.append(dict(fn=name, calls_per_step=round(nc / steps, 2), own_us_per_step=round(tt / steps * 1e6, 1),
                            cum_us_per_step=round(ct / steps * 1e6, 1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--configs", default="plain,ngram-adaptive,eagle3-tree16-adaptive,eagle3-chain-adaptive")
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--host-profile", action="store_true", help="also cProfile one pass per configuration")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tercel import LLM
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    c = args.concurrency
    texts = EVAL_CHAT_PROMPTS[:4] + EVAL_CODE_PROMPTS[:4]
    convs = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(c)]
    base = LLM(args.model, dtype="bfloat16", device="cuda", max_model_len=2048, kv_cache_memory=args.kv_bytes,
               progress=False)
    llms = build(base, names, dict(kv_cache_memory=args.kv_bytes, cuda_graph_bs=[c]), "cuda")
    res = dict(benchmark="batch_gaps", environment=environment(), command=" ".join(["python"] + sys.argv),
               concurrency=c, tokens=args.tokens, results={})
    for name, llm in llms.items():  # warm-up: allocator, first shapes, the adaptive cost model at this batch
        run_point(llm, convs, c, 32, CONFIGS[name][1])
        run_point(llm, convs, c, args.tokens, CONFIGS[name][1])
    for name, llm in llms.items():
        temp = CONFIGS[name][1]
        plain = run_point(llm, convs, c, args.tokens, temp)  # unprofiled, for tok/s
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            point = run_point(llm, convs, c, args.tokens, temp)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        steps = args.tokens  # per output token of the batch: one decode step's worth, whatever the engine ran
        row = dict(tok_s=round(plain["tok_s"], 1), profiled_wall_us_per_step=round(wall / steps * 1e6, 1),
                   verify_steps=point["verify_steps"], plain_window_steps=point["plain_window_steps"],
                   steps_by_width=point["steps_by_width"], **gaps(timeline(prof), steps))
        if args.host_profile:  # where the host's time goes in one more pass (the GPU's idle time is host time)
            prof_host = cProfile.Profile()
            prof_host.enable()
            run_point(llm, convs, c, args.tokens, temp)
            prof_host.disable()
            row["host_top"] = host_top(prof_host, steps)
        res["results"][name] = row
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'top_kernels'})}", flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
