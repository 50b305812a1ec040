"""GPU check of the chained EAGLE step (spec/chain.py): bf16 greedy at batch 16 x 128 tokens, eager vs graphs
without the chain (TERCEL_SPEC_CHAIN=0) vs the chain with the overlap schedule off and on; fp32 chain vs plain.
Where two outputs part, the target's top-2 logprob margin at that point (plain decoding of the shared prefix).

PYTHONPATH=. TERCEL_SMOL_GGUF=... python benchmarks/chain_check.py --out benchmarks/results/chain_check_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    from common import environment
    from conftest import CHAT_PROMPTS
    from spec_utils import spec_llm

    from tercel import LLM, SamplingParams
    from tercel.speculative import DEFAULT_EAGLE3_DRAFT

    gguf = os.environ["TERCEL_SMOL_GGUF"]
    e3 = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
              speculative_draft_model_path=DEFAULT_EAGLE3_DRAFT, kv_cache_memory=2 << 30)

    def toks(llm, prompts):
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    def part(base, prompts, a, b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                j = next(k for k, (p, q) in enumerate(zip(x, y)) if p != q)
                o = base.generate([prompts[i] + x[:j]], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0]
                top = sorted(o.outputs[0].logprobs[0].values(), reverse=True)
                out.append({"request": i, "token": j, "margin": round(top[0] - top[1], 5)})
        return out

    res: dict = {"environment": environment(), "tokens": args.tokens, "batch": 16}
    res["environment"]["command"] = "PYTHONPATH=. python " + " ".join(sys.argv)
    for dtype in ("bfloat16", "float32"):
        base = LLM(gguf, dtype=dtype, device="cuda", max_model_len=1024, kv_cache_memory=2 << 30, progress=False)
        tok = base.tokenizer
        chat = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        extra = [tok.encode("def fibonacci(n):"), tok.encode("The quick brown fox jumps over the lazy dog. " * 8)]
        prompts = ((chat + extra) * 2)[:16]
        runs = {"plain": toks(base, prompts), "eager": toks(spec_llm(base, disable_cuda_graph=True, **e3), prompts)}
        os.environ["TERCEL_SPEC_CHAIN"] = "0"
        runs["graphs_unchained"] = toks(spec_llm(base, cuda_graph_max_bs=32, **e3), prompts)
        os.environ["TERCEL_SPEC_CHAIN"] = "1"
        runs["chain"] = toks(spec_llm(base, cuda_graph_max_bs=32, disable_overlap_schedule=True, **e3), prompts)
        runs["chain_overlap"] = toks(spec_llm(base, cuda_graph_max_bs=32, **e3), prompts)
        if dtype == "bfloat16":
            os.environ["TERCEL_PDL"] = "0"
            runs["chain_overlap_pdl0"] = toks(spec_llm(base, cuda_graph_max_bs=32, **e3), prompts)
            runs["chain_pdl0"] = toks(spec_llm(base, cuda_graph_max_bs=32, disable_overlap_schedule=True, **e3),
                                      prompts)
            os.environ.pop("TERCEL_PDL")
        pairs = [("eager", "graphs_unchained"), ("eager", "chain"), ("chain", "chain_overlap"),
                 ("plain", "chain_overlap"), ("chain_pdl0", "chain_overlap_pdl0")]
        res[dtype] = {f"{a}_vs_{b}": part(base, prompts, runs[a], runs[b]) for a, b in pairs if a in runs and b in runs}
        print(dtype, json.dumps(res[dtype]), flush=True)
        del base
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
