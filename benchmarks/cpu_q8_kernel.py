"""The Q4 x Q8 CPU kernel (tercel.models.cpu_q8) against torch's int4 kernel (PackedInt4), in one process.

(a) one linear call per variant on SmolLM2-135M's shapes (random Q4_1 blocks, a bf16 row): microseconds,
    the median over --calls calls, in --rounds interleaved rounds; the figure is the median of the per-round
    ratios (load from elsewhere drifts; interleaving hits both alike).
(b) end to end: LLM(gguf) (dtype "auto": bf16, Q4 matrices kept 4-bit) built twice, TERCEL_CPU_Q8=0 and =1,
    greedy, batch 1, --new-tokens tokens with EOS ignored, --threads threads; tok/s = new tokens / generate's
    wall time (prefill included), the two engines alternating for --rounds rounds after a warm-up. The greedy
    tokens of both are recorded with their common prefix (Q8 activations may flip a near tie).
Pin it to cores for a stable figure: taskset -c 1 python benchmarks/cpu_q8_kernel.py --threads 1
Writes benchmarks/results/cpu_q8_kernel_smollm2.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from common import environment, write_result

from tercel.models.cpu_linear import PackedInt4, Q4Blocks, cpu_flags
from tercel.models.cpu_q8 import PackedQ4Q8, kernel_error

SHAPES = [(1536, 576), (576, 1536), (960, 576), (3072, 576)]  # [N, K]: gate/up half, down, qkv, gate_up
PROMPT = "Write a Python function that checks if a number is prime."


@dataclass(frozen=True, slots=True)
class KernelRow:
    n: int
    k: int
    rows: int
    int4_us: float
    q8_us: float
    speedup: float  # median of per-round int4 / q8


def q4_1_blocks(n: int, k: int, seed: int = 0) -> Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).half().float()
    return Q4Blocks(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, m)


def time_call(f: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def kernel_rows(rounds: int, calls: int, rows: int) -> list[KernelRow]:
    out = []
    for n, k in SHAPES:
        b = q4_1_blocks(n, k)
        old, new = PackedInt4(b), PackedQ4Q8(b)
        x = torch.randn(rows, k).to(torch.bfloat16)
        per: dict[str, list[float]] = {"int4": [], "q8": []}
        for _ in range(rounds):
            per["int4"].append(time_call(lambda: old(x), calls))
            per["q8"].append(time_call(lambda: new(x), calls))
        ratios = [a / b for a, b in zip(per["int4"], per["q8"])]
        out.append(KernelRow(n, k, rows, round(statistics.median(per["int4"]), 1),
                             round(statistics.median(per["q8"]), 1), round(statistics.median(ratios), 3)))
        print(out[-1], flush=True)
    return out


def end_to_end(rounds: int, new_tokens: int, threads: int) -> dict:
    from tercel import LLM, SamplingParams

    llms = {}
    for name, switch in (("int4", "0"), ("q8", "1")):
        os.environ["TERCEL_CPU_Q8"] = switch  # read when the model's linears are packed
        llms[name] = LLM(device="cpu", threads=threads, progress=False, max_num_seqs=1)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    kinds = {name: sorted({type(m.gemv).__name__ for m in llm.engine.model.modules()
                           if getattr(m, "gemv", None) is not None}) for name, llm in llms.items()}
    tokens = {name: llm.generate(PROMPT, params)[0].outputs[0].token_ids for name, llm in llms.items()}  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            got = llm.generate(PROMPT, params)[0].outputs[0].token_ids
            rates[name].append(len(got) / (time.perf_counter() - t))
    ratios = [b / a for a, b in zip(rates["int4"], rates["q8"])]
    # the tied head (Q8_0 in the GGUF, dense bf16 here): what a Q8 head kernel could still take off a token
    head, x = llms["q8"].engine.model.lm_head_config, torch.randn(1, 576).to(torch.bfloat16)
    head_us = time_call(lambda: head(x), 50)
    prefix = next((i for i, (a, b) in enumerate(zip(tokens["int4"], tokens["q8"])) if a != b), len(tokens["q8"]))
    return {"prompt": PROMPT, "new_tokens": new_tokens, "rounds": rounds, "linear_kinds": kinds,
            "tok_s": {name: [round(r, 2) for r in v] for name, v in rates.items()},
            "tok_s_median": {name: round(statistics.median(v), 2) for name, v in rates.items()},
            "speedup_median_of_round_ratios": round(statistics.median(ratios), 3),
            "greedy_common_prefix": prefix, "greedy_tokens": tokens,
            "head": {"kind": type(head).__name__, "us_per_call": round(head_us, 1)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="cpu_q8_kernel_smollm2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernel_error() is not None:
        raise SystemExit(f"the Q4 x Q8 kernel is unavailable: {kernel_error()}")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c")))
    payload = {"env": environment(), "cpu_flags": flags, "cpu_affinity": sorted(os.sched_getaffinity(0)),
               "load_average_before": os.getloadavg()[0],
               "kernel": [asdict(r) for rows in (1, 4, 32) for r in kernel_rows(args.rounds, args.calls, rows)]}
    payload["end_to_end"] = end_to_end(args.rounds, args.new_tokens, args.threads)
    payload["load_average_after"] = os.getloadavg()[0]
    try:
        import llama_cpp  # noqa: F401
        payload["llama_cpp"] = "installed: run benchmarks/cpu_vs_llamacpp.py --threads 1 for its figure"
    except ImportError:
        payload["llama_cpp"] = "llama-cpp-python is not installed here (a source build): not measured in this run"
    print({k: payload["end_to_end"][k] for k in ("tok_s_median", "speedup_median_of_round_ratios",
                                                 "greedy_common_prefix")})
    print(write_result(args.out, payload))


if __name__ == "__main__":
    main()
