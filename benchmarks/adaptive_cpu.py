"""Adaptive speculation on the CPU: plain decoding vs adaptive EAGLE3 (the bundled head and token map, what
`tercel generate` runs) vs adaptive NGRAM on SmolLM2 at batch 1 (fp32, or --dtype auto: the CPU default), chat
and code prompts, greedy, fixed-length outputs; the fixed-width configs (--speculative-adaptive off) for
reference. Configs run in turns (round-robin); each config's ratio to plain is taken within a round (runs
seconds apart) and the median over rounds is reported, so load that drifts on a shared CPU cancels out.

Usage: PYTHONPATH=. python benchmarks/adaptive_cpu.py [--new-tokens 64] [--prompts 2] [--rounds 2]
       [--dtype float32|auto] [--out benchmarks/results/adaptive_cpu_smollm2.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

CONFIGS = {  # name: engine keywords
    "plain": {},
    "eagle3-adaptive": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True),
    "ngram-adaptive": dict(speculative_algorithm="NGRAM", speculative_adaptive=True),
    "eagle3-fixed": dict(speculative_algorithm="EAGLE3", speculative_adaptive=False),
    "ngram-fixed": dict(speculative_algorithm="NGRAM", speculative_adaptive=False),
    # narrow fixed EAGLE-3 chains: where a verify row costs about half a plain step (the fused CPU layers)
    **{f"eagle3-fixed-{n}": dict(speculative_algorithm="EAGLE3", speculative_adaptive=False, speculative_eagle_topk=1,
                                 speculative_num_steps=n - 1, speculative_num_draft_tokens=n) for n in (2, 3, 4)},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per kind (chat, code)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dtype", default="float32", help="float32, or auto (the CPU default: bf16 with the GGUF's "
                                                       "4-bit matrices kept, where this CPU runs that faster)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "adaptive_cpu_smollm2.json"))
    args = ap.parse_args()
    from tercel import LLM, SamplingParams
    from tercel.engine import LLMEngine
    from tercel.speculative import DEFAULT_EAGLE3_DRAFT, DEFAULT_EAGLE3_TOKEN_MAP
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    base = LLM(None, device="cpu", dtype=args.dtype, progress=False, max_num_seqs=1)
    dtype = base.engine.dtype
    tok = base.tokenizer
    kinds = {k: [tok.apply_chat_template([{"role": "user", "content": p}]) for p in ps[:args.prompts]]
             for k, ps in (("chat", EVAL_CHAT_PROMPTS), ("code", EVAL_CODE_PROMPTS))}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    names = args.configs.split(",")
    engines, warmup_s = {}, {}
    for name in names:
        kw = dict(CONFIGS[name])
        if kw.get("speculative_algorithm") == "EAGLE3":
            kw.update(speculative_draft_model_path=str(DEFAULT_EAGLE3_DRAFT),
                      speculative_token_map=str(DEFAULT_EAGLE3_TOKEN_MAP))
        llm = LLM.__new__(LLM)
        llm.engine = LLMEngine(loaded=base.engine.loaded, device="cpu", dtype=dtype, max_num_seqs=1, **kw)
        t = time.perf_counter()  # first steps: the adaptive cost model measures its forwards here
        llm.generate(kinds["chat"][:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        warmup_s[name] = round(time.perf_counter() - t, 3)
        engines[name] = llm
    walls: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list] = {}
    for _ in range(args.rounds):
        for kind, prompts in kinds.items():
            for name in names:
                t = time.perf_counter()
                outs = [engines[name].generate([p], params)[0] for p in prompts]  # batch 1: one at a time
                wall = time.perf_counter() - t
                walls.setdefault((name, kind), []).append(wall)
                outputs[name, kind] = [o.outputs[0].token_ids for o in outs]
    rows = []
    for kind in kinds:
        tokens = len(kinds[kind]) * args.new_tokens
        for name in names:
            tps = tokens / statistics.median(walls[name, kind])
            ratio = statistics.median(p / w for p, w in zip(walls["plain", kind], walls[name, kind]))
            rows.append({"config": name, "prompts": kind, "tokens_per_s": round(tps, 2), "vs_plain": round(ratio, 3),
                         "vs_plain_by_round": [round(p / w, 3) for p, w in zip(walls["plain", kind],
                                                                                walls[name, kind])],
                         "same_tokens_as_plain": outputs[name, kind] == outputs["plain", kind]})
            print(f"{kind:5s} {name:16s} {tps:7.2f} tok/s  {ratio:.3f}x plain", flush=True)
    stats = {}
    for name in names:
        spec = engines[name].engine.spec
        if spec is not None:
            s = spec.stats
            stats[name] = {"width_histogram_all_runs": {str(k): v for k, v in sorted(s.width_histogram.items())},
                           "mean_accept_length": s.mean_accept_length}
            if spec.adaptive is not None:
                c = spec.adaptive.costs
                stats[name]["forward_ms"] = {f"bs{b}-w{w}": round(v * 1e3, 2) for (b, w), v in c.forward_s.items()}
                stats[name]["overhead_ms"] = {f"bs{b}-{'spec' if k else 'plain'}": round(v * 1e3, 2)
                                              for (b, k), v in c.overhead_s.items()}
    env = environment()
    payload = {"benchmark": "decode tokens/s at batch 1: plain vs adaptive speculation (and fixed-width for reference)",
               "environment": env, "load_average_at_end": os.getloadavg(),
               "dtype": str(dtype).removeprefix("torch."), "dtype_flag": args.dtype,
               "dtype_note": base.engine.dtype_note,
               "model": "SmolLM2-135M-Instruct (default)", "new_tokens": args.new_tokens,
               "prompts": f"EVAL_CHAT_PROMPTS[:{args.prompts}] and EVAL_CODE_PROMPTS[:{args.prompts}] (chat template), "
                          f"greedy, ignore_eos, one request at a time (max_num_seqs=1)",
               "tokens_per_s_definition": "prompts * new_tokens / wall time of the generate() calls (prefill "
                                          "included), median over rounds; vs_plain: the median of the "
                                          "rounds' ratios (plain and the config run seconds apart)",
               "rounds": args.rounds, "first_generate_s (warm-up, includes the cost-model measurement)": warmup_s,
               "results": rows, "spec_stats": stats}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
