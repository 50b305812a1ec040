"""Generate the self-distillation dataset (data.pt) once, for every draft trainer to share.

The target writes user prompts itself (Magpie-style) and answers them and the offline prompts of
tercel.train.data (held-out eval prompts excluded) with Tercel's engine at a large batch;
`tercel train-draft --out DIR` reuses DIR/data.pt when present.
One process leaves the GPU idle while it does each step's host work, so a job can run as n
processes side by side (--shard k/n, each with its own --kv-cache-memory), then join the parts:
Usage: PYTHONPATH=. python benchmarks/draft_data.py --out DIR [--model GGUF] [--device cuda]
       [--num-prompts 8000] [--synth-prompts 24000] [--max-new-tokens 256] [--batch 1024] [--time-budget 500]
       [--synth-share 0.2] [--shard K/N --kv-cache-memory GB]
       PYTHONPATH=. python benchmarks/draft_data.py --out DIR --merge PART.pt [PART.pt ...]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path


def parse_shard(text: str) -> tuple[int, int]:
    """'k/n' -> (k, n), k counted from 0."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: write it as K/N, e.g. 0/4 "
                                         "(shard K of N, from 0)") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: K must be in 0..N-1 (here 0..{n - 1})")
    return k, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--synth-prompts", type=int, default=24000,
                    help="user prompts the target writes itself (all shards)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024, help="prompt + response tokens")
    ap.add_argument("--batch", type=int, default=1024, help="requests running at once (and CUDA-graph max bs)")
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new waves after this (whole job)")
    ap.add_argument("--synth-share", type=float, default=0.2, help="most of the time budget spent writing prompts")
    ap.add_argument("--opener-share", type=float, default=0.0,
                    help="share of the synthetic prompts started with a question / task opener (data.QUESTION_OPENERS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), help="K/N: this process's part of an N-process job")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="GB of KV pool (default: most free memory)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PART", help="join these data files into OUT/data.pt")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    from tercel.train.data import make_dataset, merge_samples, save_samples

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        samples = merge_samples(args.merge)
    else:
        from common import exact_dtype  # benchmarks/ is the script's directory, so on sys.path

        from tercel import LLM

        kv = None if args.kv_cache_memory is None else int(args.kv_cache_memory * (1 << 30))
        llm = LLM(args.model, device=args.device, dtype=exact_dtype(args.device), max_model_len=args.max_len,
                  max_num_seqs=args.batch,
                  max_num_batched_tokens=max(8192, 4 * args.batch), cuda_graph_max_bs=args.batch, progress=False,
                  kv_cache_memory=kv)
        samples = make_dataset(llm, args.num_prompts, args.synth_prompts, args.max_new_tokens, 0.0, args.seed,
                               wave=4 * args.batch, time_budget_s=args.time_budget, synth_share=args.synth_share,
                               shard=args.shard, opener_share=args.opener_share)
    save_samples(samples, out / "data.pt")
    n = sum(len(s.response) for s in samples)
    print(f"{len(samples)} samples, {n} response tokens, "
          f"{time.perf_counter() - t0:.0f} s -> {out / 'data.pt'}", flush=True)


if __name__ == "__main__":
    main()
