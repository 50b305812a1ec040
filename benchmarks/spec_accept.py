"""Mean accept length of a speculative draft on held-out prompts (never used in training):
chat and code prompts, chain and tree, T=0 and T=1; n-gram for reference.

Usage: PYTHONPATH=. python benchmarks/spec_accept.py [--model GGUF_OR_DIR] [--draft DIR] [--device cpu|cuda]
       [--max-tokens 128] [--out benchmarks/results/spec_accept_smollm2.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, exact_dtype  # noqa: E402

KV_BYTES = 1 << 30
CONFIGS = [  # (name, algorithm, num_steps, topk, num_draft_tokens)
    ("eagle3-chain-5", "EAGLE3", 5, 1, None),
    ("eagle3-tree-topk4-16", "EAGLE3", 5, 4, 16),
    ("ngram-6", "NGRAM", 5, 1, 6),
]
WIDE_TREES = [  # larger EAGLE-2 trees, as SGLang runs them at low batch (--configs wide)
    ("eagle3-tree-topk8-32", "EAGLE3", 5, 8, 32),
    ("eagle3-tree-topk8-64", "EAGLE3", 6, 8, 64),
]


def run(model, draft, device, max_tokens, temps, configs, token_map=None, adaptive: str = "on") -> dict:
    from tercel import LLM, SamplingParams
    from tercel.engine import LLMEngine
    from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS

    # a fixed KV pool per engine: several engines share the device (the default takes most of free GPU memory)
    base = LLM(model, device=device, dtype=exact_dtype(device), progress=False, kv_cache_memory=KV_BYTES)
    tok = base.tokenizer
    sets = {"chat": EVAL_CHAT_PROMPTS, "code": EVAL_CODE_PROMPTS}
    results = {}
    for name, algo, steps, topk, n in configs:
        llm = LLM.__new__(LLM)
        llm.engine = LLMEngine(loaded=base.engine.loaded, device=device, dtype=base.engine.dtype,
                               kv_cache_memory=KV_BYTES, speculative_algorithm=algo,
                               speculative_draft_model_path=draft if algo != "NGRAM" else None,
                               speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=n,
                               speculative_token_map=token_map if algo != "NGRAM" else None,
                               speculative_adaptive=adaptive)
        for temp in temps:
            row = {}
            for set_name, prompts in sets.items():
                ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
                params = [SamplingParams(max_tokens=max_tokens, temperature=temp, seed=i) for i in range(len(ids))]
                t = time.perf_counter()
                outs = llm.generate(ids, params)
                steps_ = sum(o.metrics.spec_verify_steps for o in outs)
                acc = sum(o.metrics.spec_accepted_tokens for o in outs)
                drafted = sum(o.metrics.spec_draft_tokens for o in outs)
                hist: list[int] = []
                for o in outs:
                    for k, c in enumerate(o.metrics.spec_accept_histogram):
                        hist += [0] * (k + 1 - len(hist))
                        hist[k] += c
                row[set_name] = {"mean_accept_length": round((acc + steps_) / max(1, steps_), 3),
                                 "accept_rate": round(acc / max(1, drafted), 3), "verify_steps": steps_,
                                 "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                                 "accepted_drafts_histogram": hist, "wall_s": round(time.perf_counter() - t, 2)}
            allsteps = sum(r["verify_steps"] for r in row.values())
            row["all"] = {"mean_accept_length": round(sum(r["mean_accept_length"] * r["verify_steps"]
                                                          for r in row.values()) / max(1, allsteps), 3)}
            results[f"{name}@T={temp:g}"] = row
            print(f"{name:24s} T={temp:g}: chat {row['chat']['mean_accept_length']:.2f}  code "
                  f"{row['code']['mean_accept_length']:.2f}  all {row['all']['mean_accept_length']:.2f}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft dir (default: the bundled SmolLM2 head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--token-map", default=None, help="--speculative-token-map for the EAGLE-3 configs")
    ap.add_argument("--adaptive", default="on", choices=["on", "off"],
                    help="off: every step at the configured width (the draft's acceptance alone, whatever the "
                         "host's speed; on: the adaptive policy narrows widths by measured cost)")
    ap.add_argument("--configs", choices=["default", "wide"], default="default",
                    help="default: chain-5, tree top-4 x 16, n-gram; wide: trees of 32 and 64 nodes")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_accept_smollm2.json"))
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    draft = args.draft
    if draft is None:
        from tercel.speculative import DEFAULT_EAGLE3_DRAFT
        draft = str(DEFAULT_EAGLE3_DRAFT)
    temps = [float(t) for t in args.temps.split(",")]
    results = run(args.model, draft, args.device, args.max_tokens, temps,
                  WIDE_TREES if args.configs == "wide" else CONFIGS, args.token_map, args.adaptive)
    payload = {"benchmark": "speculative accept length on held-out prompts (tercel.train.data EVAL_*_PROMPTS)",
               "environment": environment(), "device": args.device,
               "model": args.model or "SmolLM2-135M-Instruct (default)",
               "draft": draft, "token_map": args.token_map, "adaptive": args.adaptive, "max_tokens": args.max_tokens,
               "prompts_per_set": 10,
               "mean_accept_length_definition": "(accepted drafts + bonus) / verify steps", "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
