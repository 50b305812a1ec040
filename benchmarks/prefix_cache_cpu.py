"""Prefix caching on a CPU: time to first token per turn of a 6-turn chat whose ~1,500-token system prompt
is shared, with caching on and off (SmolLM2-135M-Instruct, fp32, greedy, one request at a time).

Each turn's prompt is the whole conversation so far (the chat template), so with caching on every turn
after the first finds its history in the cache and computes only the new tail. Reports per turn: prompt
tokens, cached tokens, TTFT on and off (median over rounds, a fresh engine per round so the first turn
is cold), the cached share of the prompt, and whether TTFT fell by at least that share; plus the hit rate.

    python benchmarks/prefix_cache_cpu.py --rounds 3 --out benchmarks/results/prefix_cache_cpu.json
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import environment, write_result

from tercel import LLM, SamplingParams
from tercel.engine import LLMEngine

USER_TURNS = ["Hello! I just joined the support team. What should I read first?",
              "How do I handle a customer who asks for a refund after 40 days?",
              "And if the product arrived damaged?", "Summarize the escalation rules in two sentences.",
              "Which of these rules changed most recently?", "Thanks. Write a short greeting I can paste into a chat."]
NEW_TOKENS = 32
KV_BLOCKS = 512  # 8192 tokens: the whole chat, and a small pool per engine (the CPU default is 1 GiB)


def system_prompt(tokenizer, target: int) -> str:
    """About `target` tokens of a support handbook: numbered rules, cut at a whole rule."""
    topics = ["refunds", "shipping delays", "damaged items", "account recovery", "invoices", "escalation",
              "warranty claims", "privacy requests", "discount codes", "subscriptions"]
    rules, k = [], 0
    while True:
        t = topics[k % len(topics)]
        rule = (f"Rule {k + 1} ({t}): when a customer writes about {t}, confirm their order number, restate the "
                f"problem in one sentence, check the {t} policy page, and answer within {5 + k % 7} minutes. ")
        if len(tokenizer.encode("".join(rules) + rule)) > target:
            return "You are a customer support assistant. Follow the handbook below.\n" + "".join(rules)
        rules.append(rule)
        k += 1


def conversation(llm: LLM, system: str) -> list[dict]:
    tok = llm.tokenizer
    messages = [{"role": "system", "content": system}]
    turns = []
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for text in USER_TURNS:
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages)
        out = llm.generate(ids, params)[0]
        turns.append({"prompt_tokens": len(ids), "cached_tokens": out.num_cached_tokens,
                      "ttft_s": out.metrics.time_to_first_token, "tokens": out.outputs[0].token_ids})
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    return turns


def engine_on(base: LLM, enable: bool) -> LLM:
    llm = LLM.__new__(LLM)
    e = base.engine
    llm.engine = LLMEngine(loaded=e.loaded, dtype=e.dtype, device=e.device, max_model_len=e.config.max_model_len,
                           num_kv_blocks=KV_BLOCKS, enable_prefix_caching=enable)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/prefix_cache_cpu.json)")
    args = ap.parse_args()
    base = LLM(None, dtype="float32", device="cpu", max_model_len=4096, num_kv_blocks=KV_BLOCKS, progress=False)
    system = system_prompt(base.tokenizer, args.system_tokens)
    runs: dict[str, list[list[dict]]] = {"on": [], "off": []}
    hit_rates = []
    for _ in range(args.rounds):
        for mode in ("off", "on"):  # alternated, so load drifts hit both alike
            llm = engine_on(base, mode == "on")
            runs[mode].append(conversation(llm, system))
            if mode == "on":
                hit_rates.append(llm.engine.stats().prefix_cache_hit_rate)
            del llm
            gc.collect()
    same = all(a["tokens"] == b["tokens"] for r_on, r_off in zip(runs["on"], runs["off"])
               for a, b in zip(r_on, r_off))
    table = []
    for t in range(len(USER_TURNS)):
        on = statistics.median(r[t]["ttft_s"] for r in runs["on"])
        off = statistics.median(r[t]["ttft_s"] for r in runs["off"])
        first = runs["on"][0][t]
        share = first["cached_tokens"] / first["prompt_tokens"]
        table.append({"turn": t + 1, "prompt_tokens": first["prompt_tokens"], "cached_tokens": first["cached_tokens"],
                      "cached_share": round(share, 3), "ttft_on_s": round(on, 4), "ttft_off_s": round(off, 4),
                      "speedup": round(off / on, 2), "ttft_drop": round(1 - on / off, 3),
                      "drop_at_least_cached_share": 1 - on / off >= share})
    payload = {
        "benchmark": "prefix caching: time to first token per turn of a 6-turn chat with a shared system prompt",
        "environment": environment(),
        "load_average_at_end": list(os.getloadavg()),
        "model": "SmolLM2-135M-Instruct (default)", "dtype": "float32", "new_tokens_per_turn": NEW_TOKENS,
        "system_prompt_tokens": len(base.tokenizer.encode(system)), "rounds": args.rounds,
        "max_num_batched_tokens": base.engine.config.max_num_batched_tokens,
        "ttft_definition": "RequestOutput.metrics.time_to_first_token (add_request to the first token), median over "
                           "rounds; each round a fresh engine per mode, the same conversation",
        "same_tokens_on_and_off": same,
        "hit_rate": round(statistics.median(hit_rates), 4),
        "turns": table,
        "later_turns_drop_at_least_cached_share": all(r["drop_at_least_cached_share"] for r in table[1:]),
    }
    path = write_result("prefix_cache_cpu", payload) if args.out is None else Path(args.out)
    if args.out is not None:
        import json

        path.write_text(json.dumps(payload, indent=2) + "\n")
    for r in table:
        print(f"turn {r['turn']}: {r['prompt_tokens']:5d} tokens, {r['cached_tokens']:5d} cached "
              f"({r['cached_share']:.0%}); TTFT on {r['ttft_on_s'] * 1000:7.1f} ms, "
              f"off {r['ttft_off_s'] * 1000:7.1f} ms ({r['speedup']:.1f}x)")
    print(f"hit rate {payload['hit_rate']:.1%}, same tokens on and off: {same}; wrote {path}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    main()
