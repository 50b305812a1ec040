"""Build a hot-token map for --speculative-token-map from the target's own greedy answers to offline
prompts (the same prompt builder as draft training; the eval prompts are excluded): the
end-of-sequence ids, then the response tokens by frequency, then (when the answers hold fewer distinct
tokens than `size`) the prompts' tokens by frequency, as a sorted JSON list.

Usage: python -m tercel.train.token_map --out map.json [--target PATH] [--size 8192] [--prompts 1024]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from pathlib import Path

from .data import Sample, build_prompts, generate_responses


def hot_token_ids(samples: list[Sample], size: int, always: tuple[int, ...] = ()) -> list[int]:
    """At most `size` ids: `always`, then response tokens by count, then prompt tokens by count; sorted."""
    resp = Counter(t for s in samples for t in s.response)
    prompt = Counter(t for s in samples for t in s.prompt)
    ranked = [*always, *(t for t, _ in resp.most_common()), *(t for t, _ in prompt.most_common())]
    return sorted(list(dict.fromkeys(ranked))[:size])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tercel.train.token_map", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .json map to write")
    ap.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--size", type=int, default=8192, help="tokens in the map")
    ap.add_argument("--prompts", type=int, default=1024, help="offline prompts the target answers")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="requests generated at once")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from ..llm import LLM

    llm = LLM(args.target, device=args.device, max_num_seqs=args.batch, progress=False)
    vocab = llm.engine.model_config.vocab_size
    if not 1 <= args.size <= vocab:
        raise SystemExit(f"--size {args.size} must be in 1..{vocab} (the target's vocabulary).")
    t = time.perf_counter()
    samples = generate_responses(llm, build_prompts(args.prompts, args.seed), args.max_new_tokens, use_tqdm=True)
    counts = Counter(tok for s in samples for tok in s.response)
    ids = hot_token_ids(samples, args.size, always=tuple(sorted(llm.engine.eos_token_ids)))
    covered = sum(counts[i] for i in ids) / max(1, sum(counts.values()))
    Path(args.out).write_text(json.dumps(ids) + "\n")
    print(f"{args.out}: {len(ids)} tokens covering {covered:.4f} of {sum(counts.values())} response tokens "
          f"({len(counts)} distinct) from {len(samples)} answers in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
