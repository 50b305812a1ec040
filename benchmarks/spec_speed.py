"""Decode speed with and without speculative decoding: plain (CUDA graphs on a GPU, and eager) vs
NGRAM, EAGLE3 (chain and tree), DFLASH and DDTREE with the bundled drafts on SmolLM2 at batch 1 and 16,
greedy, fixed-length outputs. Speculative steps replay CUDA graphs (verify, the EAGLE draft loop and
draft_extend); `*-eager` rows run them without graphs. Prints a table; writes a JSON.

Usage: PYTHONPATH=. python benchmarks/spec_speed.py [--model PATH] [--draft DIR] [--device cuda]
       [--new-tokens 128] [--out benchmarks/results/spec_speed_smollm2_h200.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, environment, exact_dtype  # noqa: E402

CONFIGS = [  # (name, algorithm, topk, num_draft_tokens, engine keywords)
    ("plain", None, None, None, {}), ("plain-eager", None, None, None, {"disable_cuda_graph": True}),
    ("ngram", "NGRAM", 1, 6, {}), ("eagle3-chain-5", "EAGLE3", 1, None, {}),
    ("eagle3-chain-5-eager", "EAGLE3", 1, None, {"disable_cuda_graph": True}),
    ("eagle3-chain-5-unchained", "EAGLE3", 1, None, {"env": {"TERCEL_SPEC_CHAIN": "0"}}),
    ("eagle3-chain-3", "EAGLE3", 1, None, {"speculative_num_steps": 3}),
    ("eagle3-chain-7", "EAGLE3", 1, None, {"speculative_num_steps": 7}),
    ("eagle3-chain-5-map", "EAGLE3", 1, None, {"token_map": True}), ("eagle3-tree-topk4-8", "EAGLE3", 4, 8, {}),
    ("eagle3-tree-topk4-16", "EAGLE3", 4, 16, {}),
    ("dflash-16", "DFLASH", None, None, {}), ("ddtree-16", "DDTREE", None, None, {"speculative_ddtree_budget": 16}),
]


def trace(llm, batch, params, out: Path) -> None:
    """One generate under torch.profiler: every kernel (graph replays included) with its GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        llm.generate(batch, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    (out / "kernels.txt").write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=60))
    prof.export_chrome_trace(str(out / "trace.json"))
    import gzip
    import shutil
    with open(out / "trace.json", "rb") as f, gzip.open(out / "trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    (out / "trace.json").unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft (default: the bundled one)")
    ap.add_argument("--dflash-draft", default=None, help="DFlash draft (default: the bundled one)")
    ap.add_argument("--token-map", default=None, help="--speculative-token-map for the EAGLE-3 configs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampling-temperatures", default="",
                    help="also run batch 1 at these temperatures (top-p 0.95), e.g. 1.0")
    ap.add_argument("--warmup-seconds", type=float, default=20.0,
                    help="plain decoding this long before any timing (the GPU leaves its idle clocks)")
    ap.add_argument("--sampling-configs", default=None, help="the configs that run those (default: all)")
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", default=None, help="default: benchmarks/results/spec_speed_smollm2_{h200,cpu}.json")
    ap.add_argument("--trace", default=None, help="directory: a torch.profiler trace of one bs-1 generate per config "
                                                 "(kernel table + Chrome trace)")
    args = ap.parse_args()
    import torch

    from tercel import LLM, SamplingParams
    from tercel.engine import LLMEngine
    from tercel.speculative import DEFAULT_DFLASH_DRAFT, DEFAULT_EAGLE3_DRAFT, DEFAULT_EAGLE3_TOKEN_MAP
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    draft = args.draft or str(DEFAULT_EAGLE3_DRAFT)
    drafts = {"EAGLE3": draft, "DFLASH": args.dflash_draft or str(DEFAULT_DFLASH_DRAFT)}
    drafts["DDTREE"] = drafts["DFLASH"]
    root = Path(__file__).resolve().parent.parent
    rel = lambda p: str(Path(p).resolve().relative_to(root)) if Path(p).resolve().is_relative_to(root) else p  # noqa: E731
    out = args.out or str(Path(__file__).parent / "results" /
                          f"spec_speed_smollm2_{'h200' if args.device.startswith('cuda') else 'cpu'}.json")
    # fixed KV pools: each engine would otherwise take 85% of whatever memory the previous ones left
    kv = {"kv_cache_memory": 4 << 30} if args.device.startswith("cuda") else {}
    base = LLM(args.model, device=args.device, dtype=exact_dtype(args.device), progress=False, **kv)
    tok = base.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in EVAL_CHAT_PROMPTS + EVAL_CODE_PROMPTS]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    params_bytes = sum(p.numel() * p.element_size() for p in base.engine.model.parameters())
    bw = copy_bandwidth(args.device) if args.device.startswith("cuda") else None

    def write(rows: list[dict]) -> None:
        plain1 = next((r for r in rows if r["config"] == "plain" and r["batch_size"] == 1 and r["temperature"] == 0),
                      None)
        payload = {"benchmark": "decode tokens/s: plain (CUDA graphs on a GPU; plain-eager without) vs speculative "
                                "(speculative steps under CUDA graphs; *-eager rows without)",
                   "environment": env, "device": args.device, "dtype": str(base.engine.dtype),
                   "model": args.model or "SmolLM2-135M-Instruct (default)",
                   "drafts": {k: rel(v) for k, v in drafts.items()}, "token_map": args.token_map,
                   "new_tokens": args.new_tokens,
                   "prompts": "EVAL_CHAT_PROMPTS + EVAL_CODE_PROMPTS (chat template), ignore_eos; batch 1: each "
                              "prompt alone in turn, tok/s over all of them; batch N: the first N prompts (cycled) "
                              "at once; T=0 greedy, T>0 rows: top-p 0.95, seed 0",
                   "tokens_per_s_definition": "batch_size * new_tokens / wall time of generate() (prefill included)",
                   "weight_bytes": params_bytes, "copy_bandwidth_bytes_per_s": bw,
                   "plain_bs1_roofline_fraction": ((plain1["tokens_per_s"] * params_bytes / bw)
                                                   if bw and plain1 else None),
                   "results": rows}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=2) + "\n")

    env = environment()
    start = time.perf_counter()
    while time.perf_counter() - start < args.warmup_seconds:
        base.generate(prompts[:16], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    rows = []
    wanted = args.configs.split(",")
    for name, algo, topk, n, extra in (c for c in CONFIGS if c[0] in wanted):
        if extra.get("disable_cuda_graph") and not args.device.startswith("cuda"):
            continue  # on the CPU plain is eager already
        llm = None
        gc.collect()  # the previous config's engine, KV pool and graphs go before the next one takes memory
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        llm = LLM.__new__(LLM)
        extra = dict(extra)
        switches = extra.pop("env", {})  # read while the engine builds (e.g. which graphs it captures)
        token_map = str(DEFAULT_EAGLE3_TOKEN_MAP) if extra.pop("token_map", False) else args.token_map
        saved = {k: os.environ.get(k) for k in switches}
        os.environ.update(switches)
        llm.engine = LLMEngine(loaded=base.engine.loaded, device=args.device, dtype=base.engine.dtype,
                               speculative_algorithm=algo, speculative_draft_model_path=drafts.get(algo),
                               speculative_eagle_topk=topk, speculative_num_draft_tokens=n,
                               speculative_token_map=token_map if algo == "EAGLE3" else None, **kv, **extra)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        llm.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
        points = [(int(b), 0.0) for b in args.batch_sizes.split(",")]
        if args.sampling_configs is None or name in args.sampling_configs.split(","):
            points += [(1, float(t)) for t in args.sampling_temperatures.split(",") if t and float(t) > 0]
        for bs, temp in points:
            params = (SamplingParams(max_tokens=args.new_tokens, temperature=temp, top_p=0.95, ignore_eos=True, seed=0)
                      if temp > 0 else greedy)
            batch = [prompts[i % len(prompts)] for i in range(bs)]
            # batch 1: every held-out prompt in turn (one request at a time); larger: one batch of bs requests
            groups = [[p] for p in prompts] if bs == 1 else [batch]
            times, mal = [], None
            for _ in range(args.repeats):
                sync()
                t = time.perf_counter()
                outs = [o for g in groups for o in llm.generate(g, params)]
                sync()
                times.append(time.perf_counter() - t)
                steps = sum(o.metrics.spec_verify_steps for o in outs)
                mal = (sum(o.metrics.spec_accepted_tokens for o in outs) + steps) / steps if steps else None
            wall = statistics.median(times)
            tps = len(groups) * bs * args.new_tokens / wall
            spec = llm.engine.spec
            runners = {} if spec is None else {"verify": spec.verify_runner,
                                               "draft": getattr(spec.drafter, "loop_runner", None),
                                               "draft_extend": getattr(spec.drafter, "extend_runner", None),
                                               "chain": spec.chain.runner if spec.chain else None}
            graphs = {k: {"replays": r.stats.replays, "eager": r.stats.eager, "why": dict(r.stats.fallbacks)}
                      for k, r in runners.items() if r is not None}
            breakdown = None
            if spec is not None and bs == 1 and temp == 0:  # a separate pass: profiling adds a sync per step
                spec.profile.enabled = True
                llm.generate(batch, params)
                spec.profile.enabled = False
                breakdown = spec.profile.summary()
                spec.profile = type(spec.profile)(spec.profile.device)
            if args.trace and bs == 1 and temp == 0:
                trace(llm, batch, params, Path(args.trace) / name)
            rows.append({"config": name, "batch_size": bs, "temperature": temp, "tokens_per_s": round(tps, 1),
                         "wall_s": round(wall, 3), "mean_accept_length": round(mal, 3) if mal else None,
                         "graphs": graphs, "step_breakdown_us": breakdown})
            print(f"{name:22s} bs={bs:3d} T={temp:g}: {tps:8.1f} tok/s  accept length {mal or 1:.2f}  "
                  f"{breakdown['gpu_us'] if breakdown else ''}", flush=True)
            write(rows)  # after every point: a run cut by a time limit keeps what it measured
    write(rows)
    print("wrote", out)


if __name__ == "__main__":
    main()
