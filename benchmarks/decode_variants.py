"""Batch-1 decode variants side by side in one process (one model load, one GEMV tuning): the fused
decode (norms / SwiGLU / residual adds in the GEMVs, RoPE + K/V store in the attention kernel, the
o_proj weight optionally prefetched into L2 during attention, PDL, split counts) against its parts
switched one at a time and against the unfused kernels; multi-step windows of several sizes.

Per variant: the bucket-1 graph's GPU time per step, a per-kernel profile of that graph (torch.profiler,
CUDA time per step by kernel name), and bs=1 decode tok/s for each num_scheduler_steps (greedy, 256
tokens, tokens checked equal to the first variant's). Roofline = measured copy bandwidth / weight bytes.

Usage: PYTHONPATH=. python benchmarks/decode_variants.py --models llama8b [--smol PATH] --out FILE.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402
from gpu_decode import generate, gpu_copy_bandwidth, graph_step_ms, llama8b_loaded, weight_bytes  # noqa: E402


def _switches(fused: str, attn: str, prefetch: str, pdl: str = "late", splits: str = "16") -> dict[str, str]:
    return {"TERCEL_FUSED_DECODE": fused, "TERCEL_DECODE_ATTN": attn, "TERCEL_L2_PREFETCH": prefetch, "TERCEL_PDL": pdl,
            "TERCEL_DECODE_MAX_SPLITS": splits}


VARIANTS = {  # name -> environment switches (tercel/kernels/__init__.py); the first is the default
    "fused": _switches("1", "rope", "0"),
    "fused_attn_one": _switches("1", "one", "0"),
    "fused_attn_split": _switches("1", "split", "0"),
    "fused_prefetch": _switches("1", "rope", "1"),
    "fused_pdl_early": _switches("1", "rope", "0", "early"),
    "fused_no_pdl": _switches("1", "rope", "0", "0"),
    "fused_pdl_norm": _switches("1", "rope", "0", "late_norm"),
    "fused_splits4": _switches("1", "rope", "0", splits="4"),
    "fused_splits1": _switches("1", "rope", "0", splits="1"),
    "unfused": _switches("0", "split", "0"),
}


def kernel_profile(runner, reps: int = 20) -> list[dict]:
    """CUDA time per step of each kernel name in the bucket-1 graph (us), largest first."""
    from torch.profiler import ProfilerActivity, profile

    g = runner.graphs[1].graph
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time
            cnt[e.name] += 1
    rows = [{"kernel": k[:90], "us_per_step": round(v / reps, 2), "launches_per_step": cnt[k] // reps}
            for k, v in tot.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def bs1_rate(engine, prompt, n_new: int, steps: int, repeats: int) -> tuple[dict, list[int]]:
    engine.num_scheduler_steps = steps
    toks = generate(engine, prompt, n_new)[0].outputs[0].token_ids  # warm-up, and the tokens
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = generate(engine, prompt, n_new)[0]
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t, out.metrics.decode_tokens_per_s))
    engine.num_scheduler_steps = 1
    return {"tok_s": round(n_new / statistics.median(r[0] for r in runs), 1),
            "decode_tok_s": round(statistics.median(r[1] for r in runs), 1)}, toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama8b")
    ap.add_argument("--smol", default=os.environ.get("TERCEL_SMOL_GGUF"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", default="1,8,32", help="num_scheduler_steps values")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tercel.engine import LLMEngine

    env = environment()
    env["commit"] = os.environ.get("TERCEL_COMMIT", env["commit"])
    env["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    env["triton"] = __import__("triton").__version__
    env["switches"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TERCEL_") and "DIR" not in k}
    bw = gpu_copy_bandwidth()
    result = {"benchmark": "decode_variants", "env": env, "copy_bandwidth_TBps": round(bw / 1e12, 3),
              "variants": VARIANTS, "models": {}}
    common = dict(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=8, progress=False,
                  cuda_graph_bs=[1], skip_tokenizer_init=True)
    for name in args.models.split(","):
        if name == "llama8b":
            loaded = llama8b_loaded(2048)
            prompt = [torch.randint(1000, 100000, (32,), generator=torch.Generator().manual_seed(1)).tolist()]
            label = "Llama-3.1-8B shape, random weights (seeded normal std 0.02)"
        else:
            from tercel.loader.model_loader import load_model

            loaded = load_model(args.smol, torch.bfloat16, torch.device("cuda"), max_model_len=2048,
                                load_tokenizer_too=False, progress=False)
            prompt = [list(range(1000, 1032))]
            label = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)"
        wb = weight_bytes(loaded.model)
        res = {"model": label, "weight_bytes": wb, "roofline_tok_s": round(bw / wb, 1), "variants": {}}
        first_tokens = None
        for vname in args.variants.split(","):
            os.environ.update(VARIANTS[vname])
            t0 = time.perf_counter()
            engine = LLMEngine(loaded=loaded, kv_cache_memory=4 << 30, **common)
            row: dict = {"init_s": round(time.perf_counter() - t0, 1)}
            row["graph_step_gpu_ms"] = round(graph_step_ms(engine.graph_runner, 1), 4)
            row["graph_only_roofline_fraction"] = round(1e3 / row["graph_step_gpu_ms"] / res["roofline_tok_s"], 3)
            for s in [int(x) for x in args.steps.split(",")]:
                rate, toks = bs1_rate(engine, prompt, args.new_tokens, s, args.repeats)
                rate["roofline_fraction"] = round(rate["decode_tok_s"] / res["roofline_tok_s"], 3)
                if first_tokens is None:
                    first_tokens = toks
                rate["tokens_equal_first_variant"] = toks == first_tokens
                rate["common_prefix"] = next((i for i, (a, b) in enumerate(zip(toks, first_tokens)) if a != b),
                                             len(toks))
                row[f"steps_{s}"] = rate
            try:
                row["kernels"] = kernel_profile(engine.graph_runner)
            except Exception as e:  # keep the timings
                row["kernels"], row["profile_error"] = [], repr(e)
            row["kernel_launches_per_step"] = sum(k["launches_per_step"] for k in row["kernels"])
            if "gemv_choices" not in res:
                res["gemv_choices"] = [dict(shape=c.shape, role=c.role, unfused_us=c.cublas_us, gemv_us=c.gemv_us,
                                            config=str(c.config)) for c in engine.gemv_choices or []]
            res["variants"][vname] = row
            print(f"[{name}] {vname}: graph {row['graph_step_gpu_ms']} ms "
                  f"({row['graph_only_roofline_fraction']}), launches {row['kernel_launches_per_step']}, "
                  + ", ".join(f"N={k[6:]} {v['decode_tok_s']} tok/s ({v['roofline_fraction']}, "
                              f"same={v['tokens_equal_first_variant']})"
                              for k, v in row.items() if k.startswith("steps_")), flush=True)
            for k in row["kernels"][:12]:
                print(f"    {k['us_per_step']:>9.1f} us x{k['launches_per_step']:<4} {k['kernel']}", flush=True)
            del engine
            torch.cuda.empty_cache()
        result["models"][name] = res
        del loaded
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
