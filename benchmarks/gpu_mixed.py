"""Steady arrivals on the GPU: SmolLM2-135M-Instruct bf16 with CUDA graphs, many more requests than
max_num_seqs and mixed output lengths, so new prompts join nearly every step. Default engine (a mixed
step runs its decodes by graph replay and its prefill chunks beside them) against
enable_mixed_chunk=True (one eager forward per mixed step), same requests, one run.
Writes benchmarks/results/gpu_mixed_steps_smollm2.json.
Usage: PYTHONPATH=. python benchmarks/gpu_mixed.py --smol GGUF [--requests 2048] [--max-num-seqs 256]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from common import environment, write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smol", default=os.environ.get("TERCEL_SMOL_GGUF"))
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()
    from tercel import LLM, SamplingParams
    from tercel.engine import LLMEngine

    rng = random.Random(0)
    base = LLM(args.smol, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=args.max_num_seqs,
               cuda_graph_max_bs=args.max_num_seqs, progress=False)
    tok = base.tokenizer
    topics = ["the ocean", "prime numbers", "autumn", "hash tables", "cooking", "the sky", "bicycles", "Paris"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % 8]} ({i})."}])
               for i in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randint(16, 256), temperature=0.0, ignore_eos=True)
              for _ in range(args.requests)]
    rows = []
    for mixed in (False, True):
        llm = base if not mixed else LLM.__new__(LLM)
        if mixed:
            llm.engine = LLMEngine(loaded=base.engine.loaded, dtype="bfloat16", device="cuda", max_model_len=1024,
                                   max_num_seqs=args.max_num_seqs, cuda_graph_max_bs=args.max_num_seqs,
                                   progress=False, enable_mixed_chunk=True)
        llm.generate(prompts[:64], params[:64], use_tqdm=False)  # warm-up
        stats = llm.engine.graph_runner.stats
        r0, e0 = stats.replays, stats.eager
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"enable_mixed_chunk": mixed, "requests": args.requests, "generated_tokens": n, "seconds": round(dt, 3),
               "tok_s": round(n / dt, 1), "graph_replays": stats.replays - r0, "eager_forwards": stats.eager - e0}
        print(row, flush=True)
        rows.append(row)
    write_result("gpu_mixed_steps_smollm2", {
        "benchmark": "gpu_mixed_steps_smollm2", "env": environment(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)",
        "setup": f"{args.requests} greedy requests, max_tokens uniform in 16..256, max_num_seqs {args.max_num_seqs}, "
                 "all submitted at once (they join as others finish); tok/s counts generated tokens",
        "speedup_split_over_mixed": round(rows[0]["tok_s"] / rows[1]["tok_s"], 3), "rows": rows})


if __name__ == "__main__":
    main()
