"""Plain decode speed on this CPU: Tercel vs HF transformers generate, same prompts, same run.

Tercel runs three ways: fp32 (the exact reference), bf16 with the GGUF's Q4_1 matrices kept 4-bit
(the bf16 CPU default) and bf16 with them dequantized (--dequantize-gguf). HF runs fp32 and bf16
(it always dequantizes a GGUF). Checks correctness first: fp32 greedy tokens equal HF's; for bf16,
the greedy tokens' common prefix with HF fp32 is recorded for Tercel and for HF's own bf16 run, so
the bf16 rows are seen to deviate from fp32 no more than HF bf16 does. Then times every side
(interleaved repeats, medians) and prints a table; writes benchmarks/results/cpu_decode_smollm2.json.
Usage: PYTHONPATH=. python benchmarks/cpu_decode.py [--new-tokens 96] [--repeats 3]
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
TERCEL = {"fp32": dict(dtype="float32"), "bf16-4bit": dict(dtype="bfloat16"),
          "bf16-dense": dict(dtype="bfloat16", dequantize_gguf=True)}
HF = {"fp32": torch.float32, "bf16": torch.bfloat16}
HF_SAME_DTYPE = {"fp32": "fp32", "bf16-4bit": "bf16", "bf16-dense": "bf16"}  # Tercel side -> HF side


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight one decode step reads: every parameter once (the tied embedding as the head),
    a prepacked linear at its packed size instead of its dense one (4-bit ones keep no dense copy)."""
    from tercel.models.cpu_linear import CpuPackedLinear

    size = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(getattr(m, "gemv", None), CpuPackedLinear):
            size += m.gemv.nbytes - m.weight.numel() * m.weight.element_size()
    return size


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.new_tokens

    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tercel import LLM, SamplingParams

    transformers.logging.set_verbosity_error()
    ours = {name: LLM(device="cpu", progress=False, **kw) for name, kw in TERCEL.items()}
    path = str(ours["fp32"].engine.loaded.path)
    hf = {name: AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=dt).eval() for name, dt in HF.items()}
    tok = ours["fp32"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    gen_cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

    def hf_generate(model, batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])  # left padding
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=gen_cfg)
        return out[:, width:].tolist()

    # correctness: fp32 greedy tokens equal HF's up to the first EOS (HF's min_new_tokens suppresses EOS)
    eos = set(ours["fp32"].engine.eos_token_ids)
    ref = [hf_generate(hf["fp32"], [p])[0] for p in prompts]
    got = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params)] for name, llm in ours.items()}
    for mine, want in zip(got["fp32"], ref):
        cut = next((i for i, t in enumerate(mine) if t in eos), n)
        assert mine[:cut] == want[:cut], "fp32 greedy outputs differ between Tercel and HF"
    hf_bf16 = [hf_generate(hf["bf16"], [p])[0] for p in prompts]
    agreement = {f"tercel {k}": [common_prefix(a, b) for a, b in zip(v, ref)] for k, v in got.items()}
    agreement["hf bf16"] = [common_prefix(a, b) for a, b in zip(hf_bf16, ref)]

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    sides = {f"tercel {k}": (lambda b, llm=llm: llm.generate(b, params)) for k, llm in ours.items()}
    sides.update({f"hf {k}": (lambda b, m=m: hf_generate(m, b)) for k, m in hf.items()})
    load_before = os.getloadavg()[0]  # other processes on these cores skew every side: record it
    bw = copy_bandwidth("cpu")
    weight_bytes = {k: step_weight_bytes(llm.engine.model) for k, llm in ours.items()}
    rows = []
    for bs in (1, len(prompts)):
        batch = prompts[:bs]
        for fn in sides.values():
            fn(batch)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.repeats):  # interleaved, so a burst of load from elsewhere hits every side alike
            for k, fn in sides.items():
                times[k].append(timed(lambda: fn(batch)))
        tps = {k: bs * n / statistics.median(v) for k, v in times.items()}
        hf_best = max(tps["hf fp32"], tps["hf bf16"])
        row = {"batch_size": bs, "new_tokens": n, "tok_s": {k: round(v, 2) for k, v in tps.items()},
               "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()}, "tercel": {}}
        for k in ours:
            step = bs * n / tps[f"tercel {k}"] / n
            roof = weight_bytes[k] / bw
            row["tercel"][k] = {"speedup_vs_hf_fastest": round(tps[f"tercel {k}"] / hf_best, 3),
                                "speedup_vs_hf_same_dtype": round(tps[f"tercel {k}"]
                                                                  / tps[f"hf {HF_SAME_DTYPE[k]}"], 3),
                                "step_ms": round(step * 1000, 2), "roofline_step_ms": round(roof * 1000, 2),
                                "roofline_fraction": round(roof / step, 3)}
        rows.append(row)
    result = {"benchmark": "cpu_decode_smollm2",
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF; token_embd Q8_0)",
              "tercel_configs": {"fp32": "dequantized to fp32 (the exact reference)",
                                 "bf16-4bit": "bf16, Q4_1 matrices kept 4-bit (int4 CPU matmul, bf16 scales), "
                                              "head dense bf16 (oneDNN prepacked); the bf16 CPU default",
                                 "bf16-dense": "bf16, every matrix dequantized (oneDNN prepacked), --dequantize-gguf"},
              "peer": f"transformers {transformers.__version__} generate (eager, DynamicCache), fp32 and bf16",
              "greedy_common_prefix_with_hf_fp32": agreement,
              "step_weight_bytes": weight_bytes, "copy_bandwidth_GBps": round(bw / 1e9, 2),
              "env": environment(),
              "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
              "rows": rows}
    path = write_result("cpu_decode_smollm2", result)
    print("greedy common prefix with HF fp32 (of", n, "tokens):", agreement)
    print(f"{'bs':>3} {'side':>18} {'tok/s':>8} {'vs HF fastest':>14} {'vs HF same dtype':>17} {'roofline':>9}")
    for r in rows:
        for k, v in r["tok_s"].items():
            t = r["tercel"].get(k.removeprefix("tercel "), {}) if k.startswith("tercel") else {}
            print(f"{r['batch_size']:>3} {k:>18} {v:>8} {t.get('speedup_vs_hf_fastest', ''):>14} "
                  f"{t.get('speedup_vs_hf_same_dtype', ''):>17} {t.get('roofline_fraction', ''):>9}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
