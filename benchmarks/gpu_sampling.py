"""Sampled vs greedy decode speed on the GPU: SmolLM2-135M-Instruct bf16 with CUDA graphs, seeded
T=0.8 / top-p 0.95 requests against greedy ones, same prompts, same batch sizes, one run. Sampling
draws its noise on the device from a counter-based hash of (seed, draw count), batched over requests;
this shows what that costs per token. Writes benchmarks/results/gpu_sampling_smollm2.json.
Usage: PYTHONPATH=. python benchmarks/gpu_sampling.py --smol GGUF [--batches 1,32,256] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from common import environment, write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smol", default=os.environ.get("TERCEL_SMOL_GGUF"))
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    from tercel import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.smol, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=max(batches),
              cuda_graph_max_bs=max(batches), progress=False)
    tok = llm.tokenizer
    rows = []
    for bs in batches:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me a story about the number {i}."}])
                   for i in range(bs)]
        row = {"batch_size": bs, "new_tokens": args.new_tokens}
        for name, kw in [("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, top_p=0.95))]:
            params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=i, **kw) for i in range(bs)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row[f"{name}_tok_s"] = round(bs * args.new_tokens / min(times), 1)
            row[f"{name}_times_s"] = [round(x, 4) for x in times]
        row["sampled_over_greedy"] = round(row["sampled_tok_s"] / row["greedy_tok_s"], 3)
        print(row, flush=True)
        rows.append(row)
    write_result("gpu_sampling_smollm2", {
        "benchmark": "gpu_sampling_smollm2", "env": environment(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)",
        "note": "tok/s includes prefill and detokenization; sampled: T=0.8, top-p 0.95, per-request seeds",
        "rows": rows})


if __name__ == "__main__":
    main()
