"""Generate the self-distillation dataset (data.pt) once, for every draft trainer to share.

The target writes user prompts itself (Magpie-style) and answers them and the offline prompts of
tercel.train.data (held-out eval prompts excluded) with Tercel's engine at a large batch;
`tercel train-draft --out DIR` reuses DIR/data.pt when present.
Usage: PYTHONPATH=. python benchmarks/draft_data.py --out DIR [--model GGUF] [--device cuda]
       [--num-prompts 8000] [--synth-prompts 24000] [--max-new-tokens 256] [--batch 1024] [--time-budget 500]
       [--synth-share 0.2]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tercel import LLM
from tercel.train.data import make_dataset, save_samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--synth-prompts", type=int, default=24000, help="user prompts the target writes itself")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024, help="prompt + response tokens")
    ap.add_argument("--batch", type=int, default=1024, help="requests running at once (and CUDA-graph max bs)")
    ap.add_argument("--time-budget", type=float, default=None, help="stop starting new waves after this (whole job)")
    ap.add_argument("--synth-share", type=float, default=0.2, help="most of the time budget spent writing prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, max_model_len=args.max_len, max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, 4 * args.batch), cuda_graph_max_bs=args.batch, progress=False)
    samples = make_dataset(llm, args.num_prompts, args.synth_prompts, args.max_new_tokens, 0.0, args.seed,
                           wave=4 * args.batch, time_budget_s=args.time_budget, synth_share=args.synth_share)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_samples(samples, out / "data.pt")
    n = sum(len(s.response) for s in samples)
    print(f"{len(samples)} samples, {n} response tokens, "
          f"{time.perf_counter() - t0:.0f} s -> {out / 'data.pt'}", flush=True)


if __name__ == "__main__":
    main()
