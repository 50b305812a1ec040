"""Plain decode speed on this CPU: Tercel vs HF transformers generate, same prompts, same run.

Checks correctness first (greedy tokens equal), then times each side (median of --repeats) and
prints a table; writes benchmarks/results/cpu_decode_smollm2.json.
Usage: PYTHONPATH=. python benchmarks/cpu_decode.py [--new-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import copy_bandwidth, environment, write_result

PROMPTS = ["Tell me about the ocean.", "Write a Python function that checks if a number is prime.",
           "What are three good habits for staying healthy?", "Explain how a bicycle works."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.new_tokens

    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tercel import LLM, SamplingParams

    transformers.logging.set_verbosity_error()
    llm = LLM(dtype="float32", device="cpu", progress=False)
    path = str(llm.engine.loaded.path)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    gen_cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

    # correctness: the same greedy tokens up to the first EOS (HF's min_new_tokens suppresses EOS)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompts[0]]), generation_config=gen_cfg)[0, len(prompts[0]):].tolist()
    eos = set(llm.engine.eos_token_ids)
    cut = next((i for i, t in enumerate(ours[0]) if t in eos), n)
    assert ours[0][:cut] == ref[:cut], "greedy outputs differ between Tercel and HF"

    def time_ours(batch: list[list[int]]) -> float:
        t = time.perf_counter()
        llm.generate(batch, params)
        return time.perf_counter() - t

    def time_hf(batch: list[list[int]]) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])  # left padding
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, generation_config=gen_cfg)
        return time.perf_counter() - t

    load_before = os.getloadavg()[0]  # other processes on these 2 cores skew both sides: record it
    params_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    bw = copy_bandwidth("cpu")
    rows = []
    for bs in (1, len(prompts)):
        batch = prompts[:bs]
        time_ours(batch), time_hf(batch)  # warm-up
        ours_t, hf_t = [], []
        for _ in range(args.repeats):  # interleaved, so a burst of load from elsewhere hits both sides alike
            ours_t.append(time_ours(batch))
            hf_t.append(time_hf(batch))
        o, h = statistics.median(ours_t), statistics.median(hf_t)
        ours_tps, hf_tps = bs * n / o, bs * n / h
        # roofline: each decode step reads every weight once
        roof = params_bytes / bw
        rows.append({"batch_size": bs, "new_tokens": n, "tercel_tok_s": round(ours_tps, 2),
                     "hf_tok_s": round(hf_tps, 2), "speedup": round(ours_tps / hf_tps, 3),
                     "tercel_step_ms": round(o / n * 1000, 2), "roofline_step_ms": round(roof * 1000, 2),
                     "tercel_roofline_fraction": round(roof / (o / n), 3),
                     "tercel_times_s": [round(x, 3) for x in ours_t], "hf_times_s": [round(x, 3) for x in hf_t]})
    result = {"benchmark": "cpu_decode_smollm2", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
              "dtype": "float32", "peer": f"transformers {transformers.__version__} generate (eager, DynamicCache)",
              "weight_bytes": params_bytes, "copy_bandwidth_GBps": round(bw / 1e9, 2),
              "env": environment(), "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
              "rows": rows}
    path = write_result("cpu_decode_smollm2", result)
    print(f"{'bs':>3} {'tercel tok/s':>13} {'HF tok/s':>9} {'speedup':>8} {'roofline':>9}")
    for r in rows:
        print(f"{r['batch_size']:>3} {r['tercel_tok_s']:>13} {r['hf_tok_s']:>9} {r['speedup']:>8} "
              f"{r['tercel_roofline_fraction']:>9}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
