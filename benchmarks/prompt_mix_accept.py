"""Where a draft's acceptance differs by kind of prompt: the mean accept length of the EAGLE-3 chain
(5 steps, T=0) on the held-out eval chat prompts and on the kinds of prompt the draft data is made
of: hand-written chat prompts (tercel.train.prompts), Magpie prompts the target writes unprompted,
and prompts it writes after a question / task opener (tercel.train.data.QUESTION_OPENERS).
A data mix dominated by an easy kind trains the draft for that kind; this shows which kinds are easy.

Usage: PYTHONPATH=. python benchmarks/prompt_mix_accept.py [--model GGUF] [--draft DIR] [--device cpu]
       [--prompts 20] [--max-tokens 128] [--name prompt_mix_accept_smollm2_cpu]  (-> benchmarks/results/NAME.json)
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, exact_dtype, write_result  # noqa: E402


def prompt_sets(llm, n: int, seed: int) -> dict[str, list[str]]:
    from tercel.train.data import EVAL_CHAT_PROMPTS, QUESTION_OPENERS, synth_user_prompts
    from tercel.train.prompts import chat_prompts

    rng = random.Random(seed)
    return {
        "eval_chat (held out)": list(EVAL_CHAT_PROMPTS),
        "hand_written_chat": rng.sample(chat_prompts(), n),
        "magpie": synth_user_prompts(llm, n, seed=seed, wave=2 * n),
        "opener": synth_user_prompts(llm, n, seed=seed + 1, wave=2 * n, openers=QUESTION_OPENERS),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft dir (default: the bundled SmolLM2 head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per generated / sampled set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=424242, help="seeds of the sampled and written prompts")
    ap.add_argument("--name", default="prompt_mix_accept_smollm2_cpu", help="results file benchmarks/results/NAME.json")
    args = ap.parse_args()
    from tercel import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=exact_dtype(args.device), progress=False, kv_cache_memory=1 << 30,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=args.draft, speculative_num_steps=5,
              speculative_eagle_topk=1)
    tok = llm.tokenizer
    results = {}
    for name, prompts in prompt_sets(llm, args.prompts, args.seed).items():
        ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(ids, [SamplingParams(max_tokens=args.max_tokens, temperature=0.0) for _ in ids],
                            use_tqdm=False)
        steps = sum(o.metrics.spec_verify_steps for o in outs)
        acc = sum(o.metrics.spec_accepted_tokens for o in outs)
        first = sum(o.metrics.spec_verify_steps - (o.metrics.spec_accept_histogram or [0])[0] for o in outs)
        results[name] = {"prompts": len(prompts), "verify_steps": steps,
                         "mean_accept_length": round((acc + steps) / max(1, steps), 3),
                         "first_draft_accepted": round(first / max(1, steps), 3),
                         "examples": prompts[:3], "wall_s": round(time.perf_counter() - t, 1)}
        print(f"{name:22s} {results[name]['mean_accept_length']:.2f} tokens/step, first draft accepted "
              f"{results[name]['first_draft_accepted']:.2f} ({len(prompts)} prompts, {steps} steps)", flush=True)
    print("wrote", write_result(args.name, {
        "benchmark": "EAGLE-3 chain-5 accept length at T=0 by kind of prompt", "environment": environment(),
        "device": args.device, "model": args.model or "SmolLM2-135M-Instruct (default)",
        "draft": args.draft or "bundled smollm2-eagle3", "max_tokens": args.max_tokens,
        "mean_accept_length_definition": "(accepted drafts + bonus) / verify steps", "results": results}))


if __name__ == "__main__":
    main()
